"""XQuant rematerialisation kernels: dequant(packed low-bit X) · W, and a fused
rematerialise-and-attend decode kernel (K/V never written to HBM).

`reference.py` is the plain-jnp definition, `xla.py` the library baseline (bf16 XLA
dequant + cuBLAS GEMM + XLA attention), `triton_backend.py` the entry to the jax-triton
0.3.1 GPU kernels (`triton_dm`, `triton_remat`, sharing `triton_dequant`), `api.py` the
`implementation=` dispatcher. Codes are `kvlowrank_kernels.quant.packing` rows read as
uint32 words (`packing.pack_words`).
"""

from kvlowrank_kernels.xquant.api import (IMPLEMENTATIONS, dequant_matmul,
                                                remat_decode_attention, resolve)
from kvlowrank_kernels.xquant.reference import PackedRows

__all__ = ["IMPLEMENTATIONS", "PackedRows", "dequant_matmul", "remat_decode_attention",
           "resolve"]
