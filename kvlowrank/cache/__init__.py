"""The cache protocol (`base`): what every method's per-layer cache implements.

The caches themselves live with their methods (`kvlowrank.methods.<name>.cache`);
`init_caches` builds any registered one.
"""

from kvlowrank.cache.base import (AttnInputs, KVCache, cache_methods, caches_nbytes,
                                  init_caches, register_cache)
