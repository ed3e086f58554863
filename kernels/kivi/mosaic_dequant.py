"""Register-level KIVI-2bit code extraction for the Mosaic GPU kernel (`mosaic_kivi_warp`).

`word_codes` runs inside `plgpu.inline_mgpu`: from one thread's uint32 code words
(layout `mosaic_layout`) it makes the codes c as exact fp16/bf16 pairs, per register pair of
elements:
  x = (word >> shift) & (3 << f | 3 << 16 + f) | ONE   one lop3 (PTX): the magic
      number 1 + c 2^(f - MANT) in both 16-bit halves, exact (f + 2 <= MANT);
  c = x * 2^(MANT - f) - 2^(MANT - f)                  packed FMA, exact.
MANT is 10 (fp16) or 7 (bf16). A word's 8 pair slots sit at bits 2k: fp16 takes slots 0-4
unshifted and 5-7 after one shift by 10; bf16 slots 0-2, then 3-5 (shift 6) and 6-7
(shift 12). The kernel folds the scales into its other MMA operand and adds the zero
points by small products (`mosaic_warp_step`), so the codes enter the products as these
exact small integers. `word_magic` (the keys) stops after the lop3, with MAGIC = 1024 in
place of 1 (the key products remove MAGIC's share). Why not fold the zero into a pre-offset
(z - M s): see `triton_kivi` (a rounded group-wide offset is a correlated error).
The CPU test `tests/kernels/test_kivi_mosaic_warp.py` checks the same arithmetic in numpy
(`code_pairs_numpy`, `magic_pairs_numpy`); the GPU tests check the kernel against the float32 reference.
"""

from __future__ import annotations

import numpy as np

from . import mosaic_ptx as ptx
from .mosaic_ptx import const_i32

_MANT = {"float16": 10, "bfloat16": 7}
MAGIC = 1024.0  # the key codes' offset (`word_magic`): 0x6400 in fp16, 0x4480 in bf16


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


def _or_pairs_numpy(words, dtype: str, base: float):
  """numpy model of the lop3 (`_lop3_pairs`): words uint32 [...] -> per slot k of
  `slot_plan`, (float32 [..., 2 elements e] of the 16-bit values the lop3 leaves: base with
  the slot's two codes in its field f, f)."""
  b = _bits16(base, dtype)
  out = []
  for _, shift, f in slot_plan(dtype):
    bits = ((words >> np.uint32(shift)) & np.uint32((3 << f) | (3 << (16 + f)))) | np.uint32(
        b | (b << 16))
    halves = np.stack([bits & 0xFFFF, bits >> 16], -1).astype(np.uint32)
    if dtype == "float16":
      x = halves.astype(np.uint16).view(np.float16).astype(np.float32)
    else:  # bf16 -> f32: the 16 bits are the top half of the float32
      x = (halves << 16).astype(np.uint32).view(np.float32)
    out.append((x, f))
  return out


def code_pairs_numpy(words, dtype: str):
  """numpy model of the register arithmetic: words uint32 [...] -> the codes of the 8 pairs
  of each word, float32 [..., 8 slots k, 2 elements e], as the kernel's 16-bit pairs hold
  them."""
  mant = _MANT[dtype]
  out = []
  for x, f in _or_pairs_numpy(words, dtype, 1.0):
    kk = float(2 ** (mant - f))
    out.append(x * kk - kk)  # exact in the 16-bit type as well
  return np.stack(out, -2)


def magic_factor(k: int, dtype: str) -> float:
  """2^-(weight of slot k's field in MAGIC + c 2^w): `word_magic`'s pair slot k holds
  MAGIC + c / magic_factor(k), exact (field f: weight 2^(f + 10 - MANT))."""
  return 2.0 ** -(slot_plan(dtype)[k][2] + 10 - _MANT[dtype])


def magic_pairs_numpy(words, dtype: str):
  """numpy model of `word_magic`: words uint32 [...] -> [..., 8 slots k, 2 elements e] of
  the 16-bit values MAGIC + c / magic_factor(k), as float32."""
  return np.stack([x for x, _ in _or_pairs_numpy(words, dtype, MAGIC)], -2)


def pair_const(val: float, dtype: str):
  """An i32 holding the 16-bit float val in both halves."""
  h = _bits16(val, dtype)
  return const_i32(h | (h << 16))


def _ctx():
  # pylint: disable=import-outside-toplevel
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector
  # pylint: enable=import-outside-toplevel
  return mgpu_utils, ir, arith, vector


def thread_coords():
  """(tid in the warpgroup, warp, lane) as i32 values."""
  mgpu_utils, _, arith, _ = _ctx()
  tid = arith.remui(mgpu_utils.thread_idx(), const_i32(128))
  return tid, arith.divui(tid, const_i32(32)), arith.remui(tid, const_i32(32))


