"""GEAR-L on the Mosaic warp KIVI kernel (`kvlowrank_kernels.gear.mosaic_gear`).

CPU: `fit` names what the kernel refuses (negative controls for each restriction), and the
kernel lowers for CUDA (its Mosaic module is built on the CPU; no GPU needed).
GPU (`-m gpu`): the kernel against the float32 jnp reference (`gear_attention_reference` over
the same codes, relaid out planar), Llama-3-like heads (K = 8, N = 32, H = 128), chunks of 64,
ranks 4 / 2, ragged q_len / w_len / n_pchunks: rows with no compressed tokens, only prefill,
prefill ending mid-block (n_pchunks odd) and many streaming chunks; every launch tiling;
two runs bitwise equal. Negative controls: one streaming chunk's value factor, or the
prefill key factor, changed must break the agreement.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from closeness import assert_splits_bitwise_equal  # (tests/kernels, on sys.path)
from kvlowrank_kernels.common import triton_backend
from kvlowrank_kernels.gear import mosaic_gear, mosaic_plan, shapes
from kvlowrank_kernels.gear.reference import gear_attention_reference
from kvlowrank_kernels.kivi import mosaic_layout

F32 = jnp.float32
GS = shapes.GearShape
# The outputs average ~10^3 random values (|out| ~ 0.03), so the bound is absolute: fp16
# rounding of q s, p s and q B (2^-11 relative) leaves errors ~1e-4; the negative controls
# move the output by > 5e-3.
ATOL = 2e-3


def _shape(batch, capacity, n_heads=32, n_kv_heads=8, scale_dtype="float16", group=32, **kw):
  return GS(shapes.backbone(batch=batch, capacity=capacity, window=64, n_heads=n_heads,
                            n_kv_heads=n_kv_heads, k_group=group, v_group=group,
                            scale_dtype=scale_dtype), **kw)


SHAPES = (_shape(4, 2048), _shape(6, 4096, n_heads=8, n_kv_heads=8), _shape(4, 2048, group=64))
LENGTHS = {  # (q_len, w_len, n_pchunks) per batch row (chunks of 64 tokens)
    4: ([2048, 64, 1344, 0], [64, 1, 0, 37], [31, 1, 7, 0]),
    6: ([4096, 4096, 640, 2944, 128, 3072], [3, 64, 0, 17, 9, 33], [64, 1, 10, 3, 0, 47]),
}


def _inputs(shape, seed, lengths=None):
  q_len, w_len, npc = (np.asarray(x, np.int32) for x in (lengths or LENGTHS[shape.batch]))
  args, groups = shapes.make_inputs(shape, jax.random.key(seed), q_len=q_len, w_len=w_len,
                                    n_pchunks=npc, variant="gear-l")
  return args, mosaic_layout.to_mosaic(args[1], args[2]), groups["lowrank"]


def test_fit_names_what_the_kernel_refuses():
  args, cache, lr = _inputs(SHAPES[0], 0)
  q = args[0]
  assert mosaic_plan.fit(q.shape, cache, lr, 64) is None
  assert "outliers" in mosaic_plan.fit(q.shape, cache, lr, 64, sparse=True)
  assert "warp layout" in mosaic_plan.fit(q.shape, args[1], lr, 64)
  assert "low-rank" in mosaic_plan.fit(q.shape, cache, None, 64)
  assert "chunks of 48" in mosaic_plan.fit(q.shape, cache, lr, 48)
  bf = dataclasses.replace(cache, ks=cache.ks.astype(jnp.bfloat16),
                           vs=cache.vs.astype(jnp.bfloat16))
  assert "bfloat16 scales" in mosaic_plan.fit(q.shape, bf, lr, 64)
  odd = dataclasses.replace(lr, a_k=jnp.pad(lr.a_k, ((0, 0),) * 3 + ((0, 1),)),
                            a_v=jnp.pad(lr.a_v, ((0, 0),) * 3 + ((0, 1),)))
  assert "a_k has 5 columns" in mosaic_plan.fit(q.shape, cache, odd, 64)
  assert "RA=5" in mosaic_plan.config_fit(bits=2, group=32, head_dim=128, scale_dtype="float16",
                                          sparse=False, rank_prefill=5, rank_chunk=2,
                                          chunk=64)
  assert "group size 16" in mosaic_plan.config_fit(
      bits=2, group=16, head_dim=128, scale_dtype="float16", sparse=False, rank_prefill=4,
      rank_chunk=2, chunk=64)
  assert mosaic_plan.config_fit(bits=2, group=32, head_dim=128, scale_dtype="float16",
                                sparse=False, rank_prefill=4, rank_chunk=2, chunk=64) is None
  f32 = dataclasses.replace(lr, b_v=lr.b_v.astype(F32))
  assert "lowrank.b_v" in mosaic_plan.fit(q.shape, cache, f32, 64)
  with pytest.raises(ValueError, match="chunks of 48"):
    mosaic_gear.gear_attention_mosaic(*args[:1], cache, *args[3:], lr, chunk=48)


@functools.lru_cache(maxsize=None)
def _lowering_inputs(idx):
  """One shape's inputs, built once for every knob set lowered on it (building them, eager
  random draws and the warp relayout, took most of each lowering test's CPU time)."""
  return _inputs(SHAPES[idx], 1)


