"""In-register dequantization of packed XQuant rows (Triton language), shared by the
dequant-matmul kernel (`triton_dm`) and the fused rematerialise-and-attend kernel
(`triton_remat`).

Layout (`kvlowrank_kernels.quant.packing` at plane width 1, read as uint32 words by
`packing.pack_words`): codes are packed LSB-first along the channel axis, 32 / BITS codes
per word for 2/4/8 bits (code c in word c // (32 / BITS) at bit BITS·(c % (32 / BITS))).
3-bit rows are two planes: the low 2 bits of every code as a 2-bit plane (16 codes per
word, the first 2/3 of the row's NW words), then the high bit as a 1-bit plane (32 codes
per word, the last NW/3 words); no code straddles a word. NW = `packing.packed_words`
(rows padded to whole 32-code blocks at 3 bits).
Scales/zeros are one pair per GROUP channels of a row (token axis) or per GROUP rows
of a channel (channel axis). The wrappers pass the code words bitcast to int32
(jax-triton and the CPU interpreter both handle int32; the kernel bitcasts back so
the shifts are logical).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlowrank_kernels.quant import packing


@triton.jit
def dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, row_ok, row0, k0, C: tl.constexpr,
                 NW: tl.constexpr, BITS: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
  """[BLOCK_R, BLOCK_K] fp32 X̂ = code·scale + zero for channels k0 .. k0 + BLOCK_K.

  Args:
    rows: [BLOCK_R] flat row indices (batch·S + slot); row0 = rows[0], a multiple
      of BLOCK_R within its batch row.
    row_ok: [BLOCK_R] bool; masked rows read code 0 (and scale/zero 0 on the token axis).
  When the tile's scales form one vector (token axis with GROUP % BLOCK_K == 0: one group
  per row; channel axis with GROUP % BLOCK_R == 0: one token group per tile) they are
  loaded once per row / channel instead of once per element.
  """
  rows = rows.to(tl.int64)
  rk = k0 + tl.arange(0, BLOCK_K)
  base = codes_ptr + rows[:, None] * NW
  if BITS == 3:  # low bits from the 2-bit plane, the high bit from the 1-bit plane
    LO: tl.constexpr = NW * 2 // 3
    lo = tl.load(base + (rk // 16)[None, :], mask=row_ok[:, None],
                 other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(base + (LO + rk // 32)[None, :], mask=row_ok[:, None],
                 other=0).to(tl.uint32, bitcast=True)
    val = ((lo >> (2 * (rk % 16)).to(tl.uint32)[None, :]) & 3) | \
        (((hi >> (rk % 32).to(tl.uint32)[None, :]) & 1) << 2)
  else:
    CPW: tl.constexpr = 32 // BITS
    w = tl.load(base + (rk // CPW)[None, :], mask=row_ok[:, None],
                other=0).to(tl.uint32, bitcast=True)
    val = w >> ((rk % CPW) * BITS).to(tl.uint32)[None, :]
  code = (val & ((1 << BITS) - 1)).to(tl.float32)
  if TOKEN_AXIS:
    if GROUP % BLOCK_K == 0:
      sidx = rows * (C // GROUP) + k0 // GROUP
      s = tl.load(scale_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
      z = tl.load(zero_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    else:
      sidx = rows[:, None] * (C // GROUP) + (rk // GROUP)[None, :]
      s = tl.load(scale_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
      z = tl.load(zero_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
  else:
    if GROUP % BLOCK_R == 0:
      sidx = (row0.to(tl.int64) // GROUP) * C + rk
      s = tl.load(scale_ptr + sidx).to(tl.float32)[None, :]
      z = tl.load(zero_ptr + sidx).to(tl.float32)[None, :]
    else:
      sidx = (rows // GROUP)[:, None] * C + rk[None, :]
      s = tl.load(scale_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
      z = tl.load(zero_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
  return code * s + z


@triton.jit
def mma(a, b, acc, EXACT: tl.constexpr):
  """acc + a @ b on the tensor cores; EXACT (fp32 operands) keeps full fp32 products
  ("ieee") instead of Triton's TF32 default, so fp32 models keep fp32 numerics."""
  if EXACT:
    acc = tl.dot(a, b, acc, input_precision="ieee")
  else:
    acc = tl.dot(a, b, acc)
  return acc


