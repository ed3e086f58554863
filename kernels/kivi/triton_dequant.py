"""Triton device functions: planar KIVI codes -> bf16/fp16 MMA operand tiles (c * s + z).

Used by `triton_kivi`. `dequant_asm` is the GPU path (inline PTX, 4 codes per call);
`dequant` picks it or a plain-Triton equivalent (the CPU interpreter cannot run PTX).
Codes never go through an int->float conversion: a code field is OR-ed into the
mantissa of a power-of-2 "magic" M (exact), one packed FMA removes M (exact c),
a second one applies the group's scale and zero (one rounding); see `dequant_asm`.
"""

import triton
import triton.language as tl


@triton.jit
def dequant_asm(x, s, z, K: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
                 WORDS: tl.constexpr, HALF: tl.constexpr, sh=None):
  """c * s + z elementwise, 4 codes per call, in packed DT (bf16 or fp16) PTX.

  x: uint8 planar bytes (plane K is bits [K * BITS, (K + 1) * BITS)).
  s, z: the scale and zero of each element's group, raw from memory: DT values
    (WORDS false; 4 elements arrive as two registers of DT pairs), or int32
    words holding two 16-bit groups (WORDS true; one register per element,
    half HALF is this plane's group; prmt pairs them up).
  sh: None, or an int32 tile of run-time field positions (K must be 0): the packed word of 4
    codes is shifted right by the first of its 4 elements' sh before the prmt, so the 4
    elements that one call packs must share their sh (the caller's sh is constant over
    aligned runs of at least 4 elements along each axis a pack can take).
  Per 2 codes: prmt puts byte i in the low byte of 16-bit lane i (shared by the
  planes of a byte), lop3 keeps plane K's field (at bit P of the lane, shifted
  down first if it would reach the exponent) and ORs in the exponent of the
  magic M = 2**MB, giving M + c * 2**P exactly; one FMA (x 2**-P, - M * 2**-P)
  gives c exactly, a second FMA c * s + z (one rounding).
  """
  MB: tl.constexpr = 7 if DT == tl.bfloat16 else 10  # mantissa bits
  BIAS: tl.constexpr = 127 if DT == tl.bfloat16 else 15
  NAT: tl.constexpr = K * BITS  # field position in the byte
  SH: tl.constexpr = NAT if NAT + BITS > MB else 0
  P: tl.constexpr = NAT - SH
  MASK: tl.constexpr = (((1 << BITS) - 1) << P) * 65537
  MAGIC: tl.constexpr = ((BIAS + MB) << MB) * 65537  # M = 2**MB in both lanes
  INV: tl.constexpr = ((BIAS - P) << MB) * 65537  # 2**-P
  NEG: tl.constexpr = (0x8000 | ((BIAS + MB - P) << MB)) * 65537  # -M * 2**-P
  OP: tl.constexpr = "fma.rn.bf16x2" if DT == tl.bfloat16 else "fma.rn.f16x2"
  SHIFT: tl.constexpr = f"shr.b32 lo, lo, {SH}; shr.b32 hi, hi, {SH};" if SH else ""
  SRC: tl.constexpr = "$2" if sh is None else "w"
  PRE: tl.constexpr = "" if sh is None else f"shr.b32 w, $2, ${11 if WORDS else 7};"
  CODES: tl.constexpr = f"""
        {PRE}
        prmt.b32 lo, {SRC}, 0, 0x4140;
        prmt.b32 hi, {SRC}, 0, 0x4342;
        {SHIFT}
        lop3.b32 lo, lo, {MASK}, {MAGIC}, 0xEA;
        lop3.b32 hi, hi, {MASK}, {MAGIC}, 0xEA;
        mov.b32 a, {INV};
        mov.b32 b, {NEG};
        {OP} lo, lo, a, b;
        {OP} hi, hi, a, b;"""
  ARGS: tl.constexpr = "" if sh is None else ",r,r,r,r"
  if WORDS:
    SEL: tl.constexpr = 0x7632 if HALF else 0x5410
    y = tl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 lo, hi, a, b, w, s0, s1, z0, z1;
        {CODES}
        prmt.b32 s0, $3, $4, {SEL};
        prmt.b32 s1, $5, $6, {SEL};
        prmt.b32 z0, $7, $8, {SEL};
        prmt.b32 z1, $9, $10, {SEL};
        {OP} $0, lo, s0, z0;
        {OP} $1, hi, s1, z1;
        }}""",
        constraints="=r,=r,r,r,r,r,r,r,r,r,r" + ARGS,
        args=[x, s, z] if sh is None else [x, s, z, sh], dtype=tl.bfloat16, is_pure=True,
        pack=4)
  else:
    y = tl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 lo, hi, a, b, w;
        {CODES}
        {OP} $0, lo, $3, $5;
        {OP} $1, hi, $4, $6;
        }}""",
        constraints="=r,=r,r,r,r,r,r" + ARGS,
        args=[x, s, z] if sh is None else [x, s, z, sh], dtype=tl.bfloat16, is_pure=True,
        pack=4)
  if DT == tl.float16:  # the asm's registers hold fp16 pairs
    y = y.to(tl.float16, bitcast=True)
  return y


@triton.jit
def to_dtype(x, DT: tl.constexpr, FAST: tl.constexpr):
  """fp32 -> DT, round to nearest even. (The CPU interpreter truncates fp32 -> bf16, so the
  plain path rounds by hand: add 0x7FFF plus the kept LSB, drop 16 bits.)"""
  if FAST or DT == tl.float16:
    y = x.to(DT)
  else:
    b = x.to(tl.uint32, bitcast=True)
    y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
  return y


@triton.jit
def dequant(x, s, z, K: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
             WORDS: tl.constexpr, HALF: tl.constexpr, FAST: tl.constexpr, sh=None):
  """DT tile c * s + z of plane K of the planar bytes x (see `dequant_asm`); with sh (K = 0),
  of the field at bit sh of each byte."""
  if FAST:
    y = dequant_asm(x, s, z, K, BITS, DT, WORDS, HALF, sh)
  else:
    # Same arithmetic in fp32 (c * s is exact), one rounding to DT like the packed FMA.
    if WORDS:
      s = ((s >> (16 * HALF)) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
      z = ((z >> (16 * HALF)) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
    if sh is None:
      c = ((x >> (K * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    else:
      c = ((x.to(tl.int32) >> sh) & ((1 << BITS) - 1)).to(tl.float32)
    y = to_dtype(c * s.to(tl.float32) + z.to(tl.float32), DT, False)
  return y
