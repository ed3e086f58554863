"""XQuant-CL: exactness when unquantized, closed-loop (non-accumulating) errors, the
GQA latent variant, the method registry's byte accounting, and config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.methods import init_caches
from kvlowrank.methods.xquant.cl import XCLCache, XQuantCLSpec, reconstruct_inputs
from kvlowrank.methods import get_method
from kvlowrank.model.params import init_params
from kvlowrank.model.transformer import forward
from kvlowrank_kernels.quant import fake_quant
from kvlowrank.spec import ModelSpec

GQA = ModelSpec(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                ffn_dim=96, qkv_bias=True)
MHA = ModelSpec(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=16,
                ffn_dim=96)
T = 16
_fwd = jax.jit(forward, static_argnums=4, static_argnames=("capture_inputs",))


def _setup(spec, seed=0):
  params = init_params(spec, jax.random.key(seed), scale=0.15)
  tokens = jax.random.randint(jax.random.key(seed + 1), (2, T), 0, spec.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  return params, tokens, pos


def _run(spec, params, tokens, pos, cspec, mode):
  caches = init_caches("xquant_cl", cspec, spec, params, batch=2, capacity=24,
                       dtype=jnp.float32)
  if mode == "prefill":
    return _fwd(params, tokens, pos, caches, spec)
  outs = []
  for t in range(T):
    o, caches = _fwd(params, tokens[:, t:t + 1], pos[:, t:t + 1], caches, spec)
    outs.append(o)
  return jnp.concatenate(outs, 1), caches


@pytest.mark.parametrize("spec,path,base", [(MHA, "x", 0), (GQA, "x", 2), (GQA, "latent", 1)],
                         ids=["mha-x-b0", "gqa-x-b2", "gqa-latent-b1"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_unquantized_matches_dense(spec, path, base, mode):
  """With bits=None every X̂_i = X_i (latent: X̂_i·U_kv = X_i·U_kv), so the logits are the
  dense (uncached) forward's."""
  params, tokens, pos = _setup(spec)
  cspec = XQuantCLSpec(bits=None, path=path, base_layer=base)
  logits, _ = _run(spec, params, tokens, pos, cspec, mode)
  want, _ = _fwd(params, tokens, pos, None, spec)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-4, rtol=0)
  if mode == "prefill":   # Negative control: 2-bit deltas visibly change the logits.
    q, _ = _run(spec, params, tokens, pos, dataclasses.replace(cspec, bits=2, group_size=16),
                mode)
    assert float(jnp.abs(q - want).max()) > 1e-2


def _chain(xs, cspec, spec, params):
  """Runs XCLCache.advance (what step does) over layers of random inputs xs [L,B,T,D]."""
  caches = init_caches("xquant_cl", cspec, spec, params, batch=xs.shape[1], capacity=xs.shape[2],
                       dtype=jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(xs.shape[2], dtype=jnp.int32), xs.shape[1:3])
  acc, accs, out = None, [], []
  for i, c in enumerate(caches):
    c, acc = c.advance(xs[i], pos, acc)
    accs.append(acc)
    out.append(c)
  return out, accs


def test_closed_loop_error_equals_own_quantization_error():
  """On a random walk X_i = X_{i-1} + noise (the residual stream's slow drift), layer i's
  reconstruction error is exactly Q(r_i) − r_i with r_i = X_i − X̂_{i−1}: it does not grow
  with depth. Open-loop deltas Q(X_i − X_{i−1}) accumulate (negative control)."""
  spec = MHA.replace(n_layers=12)
  params = init_params(spec, jax.random.key(0))
  rng = np.random.default_rng(0)
  x0 = rng.normal(size=(2, 16, 64))
  xs = np.cumsum(np.concatenate([x0[None], 0.1 * rng.normal(size=(11, 2, 16, 64))]), 0)
  xs = jnp.asarray(xs, jnp.float32)
  cspec = XQuantCLSpec(bits=2, path="x", group_size=16, base_layer=0)
  caches, accs = _chain(xs, cspec, spec, params)
  prev = jnp.zeros_like(xs[0])
  errs = []
  for i in range(12):
    r = xs[i] - prev
    qerr = fake_quant(r, bits=2, axis=-1, group_size=16) - r
    np.testing.assert_allclose(np.asarray(accs[i] - xs[i]), np.asarray(qerr), atol=2e-5)
    errs.append(float(jnp.sqrt(jnp.mean((accs[i] - xs[i]) ** 2))))
    prev = accs[i]
  # The same reconstruction rebuilt from the stored codes (what a later decode step does).
  rec = reconstruct_inputs(caches)
  np.testing.assert_allclose(np.asarray(rec[-1]), np.asarray(accs[-1]), atol=1e-5)
  # No accumulation: the deep layers' error is the size of a delta's quantization error.
  assert max(errs[1:]) < 2 * errs[1]
  # Open loop accumulates: the sum of independently quantized deltas drifts.
  open_acc = fake_quant(xs[0], bits=2, axis=-1, group_size=16)
  for i in range(1, 12):
    open_acc = open_acc + fake_quant(xs[i] - xs[i - 1], bits=2, axis=-1, group_size=16)
  open_err = float(jnp.sqrt(jnp.mean((open_acc - xs[11]) ** 2)))
  assert open_err > 2 * errs[11]
  # And plain XQuant (quantizing X_11 itself at 2 bits) is far worse than the CL delta.
  plain = float(jnp.sqrt(jnp.mean((fake_quant(xs[11], bits=2, axis=-1, group_size=16)
                                   - xs[11]) ** 2)))
  assert plain > 3 * errs[11]


