"""KIVI Mosaic GPU kernel (`mosaic_kivi`) and its cache layout (`mosaic_layout`).

CPU (CI): the relayout is lossless (planar dequantization == native dequantization), the
per-thread A fragments rebuilt from the native words with the kernel's arithmetic
(`mosaic_dequant.dequant_pairs_numpy`) and the wgmma fragment formula written out here
reproduce the planar cache, `plan` rejects bad shapes and knobs, and the kernel lowers for
CUDA. GPU (`-m gpu`): seeded random inputs with ragged lengths (1, full, non-multiples of
the 128-token block) against the float32 reference, every partial finite, bitwise reruns
and a negative control.
"""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from closeness import assert_close  # noqa: E402  (tests/kernels, on sys.path)
from kivi_cases import PLAN_REJECTS, SHAPES, assert_plan_rejects, case  # noqa: E402
from kvlowrank_kernels.decode_attention import triton_backend  # noqa: E402
from kvlowrank_kernels.kivi_attention import kivi_attention  # noqa: E402
from kvlowrank_kernels.kivi_attention import (  # noqa: E402
    mosaic_dequant, mosaic_kivi, mosaic_layout)
from kvlowrank_kernels.kivi_attention import packing  # noqa: E402
from kvlowrank_kernels.kivi_attention.reference import kivi_attention_reference  # noqa: E402

F32 = jnp.float32


