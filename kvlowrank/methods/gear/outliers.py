"""Sparse outliers of GEAR (Eq. 4), per vector in the quantization direction.

A vector is a key channel of one compressed chunk (n_b tokens) or a value token of one KV
head (H channels). Choices (the paper and the official code differ; both written here):
  * Count: `counts(s, n)` = (top, bottom) with top + bottom = ceil(s/100 * n), top the
    larger half. The paper takes s/2 % from each end of vectors of ~1000-4096 entries; our
    vectors are short (64), so a per-end rounding would make s = 1 % and 2 % (0.3 and 0.6
    per end) both 0 or both 1. With the total rounded up, s = 1, 2, 4 % at n = 64 give 1,
    2 (1 + 1) and 3 (2 + 1) outliers: distinct, and s = 2 % is one from each end. The
    official code's key count int(s * hidden / 2) per channel scales with the hidden size,
    not the channel's length (a bug, reference-implementations.md); not copied.
  * Signed ends: the largest and the smallest values (not |x|), as Eq. 4.
  * Prefill: outliers are taken per chunk as for streaming chunks (the contract's stated
    departure: the paper takes them per vector over the whole prompt).
  * Fill before quantizing (GearSpec.outlier_fill): "mean" replaces each outlier by the mean
    of the vector's other entries (the official code uses the vector mean), which lies
    inside the remaining range, so it does not widen a group's min/max; "zero" is X - S of
    Eq. 5 read literally (a zero outside a key channel's range widens it).
  * Stored value (fp16), added at reconstruction (K~ = D^ + S + L): with "mean", S = X - D^
    at the outlier, so D^ + S = X there (the code writes the exact values back after
    dequantizing: the same thing, additively); with "zero", S = X (Eq. 4), so D^ + S =
    X + Q(0) there and the low-rank term sees the residual -Q(0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def counts(sparsity: float, n: int) -> tuple[int, int]:
  """(top, bottom) outliers per vector of n entries at s = `sparsity` percent."""
  total = min(n, math.ceil(sparsity * n / 100 - 1e-9)) if sparsity > 0 else 0
  return (total + 1) // 2, total // 2


def select(x, top: int, bottom: int):
  """Outliers along the last axis of x [..., n] (float32).

  Returns:
    idx int32 [..., top + bottom] (the top ones first, then the bottom ones; disjoint),
    mask bool [..., n] (True at the outliers).
  """
  n = x.shape[-1]
  parts = []
  taken = jnp.zeros(x.shape, bool)
  if top:
    i = jax.lax.top_k(x, top)[1]
    parts.append(i)
    taken = jnp.any(jax.nn.one_hot(i, n, dtype=bool), axis=-2)
  if bottom:
    i = jax.lax.top_k(jnp.where(taken, -jnp.inf, -x), bottom)[1]
    parts.append(i)
    taken = taken | jnp.any(jax.nn.one_hot(i, n, dtype=bool), axis=-2)
  return jnp.concatenate(parts, axis=-1), taken


def fill(x, mask, how: str):
  """x with the masked entries replaced ("mean" of the others along the last axis, or 0)."""
  if how == "zero":
    return jnp.where(mask, 0.0, x)
  keep = ~mask
  mean = jnp.sum(jnp.where(keep, x, 0.0), -1, keepdims=True) / jnp.maximum(
      jnp.sum(keep, -1, keepdims=True), 1)
  return jnp.where(mask, mean, x)


def stored_values(x, x_hat, how: str):
  """The fp16 sparse values (dense, read at the outliers): X - D^ ("mean") or X ("zero")."""
  return (x - x_hat if how == "mean" else x).astype(jnp.float16)
