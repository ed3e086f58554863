"""`implementation=` dispatcher for the XQuant dequant-matmul ops.

implementation:
  "reference"  plain jnp, fp32 math at HIGHEST precision (any backend; the CPU path and
               the test oracle)
  "xla"        the library baseline: dequantize to bf16 in XLA, one bf16 GEMM with fp32
               accumulation (cuBLAS on a GPU), then (remat_decode_attention) RoPE and
               XLA attention; runs on any backend (`xla.py`)
  "triton"     jax-triton 0.3.1 kernels (CUDA GPU only; ValueError elsewhere)
  "auto"       "triton" when jax-triton imports and the default backend is a CUDA GPU,
               else "reference"
"""

from __future__ import annotations

import jax.numpy as jnp

from kvlowrank_kernels.xquant import reference, xla

IMPLEMENTATIONS = ("auto", "reference", "triton", "xla")


def _check_impl(implementation: str):
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def resolve(implementation: str) -> str:
  """Maps "auto" to the backend that will run; ValueError for an unavailable "triton"."""
  _check_impl(implementation)
  from kvlowrank_kernels.xquant import triton_backend  # pylint: disable=C0415
  if implementation == "auto":
    return "triton" if triton_backend.available() else "reference"
  if implementation == "triton" and not triton_backend.available():
    raise ValueError("implementation='triton' needs jax-triton and a CUDA GPU backend")
  return implementation


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str = "token", group: int,
                   out_dtype=jnp.float32, implementation: str = "auto", **tuning):
  """out [M, N] = dequant(codes, scale, zero) @ w (layout: see reference.py).

  Args:
    codes: [M, words(C)] uint32 packed codes.
    scale, zero: [M, C/group] (axis="token") or [M/group, C] (axis="channel").
    w: [C, N] weights.
    bits: 2, 3, 4 or 8.
    axis: "token" or "channel" (which axis the quantization groups run along).
    group: channels (token axis) or rows (channel axis) per group.
    out_dtype: output dtype.
    implementation: see module doc.
    **tuning: Triton kernel knobs (block_m, block_n, block_k, num_warps, num_stages).
  Returns:
    [M, N] array of `out_dtype`.
  """
  impl = resolve(implementation)
  if impl == "triton":
    from kvlowrank_kernels.xquant import triton_backend  # pylint: disable=C0415
    reference.check_layout(codes, scale, zero, w, bits=bits, axis=axis, group=group)
    return triton_backend.dequant_matmul(codes, scale, zero, w, bits=bits, axis=axis,
                                         group=group, out_dtype=out_dtype, **tuning)
  mod = xla if impl == "xla" else reference
  return mod.dequant_matmul(codes, scale, zero, w, bits=bits, axis=axis, group=group,
                            out_dtype=out_dtype)


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, implementation: str = "auto",
                           return_lse: bool = False, **tuning):
  """Decode attention with K/V rematerialised from packed rows (see reference.py).

  "triton" runs the fused kernel `triton_remat` (K and V tiles live in registers only);
  `tuning` (its knobs, see triton_backend.remat_decode_attention) goes to it.
  Returns:
    out [B, N, H] fp32, and lse [B, N] (natural log) when return_lse.
  """
  impl = resolve(implementation)
  args = (q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens)
  if impl == "triton":
    from kvlowrank_kernels.xquant import triton_backend  # pylint: disable=C0415
    return triton_backend.remat_decode_attention(*args, n_kv_heads=n_kv_heads,
                                                 return_lse=return_lse, **tuning)
  mod = xla if impl == "xla" else reference
  return mod.remat_decode_attention(*args, n_kv_heads=n_kv_heads, return_lse=return_lse)
