"""KIVI problem shapes and seeded inputs shared by the KIVI tests and benchmark."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .planar import quantize_keys, quantize_values


@dataclasses.dataclass(frozen=True)
class KiviShape:
  """One KIVI decode problem: quantized capacity S, window capacity W, bits and groups."""

  batch: int
  capacity: int
  window: int
  n_heads: int
  n_kv_heads: int
  head_dim: int = 128
  k_bits: int = 2
  v_bits: int = 2
  k_group: int = 32
  v_group: int = 32
  scale_dtype: Optional[str] = None  # None: the data's (bf16); "float16": KIVI's own format


# Small problems for the tests, all within the Triton kernel's constraints (`triton_plan.plan`):
# GQA 1/4/8; 2/4-bit K and V; one and several code segments per row (H = 64, 128); value
# planes of 16 and 32 channels; 1, 2, 4 and 8 value groups per token; key groups of 8 (the
# gathered-scale path), 16 (half tiles), 32 and 64. Capacities are multiples of
# `planar.VALUE_BLOCK`. One shape stores fp16 scale/zero (the kernel's fp16 MMA path).
TEST_SHAPES = (
    KiviShape(batch=3, capacity=320, window=40, n_heads=4, n_kv_heads=4, head_dim=64,
              k_group=32, v_group=32),
    KiviShape(batch=2, capacity=192, window=33, n_heads=8, n_kv_heads=2, head_dim=128, k_bits=4,
              v_bits=2, k_group=64, v_group=16),
    KiviShape(batch=2, capacity=128, window=20, n_heads=8, n_kv_heads=1, head_dim=64, k_bits=2,
              v_bits=4, k_group=16, v_group=64),
    KiviShape(batch=2, capacity=256, window=128, n_heads=2, n_kv_heads=2, head_dim=128,
              k_group=32, v_group=32, scale_dtype="float16"),
    KiviShape(batch=2, capacity=96, window=8, n_heads=4, n_kv_heads=1, head_dim=64, k_bits=4,
              v_bits=4, k_group=8, v_group=32),
)


_quantize_keys = jax.jit(quantize_keys, static_argnums=(1, 2, 3))
_quantize_values = jax.jit(quantize_values, static_argnums=(1, 2, 3))


def make_inputs(shape: KiviShape, key, q_len: Optional[np.ndarray] = None,
                w_len: Optional[np.ndarray] = None):
  """Seeded (q, keys, values, k_win, v_win, q_len, w_len) with quantized prefix."""
  ks = jax.random.split(key, 5)
  b, s, w = shape.batch, shape.capacity, shape.window
  kvs = (shape.n_kv_heads, shape.head_dim)
  q = jax.random.normal(ks[0], (b, shape.n_heads, shape.head_dim)).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, *kvs)).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, *kvs)).astype(jnp.bfloat16)
  k_win = jax.random.normal(ks[3], (b, w, *kvs)).astype(jnp.bfloat16)
  v_win = jax.random.normal(ks[4], (b, w, *kvs)).astype(jnp.bfloat16)
  sdt = None if shape.scale_dtype is None else jnp.dtype(shape.scale_dtype)
  keys = _quantize_keys(k, shape.k_bits, shape.k_group, sdt)
  values = _quantize_values(v, shape.v_bits, shape.v_group, sdt)
  q_len = np.full((b,), s, np.int32) if q_len is None else q_len
  w_len = np.full((b,), w, np.int32) if w_len is None else w_len
  return (q, keys, values, k_win, v_win, jnp.asarray(q_len, jnp.int32),
          jnp.asarray(w_len, jnp.int32))
