"""The uncompressed baseline ("dense"): exact post-RoPE K/V at the cache dtype.

cache.py: DenseSpec, DenseCache; method.py: its registration.
"""

from kvlowrank.methods.dense.cache import DenseCache, DenseSpec
from kvlowrank.methods.dense import method as _method  # noqa: F401  (registers "dense")
