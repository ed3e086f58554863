"""Palu (ICLR 2025): low-rank latent KV cache with whitened SVD, Fisher rank search,
Hadamard-rotated quantized latents and the value→W_o fold.

Typical use::

  calib = palu.calibrate(params, spec, windows, fisher_windows=fisher_windows)
  cparams, layout = palu.compress(params, spec, palu.PaluSpec(target_ratio=0.5), calib)
  caches = init_caches("palu", pspec, spec, cparams, batch=B, capacity=S)

spec.py: PaluSpec and the per-model layout; calibration.py, decompose.py, rank_search.py,
fold.py, hadamard.py, compress.py: the offline factorisation; cache.py: the latent cache
(the arrays are the kernels' operands); method.py: its registration and calibration
statistics; the kernels: `kvlowrank_kernels.palu`.
"""

from kvlowrank.methods.palu.spec import (PaluLayout, PaluSpec, default_group_size,
                                         layout_from_params, resolve_group_size)
from kvlowrank.methods.palu.compress import (PaluCalibration, calibrate, compress,
                                             compress_layer, hadamard_rotation, plan_layout)
from kvlowrank.methods.palu.cache import LatentCache
from kvlowrank.methods.palu import method as _method  # noqa: F401  (registers "palu")
