"""FDC (Zhang & Shen 2026) and ZACK (Zhang & Shen): post-RoPE rotated KV caches with adaptive
per-head widths, one family with two calibration recipes (methods `fdc`, `zack`).

Typical use::

  stats = rotated.statistics(params, spec, rspec, windows, recipe="fdc")
  cparams, layout, rate = rotated.compress(params, spec, rspec, stats, "fdc")
  caches = init_caches("rotated", rspec, spec, cparams, batch=B, capacity=S)

spec.py: RotatedSpec and the widths layout; widths.py: Eq. 1 kept widths, rounding,
allocation; calibration.py: Q-K / V Grams and rotations; compression.py: value factors (FDC via
Palu's decomposition, ZACK's [V; W_O] rotation), folds; cache.py: the rotated cache;
search.py: binary search of the removal rate; sharding.py: balancing ragged heads over a
tensor-parallel mesh (`balance`, `padding_fraction`); method.py: registration.
"""

from kvlowrank.methods.rotated.spec import (RotatedLayout, RotatedSpec, layout_from_params)
from kvlowrank.methods.rotated.compression import (Factors, RotatedCalibration, compress,
                                                factorise, plan_layout)
from kvlowrank.methods.rotated.cache import RotatedCache
from kvlowrank.methods.rotated.sharding import balance, padding_fraction
from kvlowrank.methods.rotated.method import statistics
from kvlowrank.methods.rotated.search import (SearchResult, binary_search_rate,
                                              search_model_rate)
from kvlowrank.methods.rotated import method as _method  # noqa: F401  (registers fdc, zack)
