"""The FDC / ZACK rotated cache against dense attention and a float64 numpy model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.cache import base, init_caches
from kvlowrank.methods import rotated
from kvlowrank.methods.rotated import compression
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from np_params import np_init_params
from np_reference import np_forward

SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32,
                 ffn_dim=48, qkv_bias=True)
TOL = 2e-4


@functools.lru_cache(maxsize=None)
def _model(recipe):
  params = np_init_params(SPEC, seed=0, scale=0.25)
  toks = np.random.default_rng(0).integers(0, 64, (4, 48))
  return params, rotated.statistics(params, SPEC, rotated.RotatedSpec(calibration="data"),
                                    toks, recipe=recipe)


@functools.partial(jax.jit, static_argnames=("spec",))
def _fwd(params, toks, pos, caches, spec):
  return forward(params, toks, pos, caches, spec)


@jax.jit
def _step(cache, inputs, q, lp):
  """update then attend, jitted (eager CPU dispatch compiles every small op)."""
  cache = cache.update(inputs, lp)
  out, lse = cache.attend(q, inputs.positions, lp, spec=SPEC)
  return cache, out, lse


@pytest.mark.parametrize("recipe", ["fdc", "zack"])
def test_r0_equals_dense_model_prefill_and_decode(recipe):
  """r = 0 keeps full width: prefill (ragged batch: row 1 is 5 tokens shorter, right-
  padded) and 4 decode steps give the float64 numpy model's logits to fp32 error."""
  params, stats = _model(recipe)
  rs = rotated.RotatedSpec(rate=0.0)
  cp, layout, _ = rotated.compress(params, SPEC, rs, stats, recipe)
  assert layout.compression_ratio() == 0.0
  toks = np.random.default_rng(5).integers(0, 64, (2, 20))
  lens = (16, 11)
  pos = np.stack([np.where(np.arange(16) < n, np.arange(16), -1) for n in lens])
  caches = init_caches("rotated", rs, SPEC, cp, batch=2, capacity=24, dtype=jnp.float32)
  logits, caches = _fwd(cp, jnp.asarray(toks[:, :16]), jnp.asarray(pos, jnp.int32), caches,
                        SPEC)
  for b, n in enumerate(lens):
    ref = np_forward(params, toks[b, :n], SPEC)
    np.testing.assert_allclose(np.asarray(logits[b, :n]), ref, atol=TOL)
  for step in range(4):       # decode: each row continues its own sequence
    cur = np.array([n + step for n in lens])
    tok = toks[np.arange(2), cur][:, None]
    logits, caches = _fwd(cp, jnp.asarray(tok), jnp.asarray(cur[:, None], jnp.int32), caches,
                          SPEC)
    for b in range(2):
      seq = np.concatenate([toks[b, :lens[b]], toks[b, lens[b]:cur[b] + 1]])
      np.testing.assert_allclose(np.asarray(logits[b, 0]), np_forward(params, seq, SPEC)[-1],
                                 atol=TOL)
  # Negative control: a truncating rate is measurably different from the dense model.
  cp2, layout2, _ = rotated.compress(params, SPEC, rs.replace(target_ratio=0.5), stats,
                                    recipe)
  assert layout2.compression_ratio() > 0
  c2 = init_caches("rotated", rs, SPEC, cp2, batch=1, capacity=16, dtype=jnp.float32)
  lg2, _ = _fwd(cp2, jnp.asarray(toks[:1, :16]), jnp.arange(16)[None], c2, SPEC)
  assert np.max(np.abs(np.asarray(lg2[0]) - np_forward(params, toks[0, :16], SPEC))) > 1e-2


def _ragged_layer(k_widths, v_widths, seed=0):
  """A layer with random orthogonal key rotations and value factors at chosen widths."""
  params = np_init_params(SPEC, seed=seed, scale=0.25)
  rng = np.random.default_rng(seed)
  orth = lambda: np.linalg.qr(rng.standard_normal((32, 32)))[0]
  rk = np.stack([orth() for _ in range(2)])[None]
  av = rng.standard_normal((1, 2, 64, 32)) * 0.3
  bv = rng.standard_normal((1, 2, 32, 32)) * 0.3
  f = compression.Factors(rk=rk, sk=np.ones((1, 2, 32)), av=av, bv=bv, sv=np.ones((1, 2, 32)))
  lp = compression.compress_layer(params["layers"][0], SPEC, f, 0, k_widths, v_widths)
  return lp, rk[0], av[0], bv[0]


