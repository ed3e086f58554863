"""Palu (ICLR 2025): low-rank latent KV cache with whitened SVD, Fisher rank search,
Hadamard-rotated quantized latents and the value→W_o fold.

Typical use::

  calib = palu.calibrate(params, spec, windows, fisher_windows=fisher_windows)
  cparams, layout = palu.compress(params, spec, palu.PaluSpec(target_ratio=0.5), calib)
  caches = init_caches("palu", pspec, spec, cparams, batch=B, capacity=S)

Importing this package registers the "palu" cache (kvlowrank.cache.latent).
"""

from kvlowrank.palu.spec import (PaluLayout, PaluSpec, default_group_size,
                                 layout_from_params, resolve_group_size)
from kvlowrank.palu.compress import (PaluCalibration, calibrate, compress, compress_layer,
                                     hadamard_rotation, plan_layout)
import kvlowrank.cache.latent  # noqa: E402,F401  (registers the "palu" cache)
