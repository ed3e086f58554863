"""Seeded random benchmark inputs, each built by one fused kernel.

Benchmark caches reach tens of GiB; `jax.random.uniform` would build them through float32
temporaries of the same shape. These fills draw random bits and turn them into values in
place, so an input costs its own bytes and nothing more. The values are random data: the
kernels' speed does not depend on them, and no test compares them against anything.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnums=(1, 2))
def rand(key, shape, dtype=jnp.bfloat16):
  """Values in [-1, 1) on a grid of 2^-6, from 16 random bits per element.

  Args:
    key: a `jax.random.key`; the same key gives the same values.
    shape: output shape (static).
    dtype: output dtype (static); the values are exact in bf16 and wider types.
  """
  bits = jax.random.bits(key, shape, jnp.uint16)
  # bf16 with the exponent of 1.0 and 7 random mantissa bits: [1, 2); then to [-1, 1).
  mant = (bits & jnp.uint16(0x007F)) | jnp.uint16(0x3F80)
  x = jax.lax.bitcast_convert_type(mant, jnp.bfloat16) - jnp.bfloat16(1.5)
  return (x * 2).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1,))
def rand_u8(key, shape):
  """Uniform random bytes (every bit pattern is a valid packed code set)."""
  return jax.random.bits(key, shape, jnp.uint8)