def test_gqa_latent_error_is_own_latent_quantization_error():
  """GQA-CL: X̂_i·U_kv^(i) − X_i·U_kv^(i) = Q(r_i U) − r_i U, r_i = X_i − X̂_{i−1}."""
  spec = GQA
  params = init_params(spec, jax.random.key(1))
  rng = np.random.default_rng(1)
  xs = jnp.asarray(np.cumsum(rng.normal(size=(4, 1, 16, 64)) * np.array(
      [1.0, 0.1, 0.1, 0.1])[:, None, None, None], 0), jnp.float32)
  cspec = XQuantCLSpec(bits=3, path="latent", group_size=16)
  caches, accs = _chain(xs, cspec, spec, params)
  prev = jnp.zeros_like(xs[0])
  for i, c in enumerate(caches):
    u = c.u
    r = (xs[i] - prev) @ u
    want = fake_quant(r, bits=3, axis=-1, group_size=16) - r
    np.testing.assert_allclose(np.asarray(accs[i] @ u - xs[i] @ u), np.asarray(want),
                               atol=5e-5)
    prev = accs[i]
  # The subspace is 2·kv_dim = 32 < D = 64 wide: X̂ itself is NOT X (only its projection).
  assert float(jnp.abs(accs[-1] - xs[-1]).max()) > 0.1


def test_registry_bytes_match_caches_and_paper_recipe():
  smollm2 = ModelSpec(vocab_size=8, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=8)
  small = smollm2.replace(n_layers=5)
  params = init_params(small, jax.random.key(0))
  m = get_method("xquant_cl")
  for sec in (dict(bits=2, group_size=64, base_layer=2, n_high_layers=3),
              dict(bits=3, group_size=64, path="x", base_layer=0)):
    s = m.build_spec(sec, small)
    caches = init_caches("xquant_cl", s, small, params, batch=1, capacity=64)
    got = m.kv_bytes_per_token(small, s, params, jnp.bfloat16)
    assert got == pytest.approx(sum(c.bytes_per_token() for c in caches))
  # Table-4 recipe on SmolLM2, 2-bit latent deltas of 384 channels, groups of 64:
  # 27 delta layers x (4·24 + 2·2·6) + 3 layers at 4 bits: base 4-bit delta, 2 plain
  # latent layers (K per channel 192 + V per token 192).
  s = m.build_spec(dict(bits=2, group_size=64, base_layer=2, n_high_layers=3), smollm2)
  want = 27 * (4 * 24 + 24) + (4 * 48 + 24) + 2 * 2 * (4 * 24 + 2 * 2 * 3)
  assert m.kv_bytes_per_token(smollm2, s, None, jnp.bfloat16) == want


def test_invalid_configs_raise_clear_errors():
  params, _, _ = _setup(MHA)
  with pytest.raises(ValueError, match="XQuantCLSpec.bits"):
    XQuantCLSpec(bits=1)
  with pytest.raises(ValueError, match="XQuantCLSpec.base_layer"):
    XQuantCLSpec(base_layer=-1)
  with pytest.raises(ValueError, match="delta_axis"):
    XQuantCLSpec(delta_axis="layer")
  with pytest.raises(ValueError, match=r"layer_bits\[1\]"):
    XQuantCLSpec(layer_bits=(4, 7, 2, 2))
  with pytest.raises(ValueError, match="base_layer .4. must be < n_layers"):
    init_caches("xquant_cl", XQuantCLSpec(base_layer=4), MHA, params, batch=1, capacity=8)
  with pytest.raises(ValueError, match="base_layer .9. must be < n_layers"):
    get_method("xquant_cl").build_spec(dict(base_layer=9), MHA)
  with pytest.raises(ValueError, match="layer_bits has 2 entries"):
    init_caches("xquant_cl", XQuantCLSpec(layer_bits=(4, 2)), MHA, params, batch=1,
                capacity=8)
  with pytest.raises(ValueError, match="group_size .48. must divide"):
    init_caches("xquant_cl", XQuantCLSpec(group_size=48, path="x"), MHA, params, batch=1,
                capacity=8)
  c = init_caches("xquant_cl", XQuantCLSpec(bits=2, path="x", base_layer=1), MHA, params,
                  batch=1, capacity=8)
  with pytest.raises(NotImplementedError, match="carry"):
    c[1].attend(None, None, None, spec=MHA)
  # A delta layer without a carry (its predecessor not a CL layer) is refused.
  with pytest.raises(ValueError, match="no carry"):
    c[2].advance(jnp.zeros((1, 1, 64)), jnp.zeros((1, 1), jnp.int32), None)
  assert isinstance(c[1], XCLCache) and c[1].is_base and not c[2].is_base


