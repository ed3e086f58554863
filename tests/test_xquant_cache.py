"""XQuant cache (X path and GQA latent path) against float64 references; the attention
dispatch (fused decode op vs materialised K/V) and the bf16 backends against an error
model of their MMA operand rounding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.methods import init_caches
from kvlowrank.methods.xquant import cache as xquant
from kvlowrank.methods.xquant import cl as xquant_cl
from kvlowrank.cache import dispatch
from kvlowrank.methods.xquant import factors
from kvlowrank.methods.xquant.cache import XQuantSpec, choose_path
from kvlowrank.methods.xquant.factors import svd_factors
from kvlowrank.methods.xquant.store import TokenStore
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


def _run(spec, params, tokens, pos, xspec, mode, capacity=32, method="xquant", fwd=None):
  """Logits and caches of a prefill (one call) or decode (token by token) run; `fwd`: a
  fresh jit of forward where a test patches traced code."""
  fwd = fwd or _fwd
  caches = init_caches(method, xspec, spec, params, batch=tokens.shape[0],
                       capacity=capacity, dtype=jnp.float32)
  if mode == "prefill":
    return fwd(params, tokens, pos, caches, spec)
  outs = []
  for t in range(tokens.shape[1]):
    o, caches = fwd(params, tokens[:, t:t + 1], pos[:, t:t + 1], caches, spec)
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


@pytest.mark.parametrize("method", ["xquant", "xquant_cl"])
def test_latent_factors_computed_once_per_weights(monkeypatch, method):
  """The latent path's SVD runs once per layer's weights: a second init_caches over the
  same params reuses it (same factors); new weight arrays (copies) recompute it, and the
  entries go when their weights are freed (negative controls)."""
  from kvlowrank.methods import XQuantCLSpec  # pylint: disable=import-outside-toplevel
  calls = []
  real = factors.svd_factors
  counting = lambda w: calls.append(w.shape) or real(w)
  monkeypatch.setattr(xquant, "svd_factors", counting)
  monkeypatch.setattr(xquant_cl, "svd_factors", counting)
  mspec = (XQuantSpec(bits=4, path="latent", group_size=16) if method == "xquant"
           else XQuantCLSpec(bits=4, path="latent", group_size=16))
  basis = (lambda c: c.proj) if method == "xquant" else (lambda c: (c.u,))
  params = init_params(GQA, jax.random.key(3), scale=0.15)
  before = factors.cached_count()
  first = init_caches(method, mspec, GQA, params, batch=1, capacity=32)
  n_first = len(calls)
  assert n_first >= GQA.n_layers - (method == "xquant_cl")  # base layer: XCache's own factors
  again = init_caches(method, mspec, GQA, params, batch=2, capacity=64)
  assert len(calls) == n_first                                  # reused
  for a, b in zip(first, again):
    for x, y in zip(basis(a), basis(b)):
      if x is not None:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  copy = jax.tree.map(lambda a: a + 0, params)                  # new arrays, same values
  init_caches(method, mspec, GQA, copy, batch=1, capacity=32)
  assert len(calls) == 2 * n_first                              # recomputed
  grown = factors.cached_count()
  assert grown > before
  del copy
  import gc  # pylint: disable=import-outside-toplevel
  gc.collect()
  assert factors.cached_count() < grown                         # freed with their weights


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


# --- Attention dispatch: fused decode op (K/V never materialised) vs materialised K/V ---

def _fresh_fwd():
  """A jitted forward with its own trace cache (jax caches traces per Python function, so a
  test that patches traced code needs a new function object)."""
  return jax.jit(lambda p, t, q, c, s: forward(p, t, q, c, s), static_argnums=4)


FUSED = [(GQA, "latent", 0), (MHA.replace(rope_layout="interleaved"), "x", 8), (GQA, "x", 0)]


@pytest.mark.parametrize("spec,path,window", FUSED,
                         ids=["gqa-latent-channel-tail", "mha-interleaved-window", "gqa-x"])
def test_fused_decode_dispatch_matches_materialising(spec, path, window, monkeypatch):
  """implementation="reference_fused" routes every decode step through the fused op (its
  jnp reference): quantized prefix fused, exact tails (the incomplete per-channel token
  group, the per-token window) attended densely, LSE-merged. Token-by-token logits must
  equal the materialising path to fp32 rounding."""
  params, tokens, pos = _setup(spec, seed=2)
  xs = XQuantSpec(bits=3, path=path, group_size=16, window=window)
  want, _ = _run(spec, params, tokens, pos, xs, "decode")
  calls = []
  real = xquant.fused_decode
  monkeypatch.setattr(xquant, "fused_decode", lambda *a: calls.append(a[-1]) or real(*a))
  fused = dataclasses.replace(xs, implementation="reference_fused")
  got, _ = _run(spec, params, tokens, pos, fused, "decode", fwd=_fresh_fwd())
  assert calls == ["reference"] * spec.n_layers   # traced once per layer: decode was fused
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=0)
  if path == "latent":
    # Negative control: the fused op drops the newer half of each row's quantized keys.
    op = xquant.dm.remat_decode_attention
    monkeypatch.setattr(xquant.dm, "remat_decode_attention",
                        lambda *a, **k: op(*a[:9], a[9] // 2, **k))
    bad, _ = _run(spec, params, tokens, pos, fused, "decode", fwd=_fresh_fwd())
    assert np.abs(np.asarray(bad) - np.asarray(want)).max() > 1e-2


def test_decode_dispatch_rule():
  """The module doc's rule, as a GPU would apply it (platform injected): decode (T == 1)
  without a sliding window takes "xla" (remat + the dense decode kernel) where the dense
  kernels take the K/V, else the fused "triton" op where it fits, else the reference;
  "reference_fused" routes decode through the fused op's jnp reference; "auto" = None."""
  params, _, _ = _setup(GQA)
  make = lambda xs, dtype=jnp.bfloat16: init_caches("xquant", xs, GQA, params, batch=1,
                                                    capacity=32, dtype=dtype)[0]
  gpu, cpu = dispatch.Platform(gpu=True, hopper=True), dispatch.Platform(gpu=False, hopper=False)
  cache = make(XQuantSpec(bits=2, path="latent", group_size=16))
  h = GQA.head_dim
  decode, prefill = (1, 1, GQA.n_heads, h), (1, 4, GQA.n_heads, h)
  choose = lambda c, shape=decode, impl=None, pf=gpu: c.choose_implementation(
      shape, impl, platform=pf)
  assert choose(cache)[0] == "xla"
  assert choose(cache, impl="auto")[0] == "xla"
  assert choose(cache, impl="triton")[0] == "triton"
  assert choose(cache, pf=cpu)[0] == dispatch.REFERENCE
  assert choose(cache, prefill)[0] == dispatch.REFERENCE
  assert choose(cache, impl="reference")[0] == dispatch.REFERENCE
  # fp32 K/V: no dense kernel takes them, so the fused op (head dim 16, widths 32) runs.
  impl, reason = choose(make(XQuantSpec(bits=2, path="latent", group_size=16), jnp.float32))
  assert impl == "triton" and "float32" in reason
  # Negative control: a head dim the fused op refuses leaves the reference.
  fp32 = make(XQuantSpec(bits=2, path="latent", group_size=16), jnp.float32)
  impl, reason = choose(fp32, (1, 1, GQA.n_heads, 24))
  assert impl == dispatch.REFERENCE and "power of 2" in reason
  window = dataclasses.replace(cache, sliding_window=8)
  assert choose(window)[0] == dispatch.REFERENCE and "sliding" in choose(window)[1]
  fused = dataclasses.replace(cache, implementation="reference_fused")
  assert choose(fused)[0] == "reference_fused"
  assert choose(fused, prefill)[0] == dispatch.REFERENCE          # prefill chunk
  assert choose(dataclasses.replace(fused, sliding_window=8))[0] == dispatch.REFERENCE
  exact = dataclasses.replace(make(XQuantSpec(bits=None, path="x")),
                              implementation="reference_fused")
  assert choose(exact)[0] == dispatch.REFERENCE                   # exact rows: nothing to fuse
  with pytest.raises(ValueError, match="XQuantSpec.implementation"):
    XQuantSpec(implementation="cuda")


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def mma_error_sigma(cache, lp, spec, q, q_pos, u, w_rounded):
  """Expected error (std, [B, T, N, H]) of `attend` when K/V are rematerialised with MMA
  operands of unit roundoff u, against exact arithmetic on the same stored codes.

  Model (first principles): each rounding to the operand dtype multiplies a value by
  (1 + ε), ε independent with |ε| <= u, std <= u/√3 (round to nearest). With a_t = W_h·r_t
  the query absorbed into the key weights (r_t: the RoPE-rotated, scaled query as it acts on
  the pre-RoPE key k_t = x̂_t·W_h + b), the score error of key t has variance
    σ_s² = σ² [Σ_c (x̂_tc a_tc)²  (x̂ rounded)  + w·Σ_cj (x̂_tc w_cj r_tj)²  (W rounded)
               + 2 Σ_j k_tj² (cos² qa² + sin² qb²)_j  (k∘cos, k∘sin and q rounded)],
  the value error σ_v² = σ² (1 + w) Σ_c x̂_tc² w_cj² + 2σ² v_tj² (P and V rounded), and the
  softmax turns them into out_j errors with variance <= Σ_t p_t² (σ_s,t |v_tj − o_j| + σ_v,tj)²
  (dp_t = p_t (ds_t − Σ p ds); x̂-rounding errors are shared by K and V, hence the
  correlated sum). fp32 accumulation (relative 2^-24 per step) is far below these terms.
  """
  sig = u / np.sqrt(3.0)
  wsc = 1.0 if w_rounded else 0.0
  if cache.path == "x":
    xk = xv = _f64(cache.stores[0].rows())
    wk, wv = _f64(lp["wk"]), _f64(lp["wv"])
  else:
    xk, xv = _f64(cache.stores[0].rows()), _f64(cache.stores[1].rows())
    wk, wv = _f64(cache.proj[1]), _f64(cache.proj[3])
  kh, h, n = spec.n_kv_heads, spec.head_dim, spec.n_heads
  g, h2 = n // kh, spec.head_dim // 2
  bk = _f64(lp["bk"]) if spec.qkv_bias else 0.0
  bv = _f64(lp["bv"]) if spec.qkv_bias else 0.0
  k_pre = xk @ wk + bk
  v_all = xv @ wv + bv
  s_len = xk.shape[1]
  inv = 1.0 / spec.rope_theta ** (np.arange(0, h, 2) / h)
  ang = np.arange(s_len)[:, None] * inv[None, :]
  cf, sf = np.tile(np.cos(ang), 2), np.tile(np.sin(ang), 2)   # [S, H], column j -> j mod H/2
  qf, lens, qp = _f64(q) / np.sqrt(h), np.asarray(cache.lengths), np.asarray(q_pos)
  out = np.zeros(qf.shape)
  for b in range(qf.shape[0]):
    for t in range(qf.shape[1]):
      valid = (np.arange(s_len) < lens[b]) & (np.arange(s_len) <= qp[b, t])
      if not valid.any():
        continue
      for hd in range(n):
        j = hd // g
        cols = slice(j * h, (j + 1) * h)
        qa = qf[b, t, hd]
        qb = np.concatenate([qa[h2:], -qa[:h2]])
        r = qa[None] * cf + qb[None] * sf                       # [S, H]
        k, v, wkh, wvh = k_pre[b, :, cols], v_all[b, :, cols], wk[:, cols], wv[:, cols]
        s = np.where(valid, np.sum(k * r, -1), -np.inf)
        p = np.exp(s - s.max())
        p /= p.sum()
        o = p @ v
        a = r @ wkh.T                                           # [S, C]
        var_s = (np.sum((xk[b] * a) ** 2, -1)
                 + wsc * np.sum(((xk[b] ** 2) @ (wkh ** 2)) * r ** 2, -1)
                 + 2 * np.sum(k ** 2 * ((cf * qa) ** 2 + (sf * qb) ** 2), -1))
        var_v = (1 + wsc) * ((xv[b] ** 2) @ (wvh ** 2)) + 2 * v ** 2
        terms = np.sqrt(var_s)[:, None] * np.abs(v - o) + np.sqrt(var_v)
        out[b, t, hd] = sig * np.sqrt(np.sum((p[:, None] * terms) ** 2, 0))
  return out


