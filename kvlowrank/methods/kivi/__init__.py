"""KIVI (Liu et al., ICML'24): 2/4-bit keys per channel, values per token, exact window.

cache.py: KiviSpec, KiviCache (the cache's arrays are the kernels' operands);
method.py: its registration; the kernels: `kvlowrank_kernels.kivi`.
"""

from kvlowrank.methods.kivi.cache import KiviCache, KiviSpec
from kvlowrank.methods.kivi import method as _method  # noqa: F401  (registers "kivi")
