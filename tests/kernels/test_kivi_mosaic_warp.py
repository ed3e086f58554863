"""KIVI Mosaic GPU kernel with warp-level products (`mosaic_kivi_warp`) and its "warp" layout.

CPU (CI): every thread's m16n8k16 A fragments, rebuilt from the "warp" words with the
kernel's arithmetic (`mosaic_dequant.dequant_pairs_numpy`) and the PTX fragment formula
written out here, reproduce the planar cache's keys and values; `plan` rejects bad shapes
and knobs; a cache in the other layout is refused; the kernel lowers for CUDA. GPU
(`-m gpu`): seeded inputs with ragged lengths against the float32 reference, every partial
finite, bitwise reruns, the dispatcher, a negative control.
"""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from closeness import assert_close  # noqa: E402  (tests/kernels, on sys.path)
from kivi_cases import PLAN_REJECTS, SHAPES, assert_plan_rejects, case  # noqa: E402
from kvlowrank_kernels.common import triton_backend  # noqa: E402
from kvlowrank_kernels.kivi import kivi_attention  # noqa: E402
from kvlowrank_kernels.kivi import (  # noqa: E402
    mosaic_dequant, mosaic_kivi_warp, mosaic_layout)
from kvlowrank_kernels.kivi import planar as packing  # noqa: E402
from kvlowrank_kernels.kivi.reference import kivi_attention_reference  # noqa: E402

F32 = jnp.float32


