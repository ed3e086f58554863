"""Triton helpers that unpack `quant.packing` codes (plane width 1) inside a kernel tile.

Codes never go through an int->float conversion: a code c < 2**bits is OR-ed
into the top mantissa bits of fp16 1.0 (0x3C00), giving the exact fp16 value
1 + c / 2**bits with two integer ops and a free bitcast. fp16 rather than bf16:
the weights that multiply the codes (p * scale, q * scale) are rounded to the
operand type, and the affine offsets below cancel most of the result, so fp16's
3 extra mantissa bits make the rounding error of the quantized paths 8 times smaller.
Kernels feed these values straight to `tl.dot` and remove the affine offset with per-row sums:
  sum_t w_t c_t = 2**bits * (sum_t w_t (1 + c_t / 2**bits) - sum_t w_t).
Unpacking a byte row into adjacent channels uses nested `tl.join` (a new
minor axis of 2) and one reshape; the join order below reproduces the packing's
LSB-first adjacent layout (code w * ppb + k <- bits [k * bits, (k + 1) * bits) of byte w).
Rows must hold no padding (R a multiple of `packing.row_block(bits)`): the 3-bit high plane
is then found at byte R / 4.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unpack_tile(x, T: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
  """x: [T, W] uint8 packed codes -> [T, W * 8 // BITS] int16 codes (BITS in 1, 2, 4)."""
  x = x.to(tl.int16)
  if BITS == 4:
    y = tl.join(x & 15, (x >> 4) & 15)
  elif BITS == 2:
    y = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, (x >> 6) & 3))
  else:
    y = tl.join(
        tl.join(tl.join(x & 1, (x >> 4) & 1), tl.join((x >> 2) & 1, (x >> 6) & 1)),
        tl.join(tl.join((x >> 1) & 1, (x >> 5) & 1), tl.join((x >> 3) & 1, (x >> 7) & 1)))
  return tl.reshape(y, [T, W * (8 // BITS)])


@triton.jit
def load_codes(row_ptr, t_ok, C0: tl.constexpr, CP: tl.constexpr, CN: tl.constexpr,
               R: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr):
  """Codes of channels [C0, C0 + CP) of packed rows (CN <= CP valid, rest 0).

  Args:
    row_ptr: [T, 1] uint8 pointers to the start of each token's packed row.
    t_ok: [T] token mask.
    C0, CP, CN: first channel, padded and valid piece width (multiples of 8; CP pow2).
    R: full row width in channels (3-bit: locates the high-bit plane).
    BITS: 2, 3 or 4.
  Returns:
    [T, CP] int16 codes.
  """
  if BITS == 3:
    lo_b = tl.arange(0, CP // 4)[None, :]
    lo = tl.load(row_ptr + C0 // 4 + lo_b, mask=t_ok[:, None] & (lo_b < CN // 4), other=0)
    hi_b = tl.arange(0, CP // 8)[None, :]
    hi = tl.load(row_ptr + R // 4 + C0 // 8 + hi_b, mask=t_ok[:, None] & (hi_b < CN // 8),
                 other=0)
    codes = unpack_tile(lo, T, CP // 4, 2) | (unpack_tile(hi, T, CP // 8, 1) << 2)
  else:
    # (No early return above: Triton compiles the code after a returning branch too.)
    nb: tl.constexpr = CP * BITS // 8
    cb = tl.arange(0, nb)[None, :]
    x = tl.load(row_ptr + C0 * BITS // 8 + cb, mask=t_ok[:, None] & (cb < CN * BITS // 8),
                other=0)
    codes = unpack_tile(x, T, nb, BITS)
  return codes


@triton.jit
def codes_to_f16(c, BITS: tl.constexpr):
  """int16 codes -> fp16 values 1 + c / 2**BITS (exact; no int->float conversion)."""
  return ((c << (10 - BITS)) | 0x3C00).to(tl.float16, bitcast=True)
