"""FDC/ZACK-compressed parameters of chosen ragged widths, from random orthogonal key
rotations and random value factors (no calibration: the tests of the rotated cache's
sharding and balancing need exact widths, not good ones)."""

import numpy as np

from kvlowrank.methods.rotated import compression


def ragged_rotated_params(params, spec, k_widths, v_widths, seed=0):
  """`params` (dense, qkv as `kvlowrank.model.params`) with every layer i compressed to
  the widths k_widths[i] / v_widths[i] (tuples of K multiples of 16, <= head_dim)."""
  rng = np.random.default_rng(seed)
  kh, h, d, n = spec.n_kv_heads, spec.head_dim, spec.dim, spec.n_layers
  rk = np.stack([[np.linalg.qr(rng.standard_normal((h, h)))[0] for _ in range(kh)]
                 for _ in range(n)])
  factors = compression.Factors(rk=rk, sk=np.ones((n, kh, h)),
                                av=rng.standard_normal((n, kh, d, h)) * d ** -0.5,
                                bv=rng.standard_normal((n, kh, h, h)) * h ** -0.5,
                                sv=np.ones((n, kh, h)))
  layers = [compression.compress_layer(lp, spec, factors, i, k_widths[i], v_widths[i])
            for i, lp in enumerate(params["layers"])]
  return dict(params, layers=layers)