def _layer_caches(spec, params, tokens, pos, path):
  """Prefill through the reference path once: every implementation then attends the same
  stored codes (the end-to-end logits of two backends are not comparable: an fp rounding
  difference in layer i's output can flip a rounding decision of layer i+1's quantizer,
  a full quantization step; that is how the old GPU test missed its bound by 6%)."""
  xs = XQuantSpec(bits=3, path=path, group_size=16)
  _, caches = _run(spec, params, tokens, pos, xs, "prefill")
  return caches


def check_attend_within_model(spec, params, caches, impl, u, w_rounded, seed, k_sigma=6.0,
                              got_caches=None):
  """attend(impl) vs attend("reference") on the same caches (or impl on `got_caches`: the
  negative controls), for a decode query (T = 1: the fused path) and a 4-token chunk
  (T > 1: materialised K/V) at the last positions, within k_sigma·σ + a fp32 floor;
  returns the worst error / tolerance ratio."""
  b, length = caches[0].lengths.shape[0], int(caches[0].lengths[0])
  worst = 0.0
  for i, (cache, lp) in enumerate(zip(caches, params["layers"])):
    got_cache = cache if got_caches is None else got_caches[i]
    for t in (1, 4):
      qkey = jax.random.key(seed + 10 * i + t)
      q = jax.random.normal(qkey, (b, t, spec.n_heads, spec.head_dim), jnp.float32)
      q = q.astype(lp["wk"].dtype)
      qp = jnp.broadcast_to(jnp.arange(length - t, length, dtype=jnp.int32), (b, t))
      want, _ = cache.attend(q, qp, lp, spec=spec)
      got, _ = dataclasses.replace(got_cache, implementation=impl).attend(q, qp, lp, spec=spec)
      sigma = mma_error_sigma(cache, lp, spec, q, qp, u, w_rounded)
      err = np.abs(_f64(got) - _f64(want))
      tol = k_sigma * sigma + 1e-5 * (1 + np.abs(_f64(want)))
      worst = max(worst, float((err / tol).max()))
  return worst