@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=2, num_splits=3),
                                  dict(num_splits=3, ctas=2),
                                  dict(warpgroups=1, stages=2, num_splits=2, ctas=3)])
def test_gear_mosaic_lowers_for_cuda(idx, opts):
  args, cache, lr = _lowering_inputs(idx)
  q, _, _, kw, vw, ql, wl = args
  f = jax.jit(lambda *a: mosaic_gear.gear_attention_mosaic(*a, chunk=64, **opts))
  text = f.trace(q, cache, kw, vw, ql, wl, lr).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def _check(shape, seed, opts, lengths=None):
  args, cache, lr = _inputs(shape, seed, lengths)
  q, _, _, kw, vw, ql, wl = args
  run = jax.jit(lambda *a: mosaic_gear.gear_attention_mosaic(
      *a, chunk=shape.chunk, out_dtype=F32, return_partials=True, **opts))
  out, lse, (o_p, lse_p) = run(q, cache, kw, vw, ql, wl, lr)
  assert np.isfinite(np.asarray(o_p)).all(), "non-finite partial outputs"
  assert not np.isnan(np.asarray(lse_p)).any(), "NaN partial lse"
  keys_m, values_m = mosaic_layout.from_mosaic(cache)
  ref, ref_lse = gear_attention_reference(q, keys_m, values_m, kw, vw, ql, wl, lowrank=lr,
                                          out_dtype=F32)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=2e-3)
  again = run(q, cache, kw, vw, ql, wl, lr)
  assert np.array_equal(np.asarray(out), np.asarray(again[0])), "not bitwise deterministic"
  return args, cache, lr, np.asarray(out), np.asarray(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=1),
                                  dict(warpgroups=2, stages=2, num_splits=3),
                                  dict(warpgroups=3, stages=3, num_splits=2),
                                  # persistent CTAs, several items each (warp-split and
                                  # warpgroup producers), and one CTA per split
                                  dict(num_splits=3, ctas=5),
                                  dict(warpgroups=1, stages=2, num_splits=2, ctas=3),
                                  dict(num_splits=4, persistent=False)])
def test_gear_mosaic_matches_reference(idx, opts):
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  _check(SHAPES[idx], 100 + idx, opts)


@pytest.mark.gpu
@pytest.mark.parametrize("idx", [0, 2])
@pytest.mark.parametrize("knobs", [dict(), dict(warpgroups=1, stages=2)])
def test_persistent_partials_equal_one_cta_per_split(idx, knobs):
  """Persistent CTAs (2, each running 48 items: rows without tokens, prefill-only and
  streaming items in turn, so the producer runs ahead over empty items to later items' q and
  constants) give every split's partial bitwise equal to one CTA per split with the same
  warpgroups and ring. Negative control: the comparison sees a one-ulp change."""
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  shape = SHAPES[idx]
  args, cache, lr = _inputs(shape, 300 + idx)
  q, _, _, kw, vw, ql, wl = args

  def partials(**more):
    f = jax.jit(lambda *a: mosaic_gear.gear_attention_mosaic(
        *a, chunk=shape.chunk, out_dtype=F32, return_partials=True, num_splits=3, **knobs,
        **more))
    _, _, (o_p, lse_p) = f(q, cache, kw, vw, ql, wl, lr)
    return np.asarray(o_p), np.asarray(lse_p)

  assert_splits_bitwise_equal(partials(ctas=2), partials(persistent=False))


@pytest.mark.gpu
def test_gear_mosaic_negative_controls():
  """The streaming chunks' value factors or the prefill key factor removed must move the
  reference past the tolerance the kernel meets, and far more than the kernel's error (so
  the kernel's low-rank terms are seen by the test)."""
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  args, cache, lr, out, ref = _check(SHAPES[0], 200, {})
  q, _, _, kw, vw, ql, wl = args
  keys_m, values_m = mosaic_layout.from_mosaic(cache)
  err = np.abs(out - ref).max()
  for bad in (dataclasses.replace(lr, b_v=jnp.zeros_like(lr.b_v)),
              dataclasses.replace(lr, bp_k=jnp.zeros_like(lr.bp_k))):
    moved, _ = gear_attention_reference(q, keys_m, values_m, kw, vw, ql, wl, lowrank=bad,
                                        out_dtype=F32)
    dev = np.abs(out - np.asarray(moved)).max()
    assert dev > max(ATOL, 5 * err), (dev, err)
