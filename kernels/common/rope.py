"""The project's one RoPE frequency function and angle formula (HF half-rotation pairs).

`inv_frequencies` gives the [H/2] inverse frequencies w_i = theta^(-2i/H) in float64,
with optional Llama-3 scaling (HF `rope_type="llama3"`, `_compute_llama3_parameters`):
frequencies whose wavelength 2π/w is below original_max_position_embeddings /
high_freq_factor are kept, those above original_max_position_embeddings / low_freq_factor
are divided by `factor`, and those in between are interpolated,
    w' = (1 - s) w / factor + s w,   s = (L_orig / (2π/w) - low) / (high - low).
`rope_angles` is the one float32 angle formula fl(t · fl32(w)) that every cos/sin table
(the model's, the caches', the kernels' references) uses, so they agree bitwise.
The model (`kvlowrank.model.rope`) and the kernels both call these; kernels never import
kvlowrank, so the scaling is any object with the four attributes (`kvlowrank.spec.RopeScaling`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")


def _check(head_dim, theta, scaling):
  if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) \
      or head_dim <= 0 or head_dim % 2:
    raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
  if not theta > 0:
    raise ValueError(f"theta must be > 0, got {theta!r}")
  if scaling is None:
    return
  missing = [f for f in SCALING_FIELDS if not hasattr(scaling, f)]
  if missing:
    raise ValueError(f"scaling lacks {', '.join(missing)} (Llama-3 RoPE scaling needs "
                     f"{', '.join(SCALING_FIELDS)})")
  if scaling.high_freq_factor == scaling.low_freq_factor:
    raise ValueError(f"scaling.high_freq_factor must differ from low_freq_factor, both "
                     f"{scaling.low_freq_factor!r}")


def inv_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
  """[head_dim / 2] float64 inverse frequencies, Llama-3 scaled when `scaling` is given.

  Args:
    head_dim: H (even).
    theta: RoPE base (rope_theta).
    scaling: None, or an object with attributes factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings (e.g. `kvlowrank.spec.RopeScaling`).
  Returns:
    float64 numpy array (static: computed once on the host).
  """
  _check(head_dim, theta, scaling)
  h = int(head_dim)
  inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  rs = scaling
  if rs is None:
    return inv
  # HF `_compute_llama3_parameters`: keep high frequencies, divide low ones by
  # `factor`, interpolate smoothly in between.
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
            / (rs.high_freq_factor - rs.low_freq_factor))
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled)


def rope_angles(inv_freq, positions):
  """[..., H/2] float32 angles fl(t · w) of integer positions t [...] (w rounded to float32
  first): the one formula every implementation's cos/sin tables use."""
  t = jnp.asarray(positions, jnp.int32).astype(jnp.float32)
  return t[..., None] * jnp.asarray(inv_freq, jnp.float32)