def _a_fragment(lane):
  """(row, column) of the 8 16-bit elements a thread holds of an m16 x k16 A operand, in
  register order a0..a3 (PTX ISA, mma.m16n8k16 .f16/.bf16), element e inner."""
  r, q = lane // 4, lane % 4
  return [(r + 8 * rh, 2 * q + 8 * jh + e) for jh in range(2) for rh in range(2)
          for e in range(2)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("what", ["keys", "values"])
def test_warp_fragments_rebuild_the_cache(dtype, what):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(1, 128, 1, 128)) * 3 + 1, jnp.bfloat16)
  sdt = jnp.dtype(dtype)
  kq = packing.quantize_keys(x, 2, 32, sdt)
  vq = packing.quantize_values(x, 2, 32, sdt)
  cache = mosaic_layout.to_mosaic(kq, vq, layout="warp")
  if what == "keys":
    want = np.asarray(packing.dequantize_keys(kq, 128)[0, :, 0])          # [token, channel]
    words = np.asarray(cache.kc[0, 0, 0]).reshape(2, 128, 4)               # [m, tau, u]
    sc = np.asarray(cache.ks[0, 0, 0].astype(F32)).reshape(4, 8, 4, 2, 2, 2)
  else:
    want = np.asarray(packing.dequantize_values(vq, 128)[0, :, 0]).T      # [channel, token]
    words = np.asarray(cache.vc[0, 0, 0]).reshape(128, 8)                  # [tau, u]
    sc = np.asarray(cache.vs[0, 0, 0].astype(F32)).reshape(4, 8, 4, 2, 2, 2)
  want = np.asarray(jnp.asarray(want).astype(sdt).astype(F32))

  def assemble(order):
    got = np.full((128, 128), np.nan)
    for tau in range(128):
      w, lane = divmod(tau, 32)
      frag = [_a_fragment(lane)[i] for i in order]
      if what == "keys":  # tile (m, k-step kk): tokens 32 w + 16 m, channels 16 kk
        for m in range(2):
          s = sc[w, :, lane % 4]                                   # [r, jj, sz, e]
          for u in range(4):
            ks = [(u % 2) * 8 + k for k in range(8)]               # pair columns j
            vals = mosaic_dequant.dequant_pairs_numpy(
                np.uint32(words[m, tau, u]), np.stack([s[j // 2, j % 2, 0] for j in ks]),
                np.stack([s[j // 2, j % 2, 1] for j in ks]), dtype)
            for k, j in enumerate(ks):
              kk, reg = j // 2, 2 * (j % 2) + u // 2                # a0..a3 = (rh, jh)
              row, col = frag[2 * reg]
              got[32 * w + 16 * m + row, 16 * kk + col: 16 * kk + col + 2] = vals[k]
      else:  # tile (channel tile t, k-step kk): channels 16 t, tokens 32 w + 16 kk
        for u in range(8):
          kk, gq = divmod(u, 4)
          chunk = sc[w, u, lane % 4]                               # [jh, sz, e]
          vals = mosaic_dequant.dequant_pairs_numpy(
              np.uint32(words[tau, u]), np.stack([chunk[(k % 4) // 2, 0] for k in range(8)]),
              np.stack([chunk[(k % 4) // 2, 1] for k in range(8)]), dtype)
          for k in range(8):
            t, reg = 2 * gq + k // 4, k % 4
            row, col = frag[2 * reg]
            got[16 * t + row, 32 * w + 16 * kk + col: 32 * w + 16 * kk + col + 2] = vals[k]
    return np.asarray(jnp.asarray(got, F32).astype(sdt).astype(F32))

  np.testing.assert_allclose(assemble(range(8)), want, rtol=0, atol=0)
  # Negative control: registers a1 and a2 swapped (rows + 8 <-> columns + 8).
  assert not np.allclose(assemble([0, 1, 4, 5, 2, 3, 6, 7]), want)


@pytest.mark.parametrize("change, match", PLAN_REJECTS)
def test_plan_rejects(change, match):
  assert_plan_rejects(mosaic_kivi_warp.plan, change, match)


@pytest.mark.parametrize("change, match", [(dict(dequant="int"), "dequant must be"),
                                           (dict(skip=5), "ablation of dequant='fma'"),
                                           (dict(skip=7), "skip must be")])
def test_plan_rejects_warp_options(change, match):
  assert_plan_rejects(mosaic_kivi_warp.plan, change, match)


def test_plan_defaults_and_layout_check():
  p = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), warpgroups=3)
  assert p["stages"] % 3 == 0 and p["np"] == 8 and (3 * p["regs"] + 40) * 128 <= 65536
  assert p["fold"] == (True, True) and mosaic_kivi_warp.plan(
      (8, 32, 128), (8, 8, 128), dequant="fma")["fold"] == (False, False)
  _, (q, kq, vq, kw, vw, ql, wl) = case(0, 1)
  with pytest.raises(ValueError, match="'warp' layout"):
    mosaic_kivi_warp.kivi_attention_mosaic_warp(q, mosaic_layout.to_mosaic(kq, vq), kw, vw,
                                                ql, wl)


@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=2),
                                  dict(warpgroups=2, num_splits=2)])
def test_mosaic_kivi_warp_lowers_for_cuda(idx, opts):
  _, (q, kq, vq, kw, vw, ql, wl) = case(idx, 20 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq, layout="warp")
  f = jax.jit(lambda *a: mosaic_kivi_warp.kivi_attention_mosaic_warp(*a, **opts))
  text = f.trace(q, cache, kw, vw, ql, wl).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=1),
                                  dict(warpgroups=1, stages=4, num_splits=1),
                                  dict(warpgroups=2, stages=2, num_splits=3),
                                  dict(warpgroups=2), dict(warpgroups=3, stages=3,
                                                           num_splits=2),
                                  dict(dequant="fma"),
                                  dict(warpgroups=1, stages=2, num_splits=3, dequant="fma"),
                                  dict(dequant="fold-keys"), dict(dequant="fold-values")])
def test_mosaic_kivi_warp_matches_reference(idx, opts):
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  shape, (q, kq, vq, kw, vw, ql, wl) = case(idx, 700 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq, layout="warp")
  ref, ref_lse = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  run = jax.jit(lambda *a: mosaic_kivi_warp.kivi_attention_mosaic_warp(
      *a, out_dtype=F32, return_partials=True, **opts))
  out, lse, (o_p, lse_p) = run(q, cache, kw, vw, ql, wl)
  assert np.isfinite(np.asarray(o_p)).all(), "non-finite partial outputs"
  assert not np.isnan(np.asarray(lse_p)).any(), "NaN partial lse"
  assert_close(out, ref, 2e-2, 2e-2, f"out {shape} {opts}")
  assert_close(lse, ref_lse, 2e-2, 2e-3, f"lse {opts}")
  again = run(q, cache, kw, vw, ql, wl)
  assert np.array_equal(np.asarray(out), np.asarray(again[0])), "not bitwise deterministic"


@pytest.mark.gpu
def test_mosaic_kivi_warp_dispatcher_and_negative_control():
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  _, (q, kq, vq, kw, vw, ql, wl) = case(0, 750)
  ref, _ = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  out, _ = kivi_attention(q, kq, vq, kw, vw, ql, wl, out_dtype=F32, implementation="mosaic")
  assert_close(out, ref, 2e-2, 2e-2, "dispatcher (warp kernel)")
  cache = mosaic_layout.to_mosaic(kq, vq, layout="warp")
  row = int(np.argmax(np.asarray(ql)))
  for what in ("ks", "vs"):  # the scale/zero rows of the first block, times 9
    bad = dataclasses.replace(cache, **{what: getattr(cache, what).at[row, 0, 0].multiply(9.0)})
    out, _ = mosaic_kivi_warp.kivi_attention_mosaic_warp(q, bad, kw, vw, ql, wl,
                                                         out_dtype=F32)
    with pytest.raises(AssertionError):
      assert_close(out, ref, 2e-2, 2e-2, f"corrupted {what}")