@pytest.mark.parametrize("layout", mosaic_layout.LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_relayout_is_lossless(dtype, layout):
  k = jax.random.normal(jax.random.key(0), (2, 256, 3, 128)).astype(jnp.bfloat16)
  v = jax.random.normal(jax.random.key(1), (2, 256, 3, 128)).astype(jnp.bfloat16)
  kq = packing.quantize_keys(k, 2, 32, jnp.dtype(dtype))
  vq = packing.quantize_values(v, 2, 32, jnp.dtype(dtype))
  cache = mosaic_layout.to_mosaic(kq, vq, layout=layout)
  assert cache.layout == layout
  assert cache.kc.dtype == jnp.uint32 and cache.ks.dtype == jnp.dtype(dtype)
  # Same bytes as the planar cache: codes 2 bits, scale/zero unchanged in number.
  assert cache.kc.size * 4 == kq.codes.size and cache.ks.size == 2 * kq.scale.size
  kf, vf = mosaic_layout.dequantize_mosaic(cache)
  np.testing.assert_array_equal(np.asarray(kf), np.asarray(packing.dequantize_keys(kq, 128)))
  np.testing.assert_array_equal(np.asarray(vf), np.asarray(packing.dequantize_values(vq, 128)))
  # Negative control: one flipped code bit changes exactly one element.
  bad = dataclasses.replace(cache, kc=cache.kc.at[0, 0, 0, 1, 22].set(cache.kc[0, 0, 0, 1, 22] ^ 1))
  kb, _ = mosaic_layout.dequantize_mosaic(bad)
  assert int((np.asarray(kb) != np.asarray(kf)).sum()) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("what", ["keys", "values"])
def test_fragments_rebuild_the_cache(dtype, what):
  """Every thread's A fragments (the kernel's arithmetic, the wgmma fragment formula)
  reassemble the planar cache's dequantized block (rounded once to the 16-bit type)."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(1, 128, 1, 128)) * 3 + 1, jnp.bfloat16)
  sdt = jnp.dtype(dtype)
  kq = packing.quantize_keys(x, 2, 32, sdt)
  vq = packing.quantize_values(x, 2, 32, sdt)
  cache = mosaic_layout.to_mosaic(kq, vq)
  if what == "keys":
    words, sc = np.asarray(cache.kc[0, 0, 0]), np.asarray(cache.ks[0, 0, 0].astype(F32))
    words = words.reshape(256, 4)
    want = np.asarray(packing.dequantize_keys(kq, 128)[0, :, 0])         # [token, channel]
  else:
    words, sc = np.asarray(cache.vc[0, 0, 0]), np.asarray(cache.vs[0, 0, 0].astype(F32))
    words = words.reshape(256, 4)
    want = np.asarray(packing.dequantize_values(vq, 128)[0, :, 0]).T     # [channel, token]
  want = np.asarray(jnp.asarray(want).astype(sdt).astype(F32))
  # [group, r, quad, j % 2, (scale, zero), e] -> [group, quad, j, (scale, zero), e]
  sc = sc.reshape(4, 8, 4, 2, 2, 2).transpose(0, 2, 1, 3, 4, 5).reshape(4, 4, 16, 2, 2)

  def assemble(row_half_of_word):
    got = np.full((128, 128), np.nan)
    for m in range(2):
      for tau in range(128):
        w, lane = divmod(tau, 32)
        s = sc[2 * m + w // 2, lane % 4]                     # [16 j, 2, 2]
        for u in range(4):
          s_pairs = np.stack([s[(u % 2) * 8 + k, 0] for k in range(8)])
          z_pairs = np.stack([s[(u % 2) * 8 + k, 1] for k in range(8)])
          vals = mosaic_dequant.dequant_pairs_numpy(np.uint32(words[128 * m + tau, u]),
                                                    s_pairs, z_pairs, dtype)
          rh = row_half_of_word(u)
          for k in range(8):
            j = (u % 2) * 8 + k
            row = 64 * m + 16 * w + lane // 4 + 8 * rh
            col = 8 * j + 2 * (lane % 4)
            got[row, col:col + 2] = vals[k]
    return np.asarray(jnp.asarray(got, F32).astype(sdt).astype(F32))

  np.testing.assert_allclose(assemble(lambda u: u // 2), want, rtol=0, atol=0)
  # Negative control: the row halves of the fragments swapped.
  assert not np.allclose(assemble(lambda u: 1 - u // 2), want)


@pytest.mark.parametrize("change, match", PLAN_REJECTS)
def test_plan_rejects(change, match):
  assert_plan_rejects(mosaic_kivi.plan, change, match)


def test_plan_defaults():
  p = mosaic_kivi.plan((8, 32, 128), (8, 8, 128), warpgroups=2)
  assert p["stages"] == 8 and p["stages"] % p["w"] == 0 and p["np"] == 8
  assert p["regs"] <= 232 and (p["w"] * p["regs"] + 40) * 128 <= 65536
  p3 = mosaic_kivi.plan((8, 32, 128), (8, 8, 128), warpgroups=3)
  assert p3["stages"] % 3 == 0 and (3 * p3["regs"] + 40) * 128 <= 65536


def test_layout_rejects():
  k = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  kq = packing.quantize_keys(k, 2, 32, jnp.float16)
  vq = packing.quantize_values(k, 2, 32, jnp.float16)
  with pytest.raises(ValueError, match="multiple of 128"):
    mosaic_layout.to_mosaic(kq, vq)
  k = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="2-bit with groups of 32"):
    mosaic_layout.to_mosaic(packing.quantize_keys(k, 4, 32, jnp.float16),
                            packing.quantize_values(k, 2, 32, jnp.float16))
  _, (q, kq2, vq2, kw, vw, ql, wl) = case(0, 1)
  with pytest.raises(ValueError, match="'wgmma' layout"):
    mosaic_kivi.kivi_attention_mosaic(q, mosaic_layout.to_mosaic(kq2, vq2, layout="warp"), kw,
                                      vw, ql, wl)
  with pytest.raises(ValueError, match="layout must be one of"):
    mosaic_layout.to_mosaic(packing.quantize_keys(k, 2, 32, jnp.float16),
                            packing.quantize_values(k, 2, 32, jnp.float16), layout="tiles")


@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=2),
                                  dict(warpgroups=3, num_splits=2)])
def test_mosaic_kivi_lowers_for_cuda(idx, opts):
  _, (q, kq, vq, kw, vw, ql, wl) = case(idx, 10 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq)
  f = jax.jit(lambda *a: mosaic_kivi.kivi_attention_mosaic(*a, **opts))
  text = f.trace(q, cache, kw, vw, ql, wl).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=1),
                                  dict(warpgroups=1, stages=4, num_splits=1),
                                  dict(warpgroups=2, stages=2, num_splits=3),
                                  dict(warpgroups=2), dict(async_values=True),
                                  dict(warpgroups=3), dict(warpgroups=3, stages=3,
                                                           num_splits=2)])
def test_mosaic_kivi_matches_reference(idx, opts):
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  shape, (q, kq, vq, kw, vw, ql, wl) = case(idx, 900 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq)
  ref, ref_lse = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  run = jax.jit(lambda *a: mosaic_kivi.kivi_attention_mosaic(*a, out_dtype=F32,
                                                             return_partials=True, **opts))
  out, lse, (o_p, lse_p) = run(q, cache, kw, vw, ql, wl)
  assert np.isfinite(np.asarray(o_p)).all(), "non-finite partial outputs"
  assert not np.isnan(np.asarray(lse_p)).any(), "NaN partial lse"
  assert_close(out, ref, 2e-2, 2e-2, f"out {shape} {opts}")
  assert_close(lse, ref_lse, 2e-2, 2e-3, f"lse {opts}")
  again = run(q, cache, kw, vw, ql, wl)
  assert np.array_equal(np.asarray(out), np.asarray(again[0])), "not bitwise deterministic"


@pytest.mark.gpu
def test_mosaic_kivi_dispatcher_and_negative_control():
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  _, (q, kq, vq, kw, vw, ql, wl) = case(0, 950)
  ref, _ = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  out, _ = kivi_attention(q, kq, vq, kw, vw, ql, wl, out_dtype=F32, implementation="mosaic")
  assert_close(out, ref, 2e-2, 2e-2, "dispatcher")
  cache = mosaic_layout.to_mosaic(kq, vq)
  row = int(np.argmax(np.asarray(ql)))
  bad = mosaic_layout.KiviMosaic(kc=cache.kc, ks=cache.ks.at[row, 0, 0].multiply(9.0),
                                 vc=cache.vc, vs=cache.vs)
  out, _ = mosaic_kivi.kivi_attention_mosaic(q, bad, kw, vw, ql, wl, out_dtype=F32)
  with pytest.raises(AssertionError):
    assert_close(out, ref, 2e-2, 2e-2, "corrupted key scales")