def _flip_code(caches):
  """Caches whose first store has one code word of slot 3 inverted (every code of it
  moves by at least one quantization step)."""
  out = []
  for c in caches:
    st = c.stores[0]
    st = dataclasses.replace(st, codes=st.codes.at[:, 3, 0].set(~st.codes[:, 3, 0]))
    out.append(dataclasses.replace(c, stores=(st,) + c.stores[1:]))
  return tuple(out)


@pytest.mark.parametrize("path", ["x", "latent"])
def test_xla_remat_within_bf16_error_model(path):
  """implementation="xla" (X̂ and W rounded to bf16, fp32 accumulation, then the fp32
  attention) stays within 6σ of the bf16 rounding model; negative control: the same
  comparison with a corrupted stored code (one code word flipped) fails it."""
  params, tokens, pos = _setup(GQA, seed=4)
  caches = _layer_caches(GQA, params, tokens, pos, path)
  worst = check_attend_within_model(GQA, params, caches, "xla", 2.0 ** -8, True, seed=7)
  assert worst < 1.0, worst
  bad = check_attend_within_model(GQA, params, caches, "xla", 2.0 ** -8, True, seed=7,
                                  got_caches=_flip_code(caches))
  assert bad > 1.0, bad


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["x", "latent"])
def test_triton_attend_within_error_model(path, dtype):
  """implementation="triton" on the same stored codes as the reference: decode queries run
  the fused kernel, 4-token chunks the dequant-matmul kernel. bf16 weights: every MMA
  operand is rounded to bf16 (u = 2^-8); fp32 weights keep fp32 products (EXACT), so only
  accumulation order differs (modelled as u = 2^-20). Negative control as above."""
  params, tokens, pos = _setup(GQA, seed=5)
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  caches = _layer_caches(GQA, params, tokens, pos, path)
  u, w_rounded = (2.0 ** -8, False) if dtype == "bfloat16" else (2.0 ** -20, True)
  worst = check_attend_within_model(GQA, params, caches, "triton", u, w_rounded, seed=9)
  assert worst < 1.0, worst
  bad = check_attend_within_model(GQA, params, caches, "triton", u, w_rounded, seed=9,
                                  got_caches=_flip_code(caches))
  assert bad > 1.0, bad


