"""GPU checks of the ragged-head rotated-cache decode kernel (`kvlowrank_kernels.rotated`)
against its float32 reference, on Llama-3-8B-like (K = 8, G = 4) and Llama-2-7B-like
(K = 32, G = 1) layers: H = 128 original head dim, ragged per-head widths (multiples of 16
around 64), 16K-32K slots, ragged lengths (1, full, non-tile-multiples). Partial buffers are
NaN-poisoned first (an unwritten element fails); runs twice (bitwise identical).
Run on the device machine with `pytest -m gpu tests/test_rotated_kernel_gpu.py`."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvlowrank_kernels.common import triton_backend  # noqa: E402
from kvlowrank_kernels.rotated import ragged_attention, resolve_implementation  # noqa: E402
from kvlowrank_kernels.rotated import shapes as rs  # noqa: E402
from kvlowrank_kernels.rotated.reference import ragged_attention_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_backend.available(), reason="needs a GPU with jax-triton"),
]

F32 = jnp.float32


def close(out, ref, atol, rtol, what):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (what, out.shape, ref.shape)
  assert not np.isnan(out).any(), f"{what}: NaN"
  both_inf = np.isinf(out) & np.isinf(ref) & (np.sign(out) == np.sign(ref))
  err = np.abs(np.where(both_inf, 0.0, out) - np.where(both_inf, 0.0, ref))
  bad = err > atol + rtol * np.abs(np.where(both_inf, 0.0, ref))
  assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, max err {err.max():.3g}"


def problem(kv_heads, groups, capacity, seed, batch=8):
  rng = np.random.default_rng(seed)
  shape = rs.RaggedShape(batch=batch, capacity=capacity, groups=groups,
                         k_widths=rs.ragged_widths(kv_heads, 64, rng),
                         v_widths=rs.ragged_widths(kv_heads, 64, rng), head_dim=128)
  lens = np.asarray([capacity, 1, capacity - 37, 65, capacity // 3 + 5, 4097, capacity - 1,
                     129][:batch], np.int32)
  return shape, rs.make_inputs(shape, jax.random.key(seed), lengths=lens)


CASES = [("l3-16k", 8, 4, 16384), ("l3-32k", 8, 4, 32768), ("l2-16k", 32, 1, 16384)]


@pytest.mark.parametrize("name,kv_heads,groups,capacity", CASES)
def test_ragged_triton_matches_reference(name, kv_heads, groups, capacity):
  from kvlowrank_kernels.rotated.triton_ragged import ragged_attention_triton
  shape, args = problem(kv_heads, groups, capacity, seed=len(name) * 10 + kv_heads)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  assert len(set(shape.k_widths)) > 1 and sum(shape.k_widths) == 64 * kv_heads
  ref, ref_lse = ragged_attention_reference(*args, out_dtype=F32, **w)
  run = lambda: ragged_attention_triton(*args, out_dtype=F32, poison=True, return_partials=True,
                                        **w)
  out, lse, partials = run()
  assert not any(np.isnan(np.asarray(x)).any() for x in partials), f"{name}: unwritten partial"
  close(out, ref, 2e-2, 2e-2, f"{name} out")
  close(lse, ref_lse, 2e-2, 1e-3, f"{name} lse")
  again = run()
  leaves = jax.tree_util.tree_leaves
  for x, y in zip(leaves((out, lse, partials)), leaves(again)):
    assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True), f"{name}: not bitwise"


@pytest.mark.parametrize("opts", [dict(block_s=32, num_warps=4, num_stages=4),
                                  dict(block_s=128, num_warps=8, num_stages=2,
                                       target_chunks=528, schedule="static"),
                                  dict(block_s=64, chunk_tokens=1024, num_stages=3,
                                       schedule="lpt", group_width=128),
                                  dict(group_width=16, num_stages=3)])
def test_ragged_triton_knobs(opts):
  shape, args = problem(8, 4, 8192, seed=5)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  ref, ref_lse = ragged_attention_reference(*args, out_dtype=F32, **w)
  out, lse = ragged_attention(*args, out_dtype=F32, implementation="triton", poison=True,
                              **w, **opts)
  close(out, ref, 2e-2, 2e-2, f"{opts} out")
  close(lse, ref_lse, 2e-2, 1e-3, f"{opts} lse")


def test_dispatcher_picks_triton_and_negative_control():
  shape, args = problem(8, 4, 4096, seed=9)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  assert resolve_implementation(None, args=(args[0].shape, shape.k_widths, shape.v_widths,
                                            args[1].dtype, 4096)) == "triton"
  ref, _ = ragged_attention_reference(*args, out_dtype=F32, **w)
  out, _ = jax.jit(lambda *a: ragged_attention(*a, out_dtype=F32, **w))(*args)
  close(out, ref, 2e-2, 2e-2, "dispatcher")
  q, k, v, lens = args
  ko = shape.k_widths[0]
  bad = k.at[0, 7, ko:ko + shape.k_widths[1]].multiply(60.0)   # row 0 attends its full length
  out_bad, _ = ragged_attention(q, bad, v, lens, out_dtype=F32, **w)
  with pytest.raises(AssertionError):
    close(out_bad, ref, 2e-2, 2e-2, "corrupted key slot")


@pytest.mark.parametrize("bits", [4, 2])
def test_ragged_quantized_triton_matches_reference(bits):
  """The kernel reading planar KIVI codes (the quantized rotated cache's store) vs the
  reference on the dequantized store, Llama-3-like 16K with ragged lengths, poisoned
  partials; negative control: request 0's key codes flipped."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import planar  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import ragged_attention_quantized  # pylint: disable=C0415
  shape, (q, k, v, lens) = problem(8, 4, 16384, seed=11)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  kq = planar.quantize_keys(k[:, :, None], bits, 16)
  vq = planar.quantize_values(v[:, :, None], bits, 16)
  kh = planar.dequantize_keys(kq, sum(shape.k_widths))[:, :, 0].astype(jnp.bfloat16)
  vh = planar.dequantize_values(vq, sum(shape.v_widths))[:, :, 0].astype(jnp.bfloat16)
  ref, ref_lse = ragged_attention_reference(q, kh, vh, lens, out_dtype=F32, **w)
  run = jax.jit(lambda kq: ragged_attention_quantized(q, kq, vq, lens, out_dtype=F32,
                                                      implementation="triton", poison=True,
                                                      **w))
  out, lse = run(kq)
  close(out, ref, 2e-2, 2e-2, f"{bits}-bit out")
  close(lse, ref_lse, 2e-2, 1e-3, f"{bits}-bit lse")
  # One flipped slot barely moves a 16K-slot softmax: flip every key code of request 0.
  bad = dataclasses.replace(kq, codes=kq.codes.at[0].set(255 - kq.codes[0]))
  with pytest.raises(AssertionError):
    close(run(bad)[0], ref, 2e-2, 2e-2, "flipped codes")


@pytest.mark.parametrize("name,kv_heads,groups,capacity,batch", [
    ("l3-32k-b8", 8, 4, 32768, 8), ("l2-16k-b4", 32, 1, 16384, 4), ("l3-8k-b40", 8, 4, 8192, 40)])
def test_epilogue_kernels_match_their_references(name, kv_heads, groups, capacity, batch):
  """The records (`triton_records`) bit for bit and the combine (`triton_combine`) against
  their jnp references (`triton_ragged.records`, `combine_heads`) at decode shapes, on the
  kernel's real partials; the whole call with either epilogue; negative control: the
  combine of the partials with one chunk's LSE dropped differs."""
  from kvlowrank_kernels.rotated import triton_combine, triton_records
  from kvlowrank_kernels.rotated.triton_plan import plan
  from kvlowrank_kernels.rotated.triton_ragged import (combine_heads, ragged_attention_triton,
                                                        records)
  rng = np.random.default_rng(len(name))
  shape, args = problem(kv_heads, groups, capacity, seed=len(name), batch=min(batch, 8))
  if batch > 8:    # a batch of ragged rows (the counting-sort scale: hundreds of row tasks)
    shape = rs.RaggedShape(batch=batch, capacity=capacity, groups=groups,
                           k_widths=shape.k_widths, v_widths=shape.v_widths, head_dim=128)
    lens = rng.integers(0, capacity + 1, batch).astype(np.int32)
    lens[0] = capacity   # row 0's chunk 1 is attended (the negative control drops it)
    args = rs.make_inputs(shape, jax.random.key(3), lengths=lens)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  p = plan(args[0].shape, capacity, shape.k_widths, shape.v_widths, jnp.bfloat16)
  assert triton_records.fits(p, "rows")
  lens = args[3]
  got = jax.jit(lambda l: triton_records.rows_records(p, l))(lens)
  assert np.array_equal(np.asarray(got), np.asarray(records(p, lens, "rows"))), name
  vmax = max(shape.v_widths)
  outs = {e: ragged_attention_triton(*args, out_dtype=jnp.bfloat16, heads_width=vmax,
                                     return_partials=True, epilogue=e, **w)
          for e in ("triton", "xla")}
  o, lse = outs["triton"][2]
  for width in (None, vmax):
    out, tot = triton_combine.combine_heads_triton(o, lse, p, F32, width)
    ref, ref_tot = combine_heads(o, lse, p, F32, width)
    close(out, ref, 1e-5, 1e-5, f"{name} combine {width}")
    close(tot, ref_tot, 1e-5, 1e-6, f"{name} combine lse {width}")
  close(outs["triton"][0].astype(F32), outs["xla"][0].astype(F32), 1e-2, 1e-2, f"{name} call")
  close(outs["triton"][1], outs["xla"][1], 1e-5, 1e-6, f"{name} call lse")
  ref, _ = combine_heads(o, lse.at[p.n_groups].set(-jnp.inf), p, F32)
  with pytest.raises(AssertionError):
    close(triton_combine.combine_heads_triton(o, lse, p, F32)[0], ref, 1e-5, 1e-5, "dropped")