@triton.jit
def load_codes(codes_ptr, rows, row_ok, k0, NW: tl.constexpr, BITS: tl.constexpr,
               BLOCK_K: tl.constexpr):
  """Packed words of channels [k0, k0 + BLOCK_K) of `rows`, as compact tiles (one load
  per word, not per code): (w0, w1) with w0 [R, BLOCK_K·BITS/32] and w1 = w0 for 2/4/8
  bits, or for 3 bits the 2-bit plane's words w0 [R, BLOCK_K/16] and the 1-bit plane's
  w1 [R, BLOCK_K/32] (k0 and BLOCK_K multiples of 32)."""
  r = rows.to(tl.int64)[:, None] * NW
  if BITS == 3:
    LO: tl.constexpr = NW * 2 // 3
    wl = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    wh = LO + k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w0 = tl.load(codes_ptr + r + wl[None, :], mask=row_ok[:, None], other=0)
    w1 = tl.load(codes_ptr + r + wh[None, :], mask=row_ok[:, None], other=0)
  else:
    NWB: tl.constexpr = BLOCK_K * BITS // 32
    wi = k0 * BITS // 32 + tl.arange(0, NWB)
    w0 = tl.load(codes_ptr + r + wi[None, :], mask=row_ok[:, None], other=0)
    w1 = w0
  return w0, w1


@triton.jit
def expand_codes(w0, w1, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
  """[R, BLOCK_K] fp32 codes from `load_codes` words (in-register shifts and masks)."""
  if BITS == 3:
    sh2 = (tl.arange(0, 16) * 2).to(tl.uint32)
    lo = (w0.to(tl.uint32, bitcast=True)[:, :, None] >> sh2[None, None, :]) & 3
    sh1 = tl.arange(0, 32).to(tl.uint32)
    hi = (w1.to(tl.uint32, bitcast=True)[:, :, None] >> sh1[None, None, :]) & 1
    c = tl.reshape(lo, [BLOCK_R, BLOCK_K]) | (tl.reshape(hi, [BLOCK_R, BLOCK_K]) << 2)
  else:
    CPW: tl.constexpr = 32 // BITS
    sh = (tl.arange(0, CPW) * BITS).to(tl.uint32)
    c = (w0.to(tl.uint32, bitcast=True)[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)
  return tl.reshape(c, [BLOCK_R, BLOCK_K]).to(tl.float32)


@triton.jit
def load_scales(scale_ptr, zero_ptr, rows, row_ok, row0, k0, C: tl.constexpr,
                TOKEN_AXIS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
  """Scale and zero of a `fast_path` tile, fp32: [R, 1] (token axis: one group per row)
  or [1, BLOCK_K] (channel axis: one token group per tile)."""
  if TOKEN_AXIS:
    sidx = rows.to(tl.int64) * (C // GROUP) + k0 // GROUP
    s = tl.load(scale_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(zero_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
  else:
    sidx = (row0.to(tl.int64) // GROUP) * C + k0 + tl.arange(0, BLOCK_K)
    s = tl.load(scale_ptr + sidx).to(tl.float32)[None, :]
    z = tl.load(zero_ptr + sidx).to(tl.float32)[None, :]
  return s, z


def fast_path(bits: int, axis: str, group: int, block_r: int, block_k: int) -> bool:
  """Whether a tile layout takes the compact-load path (`load_codes`, `load_scales`):
  3-bit codes need whole words of the 1-bit plane (32 codes) per K step; the scales must
  be one vector per tile (token axis: group % block_k == 0; channel axis:
  group % block_r == 0)."""
  if bits == 3 and block_k % 32:
    return False
  return group % block_k == 0 if axis == "token" else group % block_r == 0


def bits_meta(bits: int, width: int, prefix: str = "") -> dict:
  """Constexprs describing a packed row of `width` channels at `bits` bits: its uint32
  words NW (padding included) and BITS."""
  return {f"NW{prefix}": packing.packed_words(width, bits), f"BITS{prefix}": bits}


def as_int32(words):
  """uint32 code words -> int32 (same bits; what the kernels take)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  if words.dtype == jnp.int32:
    return words
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def pick_block_k(c: int, want: int = 64) -> int:
  """Largest of (want, 64, 32, 16) that divides the quantized width c."""
  for bk in (want, 64, 32, 16):
    if bk and bk <= c and c % bk == 0:
      return bk
  raise ValueError(f"the quantized width ({c}) must be a multiple of 16 for the Triton kernels")


def check_pow2(name: str, val: int, lo: int = 16):
  """ValueError unless val is a power of two >= lo."""
  if val < lo or val & (val - 1):
    raise ValueError(f"{name} must be a power of 2 >= {lo}, got {val}")


__all__ = ["as_int32", "bits_meta", "check_pow2", "dequant_tile", "expand_codes", "fast_path",
           "load_codes", "load_scales", "mma", "pick_block_k"]
