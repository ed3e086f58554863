"""XQuant rematerialisation kernels: dequant(packed low-bit X) · W, and a fused
rematerialise-and-attend decode kernel (K/V never written to HBM).

`reference.py` is the plain-jnp definition, `triton_backend.py` the jax-triton 0.3.1
GPU kernels, `api.py` the `implementation=` dispatcher (falls back to the reference
off-GPU).
"""

from kvlowrank_kernels.dequant_matmul.api import (IMPLEMENTATIONS, dequant_matmul,
                                                remat_decode_attention, resolve)
from kvlowrank_kernels.dequant_matmul.reference import PackedRows

__all__ = ["IMPLEMENTATIONS", "PackedRows", "dequant_matmul", "remat_decode_attention",
           "resolve"]