def load16(ref, flat, elem=None):
  """16 aligned bytes of a [rows, 256] shared-memory ref at a flat element index, as 4 i32
  (elem: the ref's element type, i32 by default)."""
  _, ir, arith, vector = _ctx()
  i32 = ir.IntegerType.get_signless(32)
  elem = elem or i32
  index = ir.IndexType.get()
  n = 128 // ir.IntegerType(elem).width if isinstance(elem, ir.IntegerType) else 8
  idx = lambda v: arith.index_cast(index, v)
  vec = vector.load(ir.VectorType.get([n], elem), ref,
                    [idx(arith.divui(flat, const_i32(256))),
                     idx(arith.remui(flat, const_i32(256)))], alignment=16)
  if n != 4:
    vec = vector.bitcast(ir.VectorType.get([4], i32), vec)
  return [extract(vec, e) for e in range(4)]


def extract(vec, e: int):
  _, ir, _, vector = _ctx()
  return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))


def _lop3_pairs(words, dtype: str, base: float, finish):
  """{(u, k): finish(x, f)} for the 8 pair slots k of each i32 word u in `words`: x is the
  lop3 of the word (shifted once per distinct shift) with slot k's two codes in field f of
  the 16-bit float `base` in both halves. finish runs right after each lop3."""
  _, _, arith, _ = _ctx()
  shifted = {}
  pairs = {}
  for u, w in enumerate(words):
    for k, shift, f in slot_plan(dtype):
      if (u, shift) not in shifted:
        shifted[(u, shift)] = arith.shrui(w, const_i32(shift)) if shift else w
      mask = (3 << f) | (3 << (16 + f))
      x = ptx.lop3_and_or(shifted[(u, shift)], const_i32(mask), pair_const(base, dtype))
      pairs[(u, k)] = finish(x, f)
  return pairs


def word_codes(words, dtype: str):
  """{(u, k): i32 pair of exact codes c} for the 8 pair slots k of each i32 word u in
  `words` (module docstring): the lop3's 1 + c 2^(f - MANT), then one packed FMA."""
  mant = _MANT[dtype]

  def finish(x, f):
    kk = float(2 ** (mant - f))
    return ptx.hfma2(x, pair_const(kk, dtype), pair_const(-kk, dtype), dtype)
  return _lop3_pairs(words, dtype, 1.0, finish)


def word_magic(words, dtype: str):
  """{(u, k): i32 pair of MAGIC + c / magic_factor(k)} for the 8 pair slots k of each i32
  word u: one lop3 per pair, no packed FMA (the key products fold 1 / magic_factor into q
  and subtract MAGIC's share by one more product per k-step: `mosaic_warp_step`)."""
  return _lop3_pairs(words, dtype, MAGIC, lambda x, f: x)


def key_scale_rows(scales_ref, group, dtype: str):
  """The thread's 8 rows of key (scale pair, zero pair) for token group `group` (i32): row r
  holds pair columns j = 2 r, 2 r + 1 as 4 i32 [s(j % 2 = 0), z(0), s(1), z(1)].

  scales_ref: [4, 256] 16-bit; the 8 elements of (g, r, quad) sit at flat index
  8 (32 g + 4 r + quad) (quad = lane % 4: the four quads' chunks are side by side).
  """
  _, ir, arith, _ = _ctx()
  ft = ir.F16Type.get() if dtype == "float16" else ir.BF16Type.get()
  _, _, lane = thread_coords()
  sbase = arith.addi(arith.muli(group, const_i32(32)), arith.remui(lane, const_i32(4)))
  return [load16(scales_ref, arith.muli(arith.addi(sbase, const_i32(4 * r)), const_i32(8)), ft)
          for r in range(8)]


def key_pairs(codes_ref, m: int, dtype: str):
  """{(rh, j): i32 pair of MAGIC + c / magic_factor(j % 8) (`word_magic`)} of the thread's
  share of key sub-tile m of a block
  (its warp's tokens 32 warp + 16 m + lane // 4 + 8 rh, channels 8 j + 2 (lane % 4) + e).

  codes_ref: [4, 256] uint32 (this slot's words; thread tau's 4 words of m at flat index
  4 (128 m + tau)).
  """
  _, _, arith, _ = _ctx()
  tid, _, _ = thread_coords()
  words = load16(codes_ref, arith.muli(arith.addi(tid, const_i32(128 * m)), const_i32(4)))
  pairs = word_magic(words, dtype)
  return {(u // 2, (u % 2) * 8 + k): v for (u, k), v in pairs.items()}
