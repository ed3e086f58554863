"""Palu problem shapes and seeded inputs shared by the latent-attention tests and benchmark."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .packed import quantize_latent


@dataclasses.dataclass(frozen=True)
class LatentShape:
  """One Palu decode problem (G-LRD: Gr groups of g KV heads, group ranks rk / rv)."""

  batch: int
  capacity: int
  n_heads: int
  n_groups: int
  kv_per_group: int
  head_dim: int
  rk: int
  rv: int
  k_bits: int = 16
  v_bits: int = 16
  bias: bool = False

  @property
  def n_kv_heads(self) -> int:
    return self.n_groups * self.kv_per_group


def palu_50(batch: int, capacity: int, *, n_heads=32, n_kv_heads=32, head_dim=128, v_bits=16):
  """Palu's latency configuration: 4-KV-head groups, keys 75% / values 25% compressed."""
  g = 4
  width = g * head_dim
  return LatentShape(batch=batch, capacity=capacity, n_heads=n_heads,
                     n_groups=n_kv_heads // g, kv_per_group=g, head_dim=head_dim,
                     rk=width // 4, rv=3 * width // 4, v_bits=v_bits)


# Small problems for the tests: GQA ratio 1/4/8, non-power-of-2 ranks, bias,
# quantized keys and values, ragged lengths (set by the tests).
TEST_SHAPES = (
    LatentShape(batch=3, capacity=300, n_heads=4, n_groups=2, kv_per_group=2, head_dim=32,
                rk=48, rv=96, bias=True),
    LatentShape(batch=2, capacity=200, n_heads=16, n_groups=1, kv_per_group=4, head_dim=64,
                rk=64, rv=48),
    LatentShape(batch=2, capacity=130, n_heads=16, n_groups=2, kv_per_group=1, head_dim=32,
                rk=32, rv=64, k_bits=4, v_bits=2),
    LatentShape(batch=2, capacity=150, n_heads=2, n_groups=1, kv_per_group=2, head_dim=32,
                rk=32, rv=96, k_bits=3, v_bits=3, bias=True),
    LatentShape(batch=2, capacity=100, n_heads=4, n_groups=2, kv_per_group=2, head_dim=64,
                rk=64, rv=96, k_bits=2, v_bits=4),
)


_quantize = jax.jit(quantize_latent, static_argnums=(1,))


def make_inputs(shape: LatentShape, key, lengths: Optional[np.ndarray] = None):
  """Seeded (q, hk, hv, b_k, k_bias, lengths); latents quantized per shape.k_bits / v_bits.

  B_k is scaled by rk ** -0.5 so reconstructed keys have unit variance.
  """
  ks = jax.random.split(key, 5)
  b, s = shape.batch, shape.capacity
  gh = shape.kv_per_group * shape.head_dim
  q = jax.random.normal(ks[0], (b, shape.n_heads, shape.head_dim)).astype(jnp.bfloat16)
  hk = jax.random.normal(ks[1], (b, s, shape.n_groups, shape.rk)).astype(jnp.bfloat16)
  hv = jax.random.normal(ks[2], (b, s, shape.n_groups, shape.rv)).astype(jnp.bfloat16)
  b_k = (jax.random.normal(ks[3], (shape.n_groups, shape.rk, gh))
         * shape.rk ** -0.5).astype(jnp.bfloat16)
  k_bias = (0.5 * jax.random.normal(ks[4], (shape.n_groups, gh))) if shape.bias else None
  if shape.k_bits != 16:
    hk = _quantize(hk, shape.k_bits)
  if shape.v_bits != 16:
    hv = _quantize(hv, shape.v_bits)
  if lengths is None:
    lengths = np.full((b,), s, np.int32)
  return q, hk, hv, b_k, k_bias, jnp.asarray(lengths, jnp.int32)
