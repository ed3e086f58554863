"""Register-level (Mosaic GPU `FragmentedArray`) helpers of the Palu Mosaic kernel
(`mosaic_palu`), and the Pallas wrappers it calls.

Pallas Mosaic GPU has no transposing store for WGMMA-layout arrays and no op that pairs
adjacent columns of one, so these steps are written against the arrays' registers and
called through `plgpu.inline_mgpu` (`col_reduce` and `store_transposed` are the wrappers).
They rely on the WGMMA layout's vector of 2 adjacent columns per register
(`fragmented_array.WGMMA_LAYOUT`); the kernel's GPU tests check them against the
float32 reference.
"""

from __future__ import annotations

import numpy as np


def store_transposed_swizzled(x, ref, *, row_stride=1, row_offset=0):
  """ref[n, row_stride * r + row_offset] = x[r, n] for x [R, NP] (WGMMA layout, 16-bit).

  ref: the tiled view [NP / 8, K / 64, 8, 64] of a [NP, K] 16-bit shared-memory buffer with
  (8, 64) tiles and the 128-byte swizzle (the 16-byte chunk index of a row XORed with the
  row % 8), i.e. the K-major B operand of a wgmma.
  """
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, memref, vector  # pylint: disable=import-outside-toplevel
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  c = lambda v: arith.constant(i32, v)
  shape = ir.MemRefType(ref.type).shape
  assert shape[0] == x.shape[1] // 8 and shape[2:] == [8, 64], (ref.type, x.shape)
  assert (row_stride * (x.shape[0] - 1) + row_offset) // 64 < shape[1], (ref.type, x.shape)
  for reg, (r, col) in zip(x.registers.flat, x.layout.thread_idxs(x.shape)):
    k = arith.addi(arith.muli(arith.index_cast(i32, r), c(row_stride)), c(row_offset))
    col = arith.index_cast(i32, col)
    kt, kk = arith.divui(k, c(64)), arith.remui(k, c(64))
    [vec_len] = ir.VectorType(reg.type).shape
    for e in range(vec_len):
      val = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
      n = arith.addi(col, c(e))
      nr = arith.remui(n, c(8))
      swz = arith.addi(arith.muli(arith.xori(arith.divui(kk, c(8)), nr), c(8)), arith.remui(kk, c(8)))
      ids = [arith.divui(n, c(8)), kt, nr, swz]
      memref.store(val, ref, [arith.index_cast(index, v) for v in ids])


def rotate_pairs(k, cs):
  """RoPE on interleaved columns: for every column pair (2d, 2d + 1) of k [R, H] (f32, WGMMA
  layout) and cs [R, H] (16-bit, same layout; cs[:, 2d] = cos, cs[:, 2d + 1] = sin):
  out[:, 2d] = k0 cos - k1 sin, out[:, 2d + 1] = k1 cos + k0 sin, in f32, rounded to f16.
  Each pair is one register of both arrays (the layout's 2-element vectors)."""
  import jax.experimental.mosaic.gpu as mgpu  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, vector  # pylint: disable=import-outside-toplevel
  f32, f16 = ir.F32Type.get(), ir.F16Type.get()
  assert k.layout == cs.layout and k.registers.shape == cs.registers.shape
  ext = lambda v, e: vector.extract(v, dynamic_position=[],
                                    static_position=ir.DenseI64ArrayAttr.get([e]))
  out = np.empty(k.registers.shape, dtype=object)
  for idx in np.ndindex(k.registers.shape):
    kr, cr = k.registers[idx], cs.registers[idx]
    assert ir.VectorType(kr.type).shape == [2], kr.type
    k0, k1 = ext(kr, 0), ext(kr, 1)
    co, si = arith.extf(f32, ext(cr, 0)), arith.extf(f32, ext(cr, 1))
    r0 = arith.subf(arith.mulf(k0, co), arith.mulf(k1, si))
    r1 = arith.addf(arith.mulf(k1, co), arith.mulf(k0, si))
    out[idx] = vector.from_elements(ir.VectorType.get([2], f16),
                                    [arith.truncf(f16, r0), arith.truncf(f16, r1)])
  return mgpu.FragmentedArray(_registers=out, _layout=k.layout, _is_signed=None)


def store_vector(x, ref, *, offset=0):
  """ref[offset + c] = x[c] for a 1-D array x in a (possibly replicated) register layout, e.g.
  the column vectors of a WGMMA-layout array; replicated threads store the same value."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, memref, vector  # pylint: disable=import-outside-toplevel
  index = ir.IndexType.get()
  assert len(x.shape) == 1, x.shape
  for reg, (c,) in zip(x.registers.flat, x.layout.thread_idxs(x.shape)):
    [vec_len] = ir.VectorType(reg.type).shape
    for e in range(vec_len):
      val = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
      memref.store(val, ref, [arith.addi(c, arith.constant(index, offset + e))])


def col_reduce(op, x, scratch):
  """Column reduction of a WGMMA-layout [rows, NP] array across the warpgroup's warps, with
  this warpgroup's own scratch (Pallas's built-in cross-warp reduction shares one scratch
  buffer between warpgroups, which races when two compute warpgroups reduce at once).
  Called inside a Pallas Mosaic GPU kernel."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((x.shape[1],), x.dtype,
                                                        layout=layout.reduce(0)))
  def f(_, xv, sc_ref):
    return xv.reduce(op, 0, scratch=sc_ref)
  return f(x, scratch)


def store_transposed(x, dst, row_stride=1, row_offset=0):
  """dst[h, row_stride * t + row_offset] = x[t, h] for a WGMMA-layout x [64, NP] (16-bit)
  and dst [NP, K] in shared memory tiled (8, 64) with the 128-byte swizzle: the K-major B
  operand of a wgmma (p^T for a value product, rotated queries for Palu's scores). The
  untransposed [T, NP] layout would need a 32-byte swizzle, whose value tile then travels
  as 24 TMA boxes of 32-byte rows, which made the value stage slow (BENCHMARKS.md).
  Called inside a Pallas Mosaic GPU kernel."""
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(
      (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))))
  def f(_, xv, ref):
    store_transposed_swizzled(xv, ref, row_stride=row_stride, row_offset=row_offset)
  f(x, dst)
