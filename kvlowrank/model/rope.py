"""Rotary position embeddings: half-rotation (HF) and interleaved (llama2.c/GGUF) layouts,
with optional Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kvlowrank.spec import ModelSpec


def inv_frequencies(spec: ModelSpec) -> np.ndarray:
  """[H/2] inverse frequencies (float64 numpy, static), Llama-3 scaled when configured."""
  h = spec.head_dim
  inv = 1.0 / (spec.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  rs = spec.rope_scaling
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


def rope_cos_sin(positions, spec: ModelSpec):
  """cos, sin of shape [..., H/2] in fp32 for integer `positions` [...]."""
  inv = jnp.asarray(inv_frequencies(spec), jnp.float32)
  ang = positions.astype(jnp.float32)[..., None] * inv
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, positions, spec: ModelSpec):
  """Rotates x [B, T, heads, H] at integer positions [B, T]; computed in fp32."""
  if spec.rope_layout == "none":
    return x
  cos, sin = rope_cos_sin(positions, spec)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  xf = x.astype(jnp.float32)
  if spec.rope_layout == "half":
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  else:
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
  return out.astype(x.dtype)


def interleaved_to_half_perm(head_dim: int) -> np.ndarray:
  """Row permutation p such that w_half = w_interleaved[p] within one head.

  Interleaved pairs (2i, 2i+1) become (i, i + H/2) in the half layout.
  """
  return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def permute_heads_to_half(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
  """Converts a [heads*H, in] (torch-layout) Q/K weight from interleaved to half layout."""
  rows = w_out_in.shape[0]
  head_dim = rows // n_heads
  perm = interleaved_to_half_perm(head_dim)
  w = w_out_in.reshape(n_heads, head_dim, *w_out_in.shape[1:])
  return w[:, perm].reshape(w_out_in.shape)
