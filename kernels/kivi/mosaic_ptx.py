"""PTX instructions the Mosaic GPU KIVI kernel issues through `llvm.inline_asm`.

Used inside `plgpu.inline_mgpu` bodies (`mosaic_dequant`, `mosaic_kivi_warp`), where Pallas
hands over MLIR values. Why PTX and not MLIR arithmetic: LLVM promotes a <2 x half> FMA to
two f32 FMAs plus conversions (seen in the PTX), folds `(a & m) | c` into two LOP3s, and
has no operation for the warp-level tensor-core MMA (`mma.sync`) or `movmatrix`.
Every function takes and returns 32-bit MLIR values (i32 for packed 16-bit pairs, f32).
"""

from __future__ import annotations


def _mlir():
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  return ir, llvm


def i32_type():
  ir, _ = _mlir()
  return ir.IntegerType.get_signless(32)


def f32_type():
  ir, _ = _mlir()
  return ir.F32Type.get()


def _asm(ret, args, text, constraints, side_effects=False):
  _, llvm = _mlir()
  return llvm.inline_asm(ret, list(args), text, constraints, has_side_effects=side_effects)


def ptx_type(dtype: str) -> str:
  """The PTX name of a 16-bit float dtype ("float16" -> f16, "bfloat16" -> bf16)."""
  return {"float16": "f16", "bfloat16": "bf16"}[dtype]


def hfma2(a, b, c, dtype: str):
  """Packed a * b + c on i32 registers holding two fp16/bf16 values (one rounding each)."""
  return _asm(i32_type(), [a, b, c], f"fma.rn.{ptx_type(dtype)}x2 $0, $1, $2, $3;",
              "=r,r,r,r")


def const_i32(v: int):
  """An i32 constant (v may be given as an unsigned 32-bit pattern)."""
  from jax._src.lib.mlir.dialects import arith  # pylint: disable=import-outside-toplevel
  return arith.constant(i32_type(), v if v < 2 ** 31 else v - 2 ** 32)


def hmul2(a, b, dtype: str):
  """Packed a * b (one rounding each), as an FMA with -0 (which keeps a * b = -0 exact)."""
  return hfma2(a, b, const_i32(0x80008000), dtype)


def lop3_and_or(a, b, c):
  """(a & b) | c in one LOP3 (plain and/or gave two: a LOP3 takes one immediate)."""
  return _asm(i32_type(), [a, b, c], "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r")


def pack2(lo, hi, dtype: str):
  """Two f32 -> one i32 holding (lo, hi) rounded to fp16/bf16 (lo in the low half)."""
  return _asm(i32_type(), [hi, lo], f"cvt.rn.{ptx_type(dtype)}x2.f32 $0, $1, $2;", "=r,f,f")


def ex2(x):
  """2^x, approximate (ex2.approx.ftz: 2^-inf = +0)."""
  return _asm(f32_type(), [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")


def lg2(x):
  """log2(x), approximate (lg2.approx.ftz)."""
  return _asm(f32_type(), [x], "lg2.approx.ftz.f32 $0, $1;", "=f,f")


def shfl_xor(x, mask: int):
  """The f32 or i32 x of lane (lane ^ mask) in this warp (all 32 lanes take part)."""
  ty = x.type
  kind = "f" if str(ty) == "f32" else "r"
  return _asm(ty, [x], f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;",
              f"={kind},{kind}", side_effects=True)


def shfl_idx(x, lane):
  """The f32 or i32 x of lane `lane` (an i32 value) in this warp (all 32 lanes take part)."""
  ty = x.type
  kind = "f" if str(ty) == "f32" else "r"
  return _asm(ty, [x, lane], "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
              f"={kind},{kind},r", side_effects=True)


def movmatrix_t(x):
  """Transposes the warp's 8 x 8 16-bit matrix held one i32 per lane (lane l: row l // 4,
  columns 2 (l % 4), 2 (l % 4) + 1): returns the same fragment of the transpose."""
  return _asm(i32_type(), [x], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
              side_effects=True)


def mma_16816(a, b, c, dtype: str):
  """d = a @ b + c, one warp's m16n8k16 tensor-core product (f32 accumulate).

  a: 4 i32 (the A fragment: rows l // 4 (+ 8), columns 2 (l % 4) (+ 8), 16-bit pairs along
  columns), b: 2 i32 (B: rows 2 (l % 4) (+ 8), column l // 4), c: 4 f32 (rows l // 4 (+ 8),
  columns 2 (l % 4) + {0, 1}). Returns the 4 f32 of d in c's order.
  """
  _, llvm = _mlir()
  t = ptx_type(dtype)
  f32 = f32_type()
  text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{$0, $1, $2, $3}}, "
          "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
  res = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), [*a, *b, *c], text,
                        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", has_side_effects=False)
  return [llvm.extractvalue(f32, res, [i]) for i in range(4)]