@pytest.mark.parametrize("path,window,swa", [("x", 0, None), ("x", 16, None),
                                             ("latent", 0, None), ("latent", 0, 24)])
def test_chunked_xla_attend_equals_whole_cache(path, window, swa):
  """`XCache.chunked_attend` (the "xla" decode path, `decode_chunk` tokens at a time, LSE
  merged) equals attention over the whole cache rematerialised the same way ("xla": 16-bit
  GEMM operands), and the reference path within that rounding, at every layer, with full
  chunks, a remainder chunk, per-channel key latents whose groups straddle nothing, an
  exact tail and a padding query row; with a sliding window (swa) too. Negative controls:
  chunks rematerialised at the wrong positions (start off by one chunk) change the output;
  with swa, so does attending without the window."""
  spec = GQA if swa is None else GQA.replace(sliding_window=swa)
  params, tokens, pos = _setup(GQA)
  xs = XQuantSpec(bits=3, path=path, group_size=16, window=window, decode_chunk=32)
  caches = init_caches("xquant", xs, spec, params, batch=2, capacity=80, dtype=jnp.float32)
  t = 70    # tail rows past the last complete group / flush block
  toks = jax.random.randint(jax.random.key(5), (2, t), 0, GQA.vocab_size)
  p = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  p = p.at[1, 60:].set(-1)             # row 1 is 60 tokens long
  _, caches = _fwd(params, toks, p, caches, spec)
  c0 = caches[0]
  assert c0.chunks() == (32, 2, 16) and c0.sliding_window == swa
  q = jax.random.normal(jax.random.key(6), (2, 1, GQA.n_heads, GQA.head_dim), jnp.float32)
  qpos = jnp.asarray([[t - 1], [-1]], jnp.int32)   # row 1: a padding query

  def whole(c, q, qpos, lp, window=swa):
    k, v = c.rematerialize(lp, spec, c.dtype, "xla")
    sp = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), k.shape[:2])
    return xquant.dot_product_attention(q, k, v, qpos, sp, sp < c.lengths[:, None],
                                        sliding_window=window, out_dtype=jnp.float32)

  attend = jax.jit(lambda c, q, lp: c.chunked_attend(q, qpos, lp, spec))  # every layer
  for c, lp in zip(caches, params["layers"]):
    out, lse = attend(c, q, lp)
    want, wlse = whole(c, q, qpos, lp)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(lse)[0], np.asarray(wlse)[0], atol=2e-6)
    assert np.all(np.asarray(out)[1] == 0)
    ref, _ = c.attend(q, qpos, lp, spec=spec, implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-2, rtol=0)
  qpos0 = jnp.asarray([[t - 1], [59]], jnp.int32)
  out, _ = c0.chunked_attend(q, qpos0, params["layers"][0], spec)
  want, _ = whole(c0, q, qpos0, params["layers"][0])
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=0)
  if swa is not None:   # negative control: the window matters here
    unwindowed, _ = whole(c0, q, qpos0, params["layers"][0], window=None)
    assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-3
  # Negative control: each full chunk rematerialised at the next chunk's positions.
  orig = xquant.XCache.rematerialize

  def shifted(self, lp, spec, dtype, implementation=None, start=0):
    return orig(self, lp, spec, dtype, implementation, start=start + 32)

  xquant.XCache.rematerialize = shifted
  try:
    bad, _ = c0.chunked_attend(q, qpos0, params["layers"][0], spec)
  finally:
    xquant.XCache.rematerialize = orig
  assert np.abs(np.asarray(bad) - np.asarray(want)).max() > 1e-3


def test_decode_chunk_must_be_a_non_negative_int():
  with pytest.raises(ValueError, match="XQuantSpec.decode_chunk"):
    XQuantSpec(decode_chunk=-1)
