"""Evaluable KV-cache methods (see kvlowrank.methods.registry for the contract).

One sub-package per method holds everything about it: its spec, its cache (whose arrays are
the kernels' operands), its calibration if any, and its registration (method.py). Importing
this package registers the built-in methods; a new method adds its package to the imports
below.
"""

from kvlowrank.cache.base import cache_methods, init_caches
from kvlowrank.methods.registry import (Method, dense_kv_bytes_per_token, get_method, methods,
                                        register_method)
from kvlowrank.methods.dense import DenseCache, DenseSpec
from kvlowrank.methods.kivi import KiviCache, KiviSpec
from kvlowrank.methods.gear import GearCache, GearSpec
from kvlowrank.methods.palu import LatentCache, PaluSpec
from kvlowrank.methods.xquant import XCache, XCLCache, XQuantCLSpec, XQuantSpec
from kvlowrank.methods.rotated import RotatedCache, RotatedSpec
from kvlowrank.methods.evict import EvictCache, EvictSpec
