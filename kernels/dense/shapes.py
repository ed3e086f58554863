"""Problem shapes and seeded inputs shared by the decode-attention tests and benchmark."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """One decode-attention problem: batch, cache slots, query/kv heads, head dims."""

  batch: int
  capacity: int
  n_heads: int
  n_kv_heads: int
  head_dim: int = 128
  v_head_dim: int = 128

  @property
  def qpk(self) -> int:
    return self.n_heads // self.n_kv_heads


# Llama-2-7B (MHA) and Llama-3-8B (GQA 4) attention layers.
LLAMA2_7B = dict(n_heads=32, n_kv_heads=32, head_dim=128, v_head_dim=128)
LLAMA3_8B = dict(n_heads=32, n_kv_heads=8, head_dim=128, v_head_dim=128)

# Small problems for the tests: GQA ratio 1/4/8, ragged lengths incl. 1 and
# non-multiples of every tile size used by the kernels.
TEST_SHAPES = (
    DecodeShape(batch=3, capacity=300, n_heads=4, n_kv_heads=4, head_dim=64, v_head_dim=64),
    DecodeShape(batch=2, capacity=200, n_heads=8, n_kv_heads=2, head_dim=32, v_head_dim=32),
    DecodeShape(batch=2, capacity=130, n_heads=8, n_kv_heads=1, head_dim=32, v_head_dim=16),
)


def ragged_lengths(batch: int, capacity: int, rng: np.random.Generator) -> np.ndarray:
  """Lengths with 1, the full capacity and random non-tile-multiples in between."""
  fixed = [1, capacity, capacity - 37, 65, 129, 0 + 3]
  lens = [fixed[i] if i < len(fixed) else int(rng.integers(1, capacity + 1))
          for i in range(batch)]
  return np.clip(np.asarray(lens, np.int32), 1, capacity)


def make_inputs(shape: DecodeShape, key, dtype=jnp.bfloat16, lengths=None):
  """Seeded (q [B,N,H], k [B,S,K,H], v [B,S,K,Hv], lengths [B]) for one problem."""
  kq, kk, kv = jax.random.split(key, 3)
  b, s = shape.batch, shape.capacity
  q = jax.random.normal(kq, (b, shape.n_heads, shape.head_dim), jnp.float32)
  k = jax.random.normal(kk, (b, s, shape.n_kv_heads, shape.head_dim), jnp.float32)
  v = jax.random.normal(kv, (b, s, shape.n_kv_heads, shape.v_head_dim), jnp.float32)
  if lengths is None:
    lengths = np.full((b,), s, np.int32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), jnp.asarray(lengths, jnp.int32)
