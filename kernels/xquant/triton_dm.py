"""Triton dequant-matmul: out [M, N] = dequant(packed X codes) @ W (GEMM tiles).

Program (m tile, n tile) accumulates a [BLOCK_M, BLOCK_N] fp32 tile over BLOCK_K-channel
slices of C: the dequantized X̂ slice is the MMA's A operand (computed in registers,
cast to W's dtype), the W slice the B operand (pipelined loads, `num_stages`). fp32
weights keep fp32 products (`triton_dequant.mma`, EXACT), others use W's dtype (bf16).
Used by the XQuant cache to materialise K|V (prefill chunks) with implementation
"triton"; decode uses the fused kernel in `triton_remat`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..common import triton_backend
from .triton_dequant import as_int32, bits_meta, dequant_tile, mma, pick_block_k


@triton.jit
def dm_kernel(codes_ptr, scale_ptr, zero_ptr, w_ptr, out_init, out_ptr, M: tl.constexpr,
              C: tl.constexpr, N: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr,
              TOKEN_AXIS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
  row0 = tl.program_id(0) * BLOCK_M
  rm = row0 + tl.arange(0, BLOCK_M)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
  m_ok = rm < M
  n_ok = rn < N
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  for k0 in range(0, C, BLOCK_K):
    x = dequant_tile(codes_ptr, scale_ptr, zero_ptr, rm, m_ok, row0, k0, C, NW, BITS,
                     TOKEN_AXIS, GROUP, BLOCK_M, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + rk[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0.0)
    acc = mma(x.to(w.dtype), w, acc, EXACT)
  optr = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
  tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str, group: int,
                   out_dtype=jnp.float32, block_m: int = 64, block_n: int = 128,
                   block_k: int = 0, num_warps: int = 4, num_stages: int = 2,
                   poison: bool = False):
  """Triton out [M, N] = dequant(codes, scale, zero) @ w (layout as reference.py).

  Args:
    codes, scale, zero, w, bits, axis, group, out_dtype: as reference.dequant_matmul.
    block_m, block_n, block_k (0: largest of 64/32/16 dividing C), num_warps, num_stages:
      tuning knobs.
    poison: NaN-fill the output first (tests: every element must be written).
  Returns:
    [M, N] array of out_dtype.
  """
  m, c, n = codes.shape[0], w.shape[0], w.shape[1]
  bk = pick_block_k(c, block_k)
  (out,) = triton_backend.launch(
      dm_kernel, as_int32(codes), scale, zero, w,
      out_shapes=[jax.ShapeDtypeStruct((m, n), out_dtype)],
      grid=(triton.cdiv(m, block_m), triton.cdiv(n, block_n)), num_warps=num_warps,
      num_stages=num_stages, poison=poison, M=m, C=c, N=n, TOKEN_AXIS=axis == "token",
      GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, EXACT=w.dtype == jnp.float32,
      **bits_meta(bits, c))
  return out
