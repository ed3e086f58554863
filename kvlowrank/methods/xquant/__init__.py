"""XQuant / XQuant-CL (Tomar, Hooper et al. 2025): quantized layer inputs, K/V
rematerialised; cross-layer deltas.

cache.py: XQuantSpec, XCache; store.py: its token stores; cl.py: XQuantCLSpec, XCLCache;
method.py: registration of "xquant" and "xquant_cl"; the kernels: `kvlowrank_kernels.xquant`.
"""

from kvlowrank.methods.xquant.cache import XCache, XQuantSpec
from kvlowrank.methods.xquant.cl import XCLCache, XQuantCLSpec
from kvlowrank.methods.xquant import method as _method  # noqa: F401  (registers both)
