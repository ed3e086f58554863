"""Register-level KIVI-2bit dequantization for the Mosaic GPU kernel (`mosaic_kivi`).

`dequant_operand` runs inside `plgpu.inline_mgpu`: it reads one thread's 16 bytes of codes
and 128 bytes of scale/zero pairs of one 128-token block from shared memory (layout
`mosaic_layout`) and returns the [64, 128] wgmma A operand c * s + z (WGMMA layout, fp16
or bf16), per register pair of elements:
  x = (word >> shift) & (3 << f | 3 << 16 + f) | ONE   one lop3 (PTX): the magic
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


def _bits16(val: float, dtype: str) -> int:
  """The 16-bit pattern of val in fp16 or bf16 (bf16: the top half of the float32)."""
  if dtype == "float16":
    return int(np.array(val, np.float16).view(np.uint16))
  return int(np.array(val, np.float32).view(np.uint32)) >> 16


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

  codes_ref: [4, 256] uint32 (this slot's words; thread tau's 4 words of m at flat index
  4 (128 m + tau)), scales_ref: [4, 256] 16-bit (the 8 elements of (g, r, quad) at flat index
  8 (32 g + 4 r + quad), g = 2 m + warp // 2, holding pair columns j = 2 r, 2 r + 1).
  """
  # pylint: disable=import-outside-toplevel
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  # pylint: enable=import-outside-toplevel
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  ft = ir.F16Type.get() if dtype == "float16" else ir.BF16Type.get()
  v2 = ir.VectorType.get([2], ft)
  v4i = ir.VectorType.get([4], i32)
  ci = lambda v: arith.constant(i32, v if v < 2 ** 31 else v - 2 ** 32)
  idx = lambda v: arith.index_cast(index, v)
  # LLVM promotes a <2 x half> fma to two f32 fmas plus conversions (seen in the PTX: 5 more
  # instructions per pair), so the packed FMA is written as PTX.
  fma_instr = "fma.rn.f16x2" if dtype == "float16" else "fma.rn.bf16x2"

  def hfma2(a, b, c):  # packed a * b + c on 32-bit registers holding two 16-bit floats
    return llvm.inline_asm(i32, [a, b, c], f"{fma_instr} $0, $1, $2, $3;", "=r,r,r,r")

  def lop3_and_or(a, b, c):  # (a & b) | c in one LOP3 (from plain and/or, ptxas emitted two:
    # a LOP3 takes one immediate, and the mask and the magic number were both constants)
    return llvm.inline_asm(i32, [a, b, c], "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r")

  def pair_bits(val):  # a 16-bit float constant in both halves of a 32-bit word
    h = _bits16(val, dtype)
    return ci(h | (h << 16))

  tid = arith.remui(mgpu_utils.thread_idx(), ci(128))
  warp, lane = arith.divui(tid, ci(32)), arith.remui(tid, ci(32))
  quad = arith.remui(lane, ci(4))

  def load(ref, flat, elem=i32):  # 16 aligned bytes as [4 x i32], at a flat element index
    n = 128 // ir.IntegerType(elem).width if isinstance(elem, ir.IntegerType) else 8
    vec = vector.load(ir.VectorType.get([n], elem), ref,
                      [idx(arith.divui(flat, ci(256))), idx(arith.remui(flat, ci(256)))],
                      alignment=16)
    return vec if n == 4 else vector.bitcast(v4i, vec)
  words = load(codes_ref, arith.muli(arith.addi(tid, ci(128 * m)), ci(4)))
  group = arith.addi(arith.divui(warp, ci(2)), ci(2 * m))
  sbase = arith.addi(arith.muli(group, ci(32)), quad)
  # row r: (scale pair, zero pair) of pair columns j = 2 r and 2 r + 1, one i32 per pair
  srows = [load(scales_ref, arith.muli(arith.addi(sbase, ci(4 * r)), ci(8)), ft)
           for r in range(8)]
  ext = lambda vec, e: vector.extract(vec, dynamic_position=[],
                                      static_position=ir.DenseI64ArrayAttr.get([e]))

  one, mant = _ONE[dtype], _MANT[dtype]
  shifted = {}
  pairs = {}
  for u in range(4):
    w = ext(words, u)
    for k, shift, f in slot_plan(dtype):
      if (u, shift) not in shifted:
        shifted[(u, shift)] = arith.shrui(w, ci(shift)) if shift else w
      mask = (3 << f) | (3 << (16 + f))
      x = lop3_and_or(shifted[(u, shift)], ci(mask), ci(one | (one << 16)))
      kk = float(2 ** (mant - f))
      c = hfma2(x, pair_bits(kk), pair_bits(-kk))
      rh, j = u // 2, (u % 2) * 8 + k
      row = srows[j // 2]
      val = hfma2(c, ext(row, (j % 2) * 2), ext(row, (j % 2) * 2 + 1))
      pairs[(rh, j)] = vector.bitcast(v2, vector.from_elements(ir.VectorType.get([1], i32),
                                                               [val]))
  layout = fa.WGMMA_LAYOUT
  shape = layout.registers_shape((64, 128))
  assert shape == (1, 16, 1, 1, 2, 1, 1, 1, 1), shape  # (j, rh) of the m64 fragments
  regs = np.empty(shape, dtype=object)
  for (rh, j), val in pairs.items():
    regs[0, j, 0, 0, rh, 0, 0, 0, 0] = val
  return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
