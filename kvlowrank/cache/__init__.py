"""Cache protocol and the registered cache implementations."""

from kvlowrank.cache.base import (AttnInputs, KVCache, cache_methods, caches_nbytes,
                                  init_caches, register_cache)
from kvlowrank.cache.dense import DenseCache, DenseSpec
from kvlowrank.cache.kivi import KiviCache, KiviSpec
from kvlowrank.cache.xquant import XCache, XQuantSpec
from kvlowrank.cache.xquant_cl import XCLCache, XQuantCLSpec