@pytest.mark.parametrize("k_widths,v_widths", [((16, 32), (32, 16)), ((16, 16), (16, 32))])
def test_ragged_widths_attention_and_bytes(k_widths, v_widths):
  """Ragged per-head widths, truncated: q' k'ᵀ = q (R_p R_pᵀ) kᵀ and the value-space output
  times B equals P V̂: checked against a float64 numpy reference (GQA 3:1, batch 2, ragged
  lengths, prefill then one decode step); nbytes = what is stored, no padding."""
  lp, rk, av, bv = _ragged_layer(k_widths, v_widths)
  cache = rotated.RotatedCache.init(SPEC, lp, batch=2, capacity=64, dtype=jnp.float32)
  assert cache.k_rot.shape == (2, 64, sum(k_widths))
  assert cache.v_rot.shape == (2, 64, sum(v_widths))
  assert cache.nbytes() == 2 * 64 * (sum(k_widths) + sum(v_widths)) * 4 + 2 * 4
  rng = np.random.default_rng(1)
  t = 12
  x = rng.standard_normal((2, t, 64)).astype(np.float32)
  k = rng.standard_normal((2, t, 2, 32)).astype(np.float32)
  q = rng.standard_normal((2, t, 6, 32)).astype(np.float32)
  pos = np.stack([np.arange(t), np.where(np.arange(t) < 7, np.arange(t), -1)]).astype(np.int32)
  inputs = base.AttnInputs(x=jnp.asarray(x), k=jnp.asarray(k), k_pre=jnp.asarray(k),
                           v=jnp.asarray(k), positions=jnp.asarray(pos))
  cache, out, lse = _step(cache, inputs, jnp.asarray(q), lp)
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert out.shape == (2, t, 6, max(v_widths))
  for b in range(2):
    n_valid = int((pos[b] >= 0).sum())
    for n in range(6):
      g = n // 3
      kw, vw = k_widths[g], v_widths[g]
      rp = rk[g][:, :kw]
      khat = k[b, :n_valid, g].astype(np.float64) @ rp @ rp.T
      vhat = x[b, :n_valid].astype(np.float64) @ av[g][:, :vw] @ bv[g][:vw]
      s = q[b, :n_valid, n].astype(np.float64) @ khat.T / np.sqrt(32)
      s = np.where(np.tril(np.ones((n_valid, n_valid), bool)), s, -np.inf)
      ref_lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
      p = np.exp(s - ref_lse[:, None])
      np.testing.assert_allclose(out[b, :n_valid, n, :vw] @ bv[g][:vw], p @ vhat, atol=1e-4)
      np.testing.assert_allclose(lse[b, :n_valid, n], ref_lse, atol=1e-4)
      assert np.all(out[b, :, n, vw:] == 0)          # padding columns of the narrow heads
    assert np.all(out[b, n_valid:] == 0) and np.all(np.isneginf(lse[b, n_valid:]))
  # materialize: K' R_pᵀ and V' B (the decompressed oracle) at the stored slots.
  km, vm, valid = cache.materialize()
  assert np.asarray(valid).sum() == t + 7
  np.testing.assert_allclose(np.asarray(km[0, :t, 0]), k[0, :, 0] @ rk[0][:, :k_widths[0]]
                             @ rk[0][:, :k_widths[0]].T, atol=1e-4)
  # Negative control: the full-width keys (no projection) do not match the truncated path.
  s_full = q[0, :t, 0] @ k[0, :, 0].T / np.sqrt(32)
  s_trunc = (q[0, :t, 0] @ rk[0][:, :k_widths[0]]) @ (k[0, :, 0] @ rk[0][:, :k_widths[0]]).T
  assert np.max(np.abs(s_full - s_trunc / np.sqrt(32))) > 1e-2


