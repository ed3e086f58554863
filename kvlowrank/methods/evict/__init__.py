"""SnapKV-style token eviction around any registered cache (issue 22, item 5).

spec.py: EvictSpec; select.py: the policy (scores, admission); cache.py: EvictCache, the
wrapper; method.py: its registration. Import after the methods it wraps.
"""

from kvlowrank.methods.evict.cache import EvictCache
from kvlowrank.methods.evict.spec import EvictSpec
from kvlowrank.methods.evict import method as _method  # noqa: F401  (registers "evict")
