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


def _rewrite_tile(codes_ref, dst_ref, bits, pairs_of):
  """`code_rows`' loop: each of the warpgroup's 128 threads takes half a row (token t =
  thread / 2) of a 64-token tile of packed codes, a 32-bit code word at a time; pairs_of maps
  a code word (i32) to its 16 / bits fp16 pairs (as i32), which go out in 16-byte stores
  into the swizzled tile (hence `mosaic_plan.code_order`). Ends with a warpgroup barrier:
  the codes may be overwritten (TMA) after it."""
  import jax.experimental.mosaic.gpu as mgpu  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, llvm, vector  # pylint: disable=import-outside-toplevel
  utils = mgpu.utils
  i32 = ir.IntegerType.get_signless(32)
  c = lambda v: arith.constant(i32, v)
  dshape = ir.MemRefType(dst_ref.type).shape
  cshape = ir.MemRefType(codes_ref.type).shape
  assert dshape[0] == 8 and dshape[2:] == [8, 64], dst_ref.type
  r = dshape[1] * 64
  assert cshape == [64, r * bits // 8], (codes_ref.type, dst_ref.type)
  words = r * bits // 32                 # 32-bit code words per row
  assert words % 2 == 0, words
  half = words // 2                      # per thread
  chunks = 16 // bits // 4               # 16-byte stores per word
  tid = arith.remui(utils.thread_idx(), c(128))
  t = arith.shrui(tid, c(1))
  h = arith.andi(tid, c(1))
  t8, tr = arith.shrui(t, c(3)), arith.andi(t, c(7))
  cptr, dptr = utils.memref_ptr(codes_ref), utils.memref_ptr(dst_ref)
  chunk_ty = ir.VectorType.get([4], i32)
  row_words = arith.addi(arith.muli(t, c(words)), arith.muli(h, c(half)))
  tile_base = arith.addi(arith.muli(t8, c(r // 64 * 64)), arith.muli(tr, c(8)))
  for m in range(half):
    word = llvm.load(i32, utils.getelementptr(cptr, [arith.addi(row_words, c(m))], i32))
    out = pairs_of(word)
    for q in range(chunks):
      j = arith.addi(arith.muli(h, c(half * chunks)), c(m * chunks + q))   # chunk in row
      off = arith.addi(tile_base, arith.addi(arith.muli(arith.shrui(j, c(3)), c(64)),
                                             arith.xori(arith.andi(j, c(7)), tr)))
      llvm.store(vector.from_elements(chunk_ty, out[4 * q:4 * q + 4]),
                 utils.getelementptr(dptr, [off], chunk_ty))
  utils.warpgroup_barrier()


def code_centre(bits: int) -> int:
  """The centre 2^(bits - 1) that `code_rows` takes off each code and `copy_scale_rows`
  moves into the zero."""
  return 1 << (bits - 1)


def code_rows(codes_ref, dst_ref, *, bits: int):
  """dst[t, j] = m_j * (code[t, order[j]] - 2^(bits - 1)) (fp16, exact) for a 64-token tile
  of packed codes: a key or value tile, centred, with its scale and zero left to the
  compute warpgroups (`mosaic_palu`: the folded key and value products). order =
  `mosaic_plan.code_order(R, bits)`, m_j = `mosaic_plan.code_multipliers(R, bits)`[j].

  codes_ref: [64, R * bits / 8] uint8 in shared memory, a `quant.packing` row per token
    (code c at bits `bits` * (c % (32 / bits)) of the c / (32 / bits)-th little-endian
    32-bit word);
  dst_ref: the tiled view [8, R / 64, 8, 64] of a [64, R] fp16 buffer with (8, 64) tiles
    and the 128-byte swizzle (16-byte chunk j of row t at chunk (j % 8) ^ (t % 8) of its
    128-byte tile row): a wgmma operand.
  Half a row per thread, a code word at a time (`_rewrite_tile`), with no int -> float
  conversion (a quarter-rate instruction). Per 32-bit code word q and each of its two
  bytes' halves (q, q >> 8), an and-or and a subtraction per fp16 pair: (x & (mask << bits
  k)) | 0x64006400 puts codes (k, k + 16 / bits) of that half, shifted left by bits * k,
  into the mantissas of 1024 (no shifts back), and subtracting 1024 + m_j 2^(bits - 1)
  leaves m_j times the centred code, exactly: 2.25 instructions per pair at 4 bits, where
  dequantizing (a shift back and an fma with the scale and zero as well) took about 4. Why
  the offsets come off here and not after the product: the tensor cores' float32
  accumulation errs in proportion to the accumulator, so one that carries an offset (1024 Σ
  p, or the codes' mean) loses the codes' bits as the context grows, and the offset cancels
  only afterwards (`copy_scale_rows` moves the centre into the zero). The pairs come in
  `mosaic_plan.code_order`."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, llvm, vector  # pylint: disable=import-outside-toplevel
  i32, f16 = ir.IntegerType.get_signless(32), ir.F16Type.get()
  c = lambda v: arith.constant(i32, v)
  mask = (1 << bits) - 1
  pair_ty = ir.VectorType.get([2], f16)

  centre = code_centre(bits)
  offsets = [vector.broadcast(pair_ty, arith.constant(f16, 1024.0 + (centre << (bits * k))))
             for k in range(8 // bits)]     # 1024 + m_k * centre, m_k = 2^(bits k)

  def exact(x, k):
    x = llvm.bitcast(pair_ty, arith.ori(x, c(0x64006400)))
    return llvm.bitcast(i32, arith.subf(x, offsets[k]))

  def pairs_of(word):
    return [exact(arith.andi(qq, c((mask << (bits * k)) * 0x10001)), k)
            for qq in (word, arith.shrui(word, c(8))) for k in range(8 // bits)]
  _rewrite_tile(codes_ref, dst_ref, bits, pairs_of)


def copy_scale_rows(sz_ref, dst_ref, grp, *, groups: int, bits: int):
  """dst[0, t] = s_t and dst[1, t] = z_t + h s_t in float32, h = `code_centre(bits)`, for a
  tile's 64 tokens (their scale s and zero z: sz_ref [2, 64 * groups / 8, 8] fp16, row 0
  the scales and row 1 the zeros of every head group, token t of group g at t * groups +
  g), into a [2, 64] float32 buffer that the compute warpgroups load as a WGMMA row
  vector: s c + z = s (c - h) + (z + h s) for the centred codes of `code_rows`. Thread i
  of the warpgroup writes entry (i / 64, i % 64)."""
  import jax.experimental.mosaic.gpu as mgpu  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, math as mlir_math, memref  # pylint: disable=import-outside-toplevel
  utils = mgpu.utils
  i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
  index = ir.IndexType.get()
  c = lambda v: arith.constant(i32, v)
  tid = arith.remui(utils.thread_idx(), c(128))
  a, t = arith.shrui(tid, c(6)), arith.andi(tid, c(63))
  idx = arith.addi(arith.muli(t, c(groups)), grp)
  at = lambda row: [arith.index_cast(index, v)
                    for v in (row, arith.shrui(idx, c(3)), arith.andi(idx, c(7)))]
  scale = arith.extf(f32, memref.load(sz_ref, at(c(0))))
  x = arith.extf(f32, memref.load(sz_ref, at(a)))
  # row 0: s + 0 * s; row 1: z + h * s
  row = arith.uitofp(f32, a)
  y = mlir_math.fma(scale, arith.mulf(row, arith.constant(f32, float(code_centre(bits)))), x)
  memref.store(y, dst_ref, [arith.index_cast(index, v) for v in (a, t)])
