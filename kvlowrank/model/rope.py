"""Rotary position embeddings: half-rotation (HF) and interleaved (llama2.c/GGUF) layouts,
with optional Llama-3 frequency scaling."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvlowrank.spec import ModelSpec
from kvlowrank_kernels.common import rope


def inv_frequencies(spec: ModelSpec) -> np.ndarray:
  """[H/2] inverse frequencies (float64 numpy, static), Llama-3 scaled when configured: the
  project's one RoPE-frequency function (`kvlowrank_kernels.common.rope`), which the
  kernels' tables use too."""
  return rope.inv_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)


def rope_cos_sin(positions, spec: ModelSpec):
  """cos, sin of shape [..., H/2] in fp32 for integer `positions` [...]."""
  ang = rope.rope_angles(inv_frequencies(spec), positions)
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
