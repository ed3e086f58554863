"""Problem shapes and seeded inputs of the ragged-head decode tests and benchmark."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RaggedShape:
  """One ragged decode problem: batch, cache slots, query heads per KV head, per-head widths,
  and the original head dim H (the score scale is 1/sqrt(H))."""

  batch: int
  capacity: int
  groups: int
  k_widths: tuple
  v_widths: tuple
  head_dim: int = 128

  @property
  def scale(self) -> float:
    return self.head_dim ** -0.5


def ragged_widths(n_heads: int, mean: int, rng: np.random.Generator, spread: int = 2,
                  lo: int = 16, hi: int = 128) -> tuple:
  """Per-head widths, multiples of 16 in [lo, hi], with the given mean (a multiple of 16):
  pairs of heads move +-16*j (j <= spread) in opposite directions, so the mean is exact."""
  ws = [mean] * n_heads
  for i in range(0, n_heads - 1, 2):
    d = 16 * int(rng.integers(0, spread + 1))
    d = min(d, hi - mean, mean - lo)
    ws[i], ws[i + 1] = mean + d, mean - d
  perm = rng.permutation(n_heads)
  return tuple(int(ws[i]) for i in perm)


# Small problems for the CPU tests: GQA 1/4/8 and 3 (SmolLM2's: not a power of two), widths
# 16-64 (maximum a power of two or not), ragged lengths incl. 1 and non-multiples of the tiles.
TEST_SHAPES = (
    RaggedShape(batch=3, capacity=200, groups=4, k_widths=(32, 16, 48), v_widths=(16, 48, 32),
                head_dim=64),
    RaggedShape(batch=2, capacity=130, groups=1, k_widths=(16, 64), v_widths=(64, 16),
                head_dim=64),
    RaggedShape(batch=2, capacity=97, groups=8, k_widths=(48,), v_widths=(32,), head_dim=64),
    RaggedShape(batch=2, capacity=150, groups=3, k_widths=(32, 48, 16), v_widths=(48, 16, 32),
                head_dim=64),
)


def make_inputs(shape: RaggedShape, key, dtype=jnp.bfloat16, lengths=None):
  """Seeded (q_rot [B, G, sum k], k_rot [B, S, sum k], v_rot [B, S, sum v], lengths [B])."""
  kq, kk, kv = jax.random.split(key, 3)
  b, s, g = shape.batch, shape.capacity, shape.groups
  sk, sv = sum(shape.k_widths), sum(shape.v_widths)
  q = jax.random.normal(kq, (b, g, sk), jnp.float32)
  k = jax.random.normal(kk, (b, s, sk), jnp.float32)
  v = jax.random.normal(kv, (b, s, sv), jnp.float32)
  if lengths is None:
    lengths = np.full((b,), s, np.int32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), jnp.asarray(lengths, jnp.int32)
