"""GPU entry points of the XQuant Triton kernels (import-safe without Triton).

The kernels are module-level `@triton.jit` functions in `triton_dm` (dequant-matmul) and
`triton_remat` (the GEMM-shaped fused rematerialise-and-attend decode kernel), sharing
`triton_dequant`; every launch goes through `kvlowrank_kernels.common.triton_backend.launch`
(jax-triton 0.3.1 on a GPU; `tests/kernels/triton_interpret.py` swaps it for Triton's
CPU interpreter). This module imports them lazily so that it loads where Triton is
not installed (the CPU CI).
"""

from __future__ import annotations

from ..common import triton_backend as _launcher


def available() -> bool:
  """True when jax-triton and Triton import and JAX's default backend is a GPU."""
  return _launcher.available()


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str, group: int, **kw):
  """Triton out [M, N] = dequant(codes, scale, zero) @ w; see triton_dm.dequant_matmul."""
  from . import triton_dm  # pylint: disable=import-outside-toplevel
  return triton_dm.dequant_matmul(codes, scale, zero, w, bits=bits, axis=axis, group=group,
                                  **kw)


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, **tuning):
  """Fused rematerialise-and-attend decode (args as reference.remat_decode_attention).

  Args:
    **tuning: `triton_remat.remat_decode_attention`'s knobs (block_m, block_k, num_splits,
      target_programs, num_warps, num_stages), plus return_lse and poison.
  Returns:
    out [B, N, H] fp32 (and lse [B, N] with return_lse=True).
  """
  from . import triton_remat  # pylint: disable=import-outside-toplevel
  return triton_remat.remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens,
                                             n_kv_heads=n_kv_heads, **tuning)