@pytest.mark.parametrize("spec,path,window", [(MHA, "x", 0), (GQA, "latent", 0),
                                              (GQA, "x", 16),
                                              (GQA.replace(sliding_window=24), "latent", 0)],
                         ids=["mha-x", "gqa-latent", "gqa-x-window", "gqa-latent-swa"])
def test_chunked_xla_step_equals_whole_cache(spec, path, window):
  """`XCLCache.chunked_step` (the "xla" decode step, `decode_chunk` slots at a time, the
  carry updated in place, chunks merged by their LSE) equals the whole-cache step
  (`advance` + K/V of every slot + attention) at every layer of the chain: the outputs,
  the LSE, the carry handed on and the stored deltas; two full chunks, a remainder chunk, an
  exact tail (window), a padding query row and a model sliding window (swa). Negative
  controls: the chunks' K/V rotated at positions one chunk late change the output; with
  swa, so does attending without the window."""
  from kvlowrank.cache.base import AttnInputs
  from kvlowrank.methods.xquant import cl
  from kvlowrank.model.attention import dot_product_attention
  params = init_params(spec, jax.random.key(3), scale=0.15)
  cspec = XQuantCLSpec(bits=3, group_size=16, path=path, window=window, base_layer=1,
                       decode_chunk=32)
  caches = init_caches("xquant_cl", cspec, spec, params, batch=2, capacity=80,
                       dtype=jnp.float32)
  t = 70
  toks = jax.random.randint(jax.random.key(4), (2, t), 0, spec.vocab_size)
  p = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t)).at[1, 60:].set(-1)
  _, caches = _fwd(params, toks, p, caches, spec)
  assert caches[1].chunks() == (32, 2, 16)
  qpos = jnp.asarray([[t], [-1]], jnp.int32)          # row 1: a padding query
  rng = np.random.default_rng(5)
  acc_whole = acc_chunk = None
  # One jitted step for every layer (the layer's weights and inputs are arguments).
  step = jax.jit(lambda c, inputs, q, lp, a: c.chunked_step(inputs, q, lp, a, spec))
  for layer in range(cspec.base_layer, spec.n_layers):
    c, lp = caches[layer], params["layers"][layer]
    x = jnp.asarray(rng.standard_normal((2, 1, spec.dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, spec.n_heads, spec.head_dim)), jnp.float32)
    inputs = AttnInputs(x=x, k=None, k_pre=None, v=None, positions=qpos)
    want_c, acc_whole = c.advance(x, qpos, acc_whole, "xla")
    kv = jnp.matmul(acc_whole, jnp.concatenate([lp["wk"], lp["wv"]], axis=1))
    k, v = cl.kv_from_rows(kv[..., :spec.kv_dim], kv[..., spec.kv_dim:], lp, spec,
                           jnp.float32)
    sp = jnp.broadcast_to(jnp.arange(80, dtype=jnp.int32), (2, 80))
    want, wlse = dot_product_attention(q, k, v, qpos, sp, sp < want_c.lengths[:, None],
                                       sliding_window=spec.sliding_window,
                                       out_dtype=jnp.float32)
    if spec.sliding_window is not None:   # negative control: the window matters here
      unwindowed, _ = dot_product_attention(q, k, v, qpos, sp, sp < want_c.lengths[:, None],
                                            out_dtype=jnp.float32)
      assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-3
    out, lse, got_c, acc_chunk = step(c, inputs, q, lp, acc_chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(lse)[0], np.asarray(wlse)[0], atol=2e-6)
    assert np.all(np.asarray(out)[1] == 0)
    # The carry at every filled slot (slots past a row's length hold whatever a chunk's
    # exact-tail overlay left there; nothing reads them: attention masks them and the next
    # layer gathers only the new tokens' slots).
    filled = np.asarray(sp < want_c.lengths[:, None])
    np.testing.assert_allclose(np.asarray(acc_chunk)[filled], np.asarray(acc_whole)[filled],
                               atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_c.store), jax.tree.leaves(want_c.store)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Negative control: K rotated one chunk late.
  orig = cl.kv_from_rows
  late = lambda k_pre, v, lp, spec, dtype, positions=None: orig(k_pre, v, lp, spec, dtype,
                                                                positions=positions + 32)
  c, lp = caches[-1], params["layers"][-1]
  cl.kv_from_rows = late
  try:
    bad = c.chunked_step(inputs, q, lp, acc_chunk, spec)[0]
  finally:
    cl.kv_from_rows = orig
  good = c.chunked_step(inputs, q, lp, acc_chunk, spec)[0]
  assert np.abs(np.asarray(bad) - np.asarray(good)).max() > 1e-3


def test_decode_chunk_must_be_a_non_negative_int():
  with pytest.raises(ValueError, match="XQuantCLSpec.decode_chunk"):
    XQuantCLSpec(decode_chunk=-1)
  with pytest.raises(ValueError, match="XQuantCLSpec.decode_chunk"):
    XQuantCLSpec(decode_chunk=1.5)
