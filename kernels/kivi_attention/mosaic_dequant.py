"""Register-level KIVI-2bit dequantization for the Mosaic GPU kernel (`mosaic_kivi`).

`dequant_operand` runs inside `plgpu.inline_mgpu`: it reads one thread's 16 bytes of codes
and 128 bytes of scale/zero pairs of one 128-token block from shared memory (layout
`mosaic_layout`) and returns the [64, 128] wgmma A operand c * s + z (WGMMA layout, fp16
or bf16), per register pair of elements:
  x = (word >> shift) & (3 << f | 3 << 16 + f) | ONE   one mask-and-or (lop3): the magic
      number 1 + c 2^(f - MANT) in both 16-bit halves, exact (f + 2 <= MANT);
  c = x * 2^(MANT - f) - 2^(MANT - f)                  packed FMA, exact;
  v = c * s + z                                        packed FMA, one rounding.
MANT is 10 (fp16) or 7 (bf16). A word's 8 pair slots sit at bits 2k: fp16 takes slots 0-4
unshifted and 5-7 after one shift by 10; bf16 slots 0-2, then 3-5 (shift 6) and 6-7
(shift 12). Why not fold the scales into the other MMA operand or the zero into a
pre-offset (z - M s): see `triton_kivi` (per-tile operand rebuilds; a rounded group-wide
offset is a correlated error); here the scales of a pair are shared by the thread's two
rows, so they cost one 16-byte load per four pairs.
The CPU test `tests/kernels/test_kivi_mosaic.py` checks the same arithmetic in numpy
(`dequant_pairs_numpy`); the GPU tests check the kernel against the float32 reference.
"""

from __future__ import annotations

import numpy as np

_ONE = {"float16": 0x3C00, "bfloat16": 0x3F80}
_MANT = {"float16": 10, "bfloat16": 7}


def slot_plan(dtype: str):
  """[(slot k, right shift, landing field f)] for the 8 pair slots of a word."""
  mant = _MANT[dtype]
  out = []
  shift = 0
  for k in range(8):
    f = 2 * k - shift
    if f + 2 > mant:  # the field must lie inside the mantissa
      shift = 2 * k
      f = 0
    out.append((k, shift, f))
  return out


def dequant_pairs_numpy(words, scale_pairs, zero_pairs, dtype: str):
  """numpy model of the register arithmetic: words uint32 [...] -> the 8 pairs of each word
  as float32 [..., 8, 2] (after the final FMA with scale/zero pairs [..., 8, 2])."""
  npdt = np.float16 if dtype == "float16" else None
  one, mant = _ONE[dtype], _MANT[dtype]
  out = []
  for k, shift, f in slot_plan(dtype):
    bits = ((words >> np.uint32(shift)) & np.uint32((3 << f) | (3 << (16 + f)))) | np.uint32(
        one | (one << 16))
    halves = np.stack([bits & 0xFFFF, bits >> 16], -1).astype(np.uint32)
    if npdt is not None:
      x = halves.astype(np.uint16).view(np.float16).astype(np.float32)
    else:  # bf16 -> f32: the 16 bits are the top half of the float32
      x = (halves << 16).astype(np.uint32).view(np.float32)
    kk = float(2 ** (mant - f))
    c = x * kk - kk  # exact in the 16-bit type as well
    out.append(c)
  c = np.stack(out, -2)
  return c * scale_pairs + zero_pairs


def dequant_operand(codes_ref, scales_ref, m: int, dtype: str):
  """The thread's [64, 128] A operand (WGMMA layout) of sub-operand m of a block.

  codes_ref: [256, 4] uint32 (this slot's words; row 128 m + thread), scales_ref: [128, 8]
  (16-bit; rows 32 g + 8 quad + j // 2 with g = 2 m + warp // 2).
  """
  import jax.experimental.mosaic.gpu as mgpu  # pylint: disable=import-outside-toplevel
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # pylint: disable=import-outside-toplevel
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, math as mlir_math, vector  # pylint: disable=import-outside-toplevel
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  ft = ir.F16Type.get() if dtype == "float16" else ir.BF16Type.get()
  v2 = ir.VectorType.get([2], ft)
  ci = lambda v: arith.constant(i32, v)
  idx = lambda v: arith.index_cast(index, v)
  tid = arith.remui(mgpu_utils.thread_idx(), ci(128))
  warp, lane = arith.divui(tid, ci(32)), arith.remui(tid, ci(32))
  quad = arith.remui(lane, ci(4))
  words = vector.load(ir.VectorType.get([4], i32), codes_ref,
                      [idx(arith.addi(tid, ci(128 * m))), arith.constant(index, 0)])
  group = arith.addi(arith.divui(warp, ci(2)), ci(2 * m))
  srow = arith.addi(arith.muli(group, ci(32)), arith.muli(quad, ci(8)))
  srows = [vector.load(ir.VectorType.get([8], ft), scales_ref,
                       [idx(arith.addi(srow, ci(r))), arith.constant(index, 0)])
           for r in range(8)]

  def sz(j):  # (scale pair, zero pair) of pair column j
    row = srows[j // 2]
    off = (j % 2) * 4
    take = lambda o: vector.extract_strided_slice(v2, row, [o], [2], [1])
    return take(off), take(off + 2)

  one, mant = _ONE[dtype], _MANT[dtype]
  shifted = {}
  pairs = {}
  plan = slot_plan(dtype)
  for u in range(4):
    w = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([u]))
    for k, shift, f in plan:
      if (u, shift) not in shifted:
        shifted[(u, shift)] = arith.shrui(w, ci(shift)) if shift else w
      mask = (3 << f) | (3 << (16 + f))
      bits = arith.ori(arith.andi(shifted[(u, shift)], ci(mask)), ci(one | (one << 16)))
      x = vector.bitcast(v2, vector.from_elements(ir.VectorType.get([1], i32), [bits]))
      kk = float(2 ** (mant - f))
      cst = lambda val: arith.constant(v2, ir.DenseElementsAttr.get_splat(
          v2, ir.FloatAttr.get(ft, val)))
      c = mlir_math.fma(x, cst(kk), cst(-kk))
      rh, j = u // 2, (u % 2) * 8 + k
      s, z = sz(j)
      pairs[(rh, j)] = mlir_math.fma(c, s, z)
  layout = fa.WGMMA_LAYOUT
  shape = layout.registers_shape((64, 128))
  assert shape == (1, 16, 1, 1, 2, 1, 1, 1, 1), shape  # (j, rh) of the m64 fragments
  regs = np.empty(shape, dtype=object)
  for (rh, j), val in pairs.items():
    regs[0, j, 0, 0, rh, 0, 0, 0, 0] = val
  return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
