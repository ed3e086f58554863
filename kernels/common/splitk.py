"""Split-K (flash-decoding) planning and the log-sum-exp combine of per-split partials.

Every decode kernel in `kvlowrank_kernels` splits the key sequence of each
(batch, head-group) into `num_splits` contiguous chunks, one program per chunk,
so that a single decode token still fills the GPU. Each program writes its
chunk's normalised output o_s and log-sum-exp lse_s; the exact result is

    lse = logsumexp_s(lse_s),   out = sum_s exp(lse_s - lse) * o_s

(the same re-weighting as `kvlowrank.model.attention.combine`). Empty chunks
(ragged batches, short sequences) write o_s = 0 and lse_s = -inf and drop out.
The combine runs in XLA: it reads num_splits * Hv floats per head, a few per
cent of the cache bytes at the split counts chosen below, and is deterministic.
"""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

# Programs the planner aims for: a few waves of the 132 multiprocessors of an
# H100/H200, so the last wave's tail stays a small part of the run.
TARGET_PROGRAMS = 528


def choose_num_splits(parallel: int, capacity: int, block: int, *,
                      target: int = TARGET_PROGRAMS, min_tiles: int = 4,
                      requested: Optional[int] = None) -> int:
  """Number of key chunks per (batch, head-group).

  Args:
    parallel: programs that exist without splitting (batch x head groups).
    capacity: cache slots S (the longest a sequence can be).
    block: tokens per kernel tile.
    target: programs to aim for in total.
    min_tiles: keep at least this many tiles per chunk at full capacity, so
      per-program fixed costs (query load, table setup, partial store) stay small.
    requested: explicit override (benchmark sweeps); clipped to [1, tiles].
  Returns:
    num_splits >= 1.
  """
  tiles = max(1, math.ceil(capacity / block))
  if requested is not None:
    if requested < 1:
      raise ValueError(f"num_splits must be >= 1, got {requested}")
    return min(requested, tiles)
  want = max(1, math.ceil(target / max(parallel, 1)))
  return max(1, min(want, tiles // min_tiles if tiles >= min_tiles else 1))


def wave_balanced_splits(parallel: int, capacity: int, block: int, slots: int, *,
                         min_tiles: int = 4, overhead_tiles: float = 2.0) -> int:
  """Number of key chunks for a kernel whose programs run `slots` at a time (SMs x
  resident programs per SM): the fewest splits that minimise the critical path,
  ceil(parallel * n / slots) waves of ceil(tiles / n) + overhead_tiles tile-times each
  (overhead_tiles: a program's fixed cost, operand loads, pipeline fill, partial store).
  With one resident program per SM, 288 programs on 132 SMs take three waves; 256 take
  two, of longer chunks, and finish first."""
  tiles = max(1, math.ceil(capacity / block))
  best = None
  for n in range(1, max(1, tiles // min_tiles) + 1):
    cost = math.ceil(parallel * n / slots) * (math.ceil(tiles / n) + overhead_tiles)
    if best is None or cost < best[0]:
      best = (cost, n)
  return best[1]


def split_bounds(length, num_splits, sid, tile):
  """(start, end, tiles) of split sid of a sequence of `length` tokens, inside a kernel (jnp
  on scalars; the Triton kernels' twin is `triton_decode.split_range`): equal chunks of the
  sequence's own length, tile aligned; tiles = the chunk's tile count (0 past the end)."""
  chunk = ((length + num_splits - 1) // num_splits + tile - 1) // tile * tile
  start = sid * chunk
  end = jnp.minimum(start + chunk, length)
  return start, end, jnp.maximum(end - start + tile - 1, 0) // tile


def combine_result(o, lse, out_dtype, return_partials=False):
  """`combine_partials`, returned as the split-K kernels return: (out, lse), plus the raw
  (o, lse) partials if return_partials."""
  out, total = combine_partials(o, lse, out_dtype)
  if return_partials:
    return out, total, (o, lse)
  return out, total


def combine_partials(o, lse, out_dtype=jnp.float32):
  """Merges per-split partials.

  Args:
    o: [..., P, Hv] float32, each split's output normalised over its own keys.
    lse: [..., P] float32 log-sum-exp of each split's scaled scores (-inf: empty).
    out_dtype: dtype of the merged output.
  Returns:
    (out [..., Hv] out_dtype, lse [...] float32); rows with no key give 0 and -inf.
  """
  if o.shape[-2] == 1:
    return o[..., 0, :].astype(out_dtype), lse[..., 0]
  w, denom, total = split_weights(lse, axis=-1)
  # Elementwise product + sum, not einsum: an f32 dot may run as TF32 on GPU.
  out = jnp.sum(w[..., None] * o, axis=-2) / jnp.expand_dims(denom, -1)
  return out.astype(out_dtype), total


def split_weights(lse, axis: int = -1):
  """The combine's weights over the splits along `axis` of lse (float32, -inf: empty):
  (w = exp(lse_s - max) (0 for empty splits, same shape as lse), denom = sum_s w_s (1 where
  every split is empty), total = the merged LSE (-inf there)); out = sum_s w_s o_s / denom."""
  m = jnp.max(lse, axis=axis, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe), 0.0)
  denom = jnp.sum(w, axis=axis)
  has = denom > 0
  denom = jnp.where(has, denom, 1.0)
  total = jnp.where(has, jnp.squeeze(m_safe, axis) + jnp.log(denom), -jnp.inf)
  return w, denom, total
