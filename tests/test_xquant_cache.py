"""XQuant cache (X path and GQA latent path) against float64 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.cache import init_caches
from kvlowrank.cache.xquant import XQuantSpec, choose_path, svd_factors
from kvlowrank.cache.xquant_store import TokenStore
from kvlowrank.model.params import init_params
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from np_reference import np_forward

GQA = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                ffn_dim=96, qkv_bias=True)
MHA = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16,
                ffn_dim=96)
T = 24


def _setup(spec, seed=0):
  params = init_params(spec, jax.random.key(seed), scale=0.15)
  tokens = jax.random.randint(jax.random.key(seed + 1), (2, T), 0, spec.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  return params, tokens, pos


_fwd = jax.jit(forward, static_argnums=4)
_NP_CACHE = {}


def np_logits(spec, params, tokens):
  """float64 numpy forward (tests/np_reference.py), memoised per (spec, tokens)."""
  key = (spec, np.asarray(tokens).tobytes())
  if key not in _NP_CACHE:
    _NP_CACHE[key] = np.stack([np_forward(params, np.asarray(t), spec) for t in tokens])
  return _NP_CACHE[key]


def _run(spec, params, tokens, pos, xspec, mode, capacity=32, method="xquant"):
  caches = init_caches(method, xspec, spec, params, batch=tokens.shape[0],
                       capacity=capacity, dtype=jnp.float32)
  if mode == "prefill":
    return _fwd(params, tokens, pos, caches, spec)
  outs = []
  for t in range(tokens.shape[1]):
    o, caches = _fwd(params, tokens[:, t:t + 1], pos[:, t:t + 1], caches, spec)
    outs.append(o)
  return jnp.concatenate(outs, 1), caches


@pytest.mark.parametrize("spec", [GQA, MHA], ids=["gqa_bias", "mha"])
@pytest.mark.parametrize("path", ["x", "latent"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_unquantized_matches_dense(spec, path, mode):
  """Reference: the float64 numpy decoder for the GQA+bias model, the dense (uncached)
  fp32 forward for the MHA one (keeps the suite fast; the dense forward is itself
  checked against numpy and HF in test_model.py)."""
  params, tokens, pos = _setup(spec)
  logits, _ = _run(spec, params, tokens, pos, XQuantSpec(bits=None, path=path), mode)
  if spec is GQA:
    want = np_logits(spec, params, tokens)
  else:
    want = np.asarray(_fwd(params, tokens, pos, None, spec)[0])
  np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)
  if mode == "prefill":  # Negative control: the 2-bit cache must visibly change the logits.
    q_logits, _ = _run(spec, params, tokens, pos,
                       XQuantSpec(bits=2, path=path, group_size=16), mode)
    assert np.abs(np.asarray(q_logits) - want).max() > 1e-2


def test_svd_factors_exact():
  w = np.random.default_rng(0).normal(size=(64, 32))
  u, r = svd_factors(w)
  np.testing.assert_allclose(u.T @ u, np.eye(32), atol=1e-12)
  np.testing.assert_allclose(u @ r, w, atol=1e-12)
  assert not np.allclose(u[:, :31] @ r[:31], w, atol=1e-3)  # a truncation is not exact


def test_auto_path_picks_smaller_footprint():
  smollm2 = ModelSpec(vocab_size=8, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, head_dim=64,
                      ffn_dim=8)
  llama2 = ModelSpec(vocab_size=8, dim=4096, n_layers=1, n_heads=32, n_kv_heads=32,
                     head_dim=128, ffn_dim=8)
  llama3 = llama2.replace(n_kv_heads=8)
  stories = ModelSpec(vocab_size=8, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, head_dim=8,
                      ffn_dim=8)
  assert choose_path(smollm2) == "latent"      # 2*192 = 384 < 576
  assert choose_path(llama2) == "x"            # 8192 > 4096
  assert choose_path(llama3) == "latent"       # 2048 < 4096
  assert choose_path(stories) == "x"           # tie 64 == 64 -> the plain method
  assert choose_path(smollm2, "x") == "x"


def np_quant(x, bits, axis, group):
  """float64 min/max quantize-dequantize (fp16 scale/zero as stored), groups along axis."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  xg = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
  s = ((mx - mn) / (2 ** bits - 1)).astype(np.float16).astype(np.float64)
  z = mn.astype(np.float16).astype(np.float64)
  code = np.where(s > 0, np.clip(np.round((xg - z) / np.where(s > 0, s, 1)), 0, 2**bits - 1), 0)
  return np.moveaxis((code * s + z).reshape(x.shape), -1, axis)