def test_prefill_chunks_and_decode_match_one_prefill():
  """Long prompts attend in query chunks: a tiny score budget (forcing chunks) gives the
  same output; decode steps equal the rows of one prefill."""
  lp, *_ = _ragged_layer((16, 32), (32, 16), seed=3)
  rng = np.random.default_rng(4)
  t = 10
  x, k = rng.standard_normal((1, t, 64)), rng.standard_normal((1, t, 2, 32))
  q = jnp.asarray(rng.standard_normal((1, t, 6, 32)), jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  mk = lambda sl: base.AttnInputs(x=jnp.asarray(x[:, sl], jnp.float32),
                                  k=jnp.asarray(k[:, sl], jnp.float32),
                                  k_pre=jnp.asarray(k[:, sl], jnp.float32),
                                  v=jnp.asarray(k[:, sl], jnp.float32), positions=pos[:, sl])
  c0 = rotated.RotatedCache.init(SPEC, lp, batch=1, capacity=16, dtype=jnp.float32)
  full, ref, _ = _step(c0, mk(slice(0, t)), q, lp)
  import kvlowrank.model.attention as attn  # pylint: disable=C0415
  chunked = rotated.cache.ragged_attention
  q_rot = rotated.cache.rotate_queries(q, full.rk, full.k_widths)
  kp, valid = full.slot_positions()
  out_c, _ = jax.jit(functools.partial(chunked, k_widths=(16, 32), v_widths=(32, 16),
                                       scale=32 ** -0.5))(q_rot, full.k_rot, full.v_rot, pos,
                                                          kp, valid)
  old = attn.SCORE_ELEMENTS
  try:
    attn.SCORE_ELEMENTS = 3 * 16       # 1 query row per chunk
    out_s, _ = jax.jit(functools.partial(chunked, k_widths=(16, 32), v_widths=(32, 16),
                                         scale=32 ** -0.5))(q_rot, full.k_rot, full.v_rot,
                                                            pos, kp, valid)
  finally:
    attn.SCORE_ELEMENTS = old
  np.testing.assert_allclose(np.asarray(out_s), np.asarray(out_c), atol=1e-6)
  np.testing.assert_allclose(np.asarray(out_c), np.asarray(ref), atol=1e-6)
  c, _, _ = _step(c0, mk(slice(0, 6)), q[:, :6], lp)
  for i in range(6, t):
    c, o, _ = _step(c, mk(slice(i, i + 1)), q[:, i:i + 1], lp)
    np.testing.assert_allclose(np.asarray(o[0, 0]), np.asarray(ref[0, i]), atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_rotated_cache(bits):
  """K' per channel / V' per token through the KIVI cache code: attention equals the exact
  attention over what the cache stores (dequantized prefix + exact window), is close to the
  unquantized cache (8-bit), and the store is smaller."""
  lp, *_ = _ragged_layer((16, 32), (32, 16), seed=5)
  rs = rotated.RotatedSpec(bits=bits, group_size=16, residual=16)
  rng = np.random.default_rng(6)
  t = 40
  x, k = rng.standard_normal((2, t, 64)), rng.standard_normal((2, t, 2, 32))
  q = jnp.asarray(rng.standard_normal((2, t, 6, 32)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  inputs = base.AttnInputs(x=jnp.asarray(x, jnp.float32), k=jnp.asarray(k, jnp.float32),
                           k_pre=jnp.asarray(k, jnp.float32), v=jnp.asarray(k, jnp.float32),
                           positions=pos)
  cq = rotated.RotatedCache.init(SPEC, lp, batch=2, capacity=64, dtype=jnp.float32, rspec=rs)
  cu = rotated.RotatedCache.init(SPEC, lp, batch=2, capacity=64, dtype=jnp.float32)
  cq, oq, lq = _step(cq, inputs, q, lp)
  cu, ou, _ = _step(cu, inputs, q, lp)
  kr, vr = jax.jit(lambda c: c.stored())(cq)
  kp, valid = cq.slot_positions()
  q_rot = rotated.cache.rotate_queries(q, cq.rk, cq.k_widths)
  oref, lref = jax.jit(functools.partial(
      rotated.cache.ragged_attention, k_widths=(16, 32), v_widths=(32, 16),
      scale=32 ** -0.5))(q_rot, kr, vr, pos, kp, valid)
  np.testing.assert_allclose(np.asarray(oq), np.asarray(oref), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lq), np.asarray(lref), atol=1e-5)
  kx, _ = jax.jit(lambda c: c.stored())(cu)
  err = float(jnp.max(jnp.abs(kr[:, :t] - kx[:, :t])))
  assert 0 < err < (0.05 if bits == 8 else 0.6)        # quantized, but not garbage
  assert np.all(np.asarray(kr[:, t - 8:t] == kx[:, t - 8:t]))  # the exact window
  if bits == 8:
    np.testing.assert_allclose(np.asarray(oq), np.asarray(ou), atol=3e-2)
  assert cq.nbytes() < cu.nbytes()
  assert cq.bytes_per_token() * 1.0 == rotated.method.packed_bytes_per_token(
      48, rs, jnp.float32, values=False) + rotated.method.packed_bytes_per_token(
          48, rs, jnp.float32, values=True)


def test_bench_decode_rotated_rows():
  """bench_decode's FDC/ZACK-50% rows: random params of ragged widths averaging H/2, the
  cache's bytes are half of dense, and a decode step runs."""
  from kvlowrank.bench import decode  # pylint: disable=C0415
  tiny = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64,
                   ffn_dim=64, max_seq_len=512)
  assert decode.rotated_widths(tiny) == (16, 48, 32, 32)
  res = decode.run(tiny, methods=["dense", "fdc50", "zack50-4bit"], configs=[(256, 2)],
                   steps=1, log=lambda s: None)
  recs = {r["method"]: r for r in res["records"]}
  assert recs["FDC-50%"]["cache_nbytes"] == recs["FDC-50%"]["cache_device_bytes"]
  ratio = recs["FDC-50%"]["cache_nbytes"] / recs["dense"]["cache_nbytes"]
  assert abs(ratio - 0.5) < 0.01
  q4 = recs["ZACK-50% 4-bit"]
  assert q4["cache_nbytes"] == q4["cache_device_bytes"] < 0.25 * recs["dense"]["cache_nbytes"]


@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_kernel_path_equals_the_jnp_path(bits):
  """Quantized K'/V' on the kernel path (`_attend_kernel`: the store's codes through
  `ragged_attention_quantized` at the prefix lengths, in the per-head layout, merged with the
  exact ring by LSE) equals the jnp path, on ragged rows (40 and 25 tokens: prefix and ring
  both non-empty); here it runs its reference (the store dequantized; CPU), the GPU tests and
  the interpreter check `rotated_quantized` run the Triton kernel. Negative control: the ring
  zeroed changes the output."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  lp, *_ = _ragged_layer((16, 32), (32, 16), seed=7)
  rs = rotated.RotatedSpec(bits=bits, group_size=16, residual=16)
  rng = np.random.default_rng(8)
  t = 40
  x, k = rng.standard_normal((2, t, 64)), rng.standard_normal((2, t, 2, 32))
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t)).copy()
  pos[1, 25:] = -1                                                  # row 1: 25 tokens
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  inputs = base.AttnInputs(x=f32(x), k=f32(k), k_pre=f32(k), v=f32(k), positions=jnp.asarray(pos))
  c = rotated.RotatedCache.init(SPEC, lp, batch=2, capacity=64, dtype=jnp.float32, rspec=rs)
  c = jax.jit(lambda c: c.update(inputs, lp))(c)
  m, w_len = c.quant.segments()
  assert np.all(np.asarray(m) > 0) and np.all(np.asarray(w_len) > 0)
  q1 = f32(rng.standard_normal((2, 1, 6, 32)))
  pos1 = jnp.asarray([[40], [25]], jnp.int32)
  kern = jax.jit(lambda c: c._attend_kernel(q1, pos1, SPEC, "reference"))  # pylint: disable=W0212
  out, lse = kern(c)
  want, want_lse = jax.jit(lambda c: c.attend(q1, pos1, lp, spec=SPEC,
                                              implementation="reference"))(c)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-5)
  no_ring = dataclasses.replace(c, quant=dataclasses.replace(
      c.quant, k_res=jnp.zeros_like(c.quant.k_res), v_res=jnp.zeros_like(c.quant.v_res)))
  assert float(jnp.max(jnp.abs(kern(no_ring)[0] - out))) > 1e-2