@pytest.mark.parametrize("axis,window", [("token", 0), ("token", 8), ("channel", 0)])
def test_store_rows_match_numpy_quantizer_in_chunks(axis, window):
  """Appending in uneven chunks (prefill 11, decode 1s, then 9) stores exactly what a
  one-shot float64 quantizer gives: complete groups/blocks quantized, the tail exact."""
  rng = np.random.default_rng(1)
  b, s, c, g, bits = 2, 40, 32, 8, 3
  x = rng.normal(size=(b, 29, c)).astype(np.float32)
  st = TokenStore.init(batch=b, capacity=s, width=c, bits=bits, axis=axis, group_size=g,
                       window=window, dtype=jnp.float32)
  chunks = [(0, 11)] + [(t, t + 1) for t in range(11, 20)] + [(20, 29)]
  for lo, hi in chunks:
    pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
    st = st.append(jnp.asarray(x[:, lo:hi]), pos)
  got = np.asarray(st.rows())[:, :29]
  f = st.flush
  nq = 29 if f == 0 else (29 // f) * f
  want = x.astype(np.float64).copy()
  want[:, :nq] = np_quant(x[:, :nq], bits, -1 if axis == "token" else 1, g)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.asarray(st.lens).tolist() == [29, 29]
  # Negative control: the quantized rows really are quantized (3-bit error is visible).
  assert np.abs(got[:, :nq] - x[:, :nq]).max() > 1e-2


def test_nbytes_exact_and_bytes_per_token():
  spec = MHA
  params, _, _ = _setup(spec)
  caches = init_caches("xquant", XQuantSpec(bits=2, path="x", group_size=16), spec, params,
                       batch=3, capacity=40, dtype=jnp.bfloat16)
  # codes: 64 ch / 16 per word = 4 words; scale+zero: 4 groups fp16; lens int32.
  want = 3 * 40 * 4 * 4 + 2 * 3 * 40 * 4 * 2 + 3 * 4
  assert caches[0].nbytes() == want
  assert caches[0].bytes_per_token() == 4 * 4 + 2 * 4 * 2
  lat = init_caches("xquant", XQuantSpec(bits=4, path="latent", group_size=16), GQA,
                    init_params(GQA, jax.random.key(0)), batch=1, capacity=32,
                    dtype=jnp.float32)
  c = lat[0]
  # K latent 32 ch per channel (groups of 16 tokens, exact tail of 16), V latent per token.
  k_bytes = 32 * 4 * 4 + 2 * (32 // 16) * 32 * 2 + 16 * 32 * 4 + 4
  v_bytes = 32 * 4 * 4 + 2 * 32 * 2 * 2 + 4
  assert c.nbytes() == k_bytes + v_bytes
  assert c.weights_nbytes() == 4 * (64 * 32 + 32 * 32) * 2


def test_quantization_error_shrinks_with_bits():
  params, tokens, pos = _setup(GQA, seed=3)
  dense, _ = forward(params, tokens, pos, None, GQA)
  errs = []
  for bits in (2, 3, 4):
    logits, _ = _run(GQA, params, tokens, pos, XQuantSpec(bits=bits, path="x", group_size=16),
                     "prefill")
    errs.append(float(jnp.abs(logits - dense).mean()))
  assert errs[0] > errs[1] > errs[2] > 0


def test_invalid_configs_raise_clear_errors():
  params, _, _ = _setup(MHA)
  with pytest.raises(ValueError, match="XQuantSpec.bits"):
    XQuantSpec(bits=5)
  with pytest.raises(ValueError, match="XQuantSpec.path"):
    XQuantSpec(path="svd")
  with pytest.raises(ValueError, match="XQuantSpec.group_size"):
    XQuantSpec(group_size=0)
  with pytest.raises(ValueError, match="key_axis"):
    XQuantSpec(key_axis="head")
  with pytest.raises(ValueError, match="group_size .48. must divide"):
    init_caches("xquant", XQuantSpec(bits=2, path="x", group_size=48), MHA, params, batch=1,
                capacity=8)
  with pytest.raises(ValueError, match="needs a XQuantSpec"):
    init_caches("xquant", 3, MHA, params, batch=1, capacity=8)
  # A group larger than the width is clamped to it (one group per token).
  c = init_caches("xquant", XQuantSpec(bits=2, path="x", group_size=128), MHA, params,
                  batch=1, capacity=8)
  assert c[0].stores[0].group == 64


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["x", "latent"])
def test_triton_remat_in_cache_matches_reference(path):
  params, tokens, pos = _setup(GQA, seed=5)
  got, _ = _run(GQA, params, tokens, pos,
                XQuantSpec(bits=3, path=path, group_size=16, implementation="triton"), "prefill")
  want, _ = _run(GQA, params, tokens, pos,
                 XQuantSpec(bits=3, path=path, group_size=16, implementation="reference"),
                 "prefill")
  assert float(jnp.abs(got - want).max()) < 5e-2 * float(jnp.abs(want).max())
