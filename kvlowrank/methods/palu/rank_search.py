"""Rank allocation for Palu: uniform or Fisher-proportional [Palu §3.3, App. F.3].

A *target* is one (layer, K|V) projection. Every group of a target gets the same
rank (the paper's default "equal rank per group"; official `fisher_uniform`).

Procedure (official `rank_search.py`, with two deliberate deviations noted):
1. budget = (1 − target_ratio) · Σ_targets full_dim, full_dim = n_groups · group_dim.
2. Continuous ranks ∝ score (Fisher) or equal (uniform), capped at full_dim. The
   official code caps and hands out the leftover one unit at a time in *ascending*
   fractional order; we water-fill instead (redistribute what capped targets cannot
   take, proportionally to score), which is the exact proportional rule the paper
   states.
3. Per-group rank = continuous / n_groups rounded to a multiple of `multiple`
   (min one multiple, max the group's full rank).
4. Deviation: the official code stops after rounding ("final compression only
   approximately equals the target"). We then move single steps (± multiple on one
   target) greedily, largest rounding residual first, while that brings the total
   closer to the budget, so fisher and uniform land on (nearly) the same bytes and
   comparisons between them are at equal cache size. The achieved ratio is reported
   exactly by `PaluLayout.compression_ratio`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def _water_fill(weights: np.ndarray, caps: np.ndarray, budget: float) -> np.ndarray:
  """x ∝ weights with x <= caps and Σx = min(budget, Σcaps)."""
  x = np.zeros_like(caps, dtype=np.float64)
  free = np.ones(len(caps), bool)
  remaining = min(float(budget), float(caps.sum()))
  while remaining > 1e-9 and free.any():
    w = weights * free
    if w.sum() <= 0:  # zero scores left: split evenly
      w = free.astype(np.float64)
    share = remaining * w / w.sum()
    over = free & (x + share >= caps)
    if not over.any():
      x = x + share
      break
    remaining -= float((caps[over] - x[over]).sum())
    x[over] = caps[over]
    free &= ~over
  return x


def allocate_ranks(n_layers: int, n_groups: int, group_dim: int, full_rank: int, *,
                   target_ratio: float, multiple: int,
                   scores: Optional[np.ndarray] = None):
  """Per-layer group ranks for keys and values.

  Args:
    n_layers: L.
    n_groups: groups per projection.
    group_dim: output width of one group (gs·head_dim); the dense cost per group.
    full_rank: max useful rank per group, min(D, group_dim).
    target_ratio: fraction of the KV hidden dimension to remove (0 = full rank).
    multiple: rank granularity.
    scores: [L, 2] non-negative importance (Fisher) or None for uniform.
  Returns:
    (ranks_k, ranks_v) tuples of L ints.
  Raises:
    ValueError: bad shapes, negative scores, or a target that cannot be met with
      ranks >= one multiple.
  """
  if scores is not None:
    scores = np.asarray(scores, np.float64)
    if scores.shape != (n_layers, 2):
      raise ValueError(f"rank search: scores must be [{n_layers}, 2], got {scores.shape}")
    if not np.all(np.isfinite(scores)) or np.any(scores < 0):
      raise ValueError("rank search: Fisher scores must be finite and non-negative")
  if target_ratio == 0.0:
    r = (full_rank,) * n_layers
    return r, r
  lo = min(multiple, full_rank)
  flat_scores = np.ones(2 * n_layers) if scores is None else scores.reshape(-1)
  dense_total = 2 * n_layers * n_groups * group_dim
  budget = (1.0 - target_ratio) * dense_total
  if budget < 2 * n_layers * n_groups * lo - 1e-9:
    raise ValueError(f"PaluSpec.target_ratio={target_ratio} with rank_multiple={multiple} "
                     f"is infeasible: it leaves {budget:.0f} latent dims, fewer than the "
                     f"minimum rank {lo} (rank_multiple capped at the group rank "
                     f"{full_rank}) allows ({2 * n_layers * n_groups * lo}); lower "
                     "rank_multiple or target_ratio")
  caps = np.full(2 * n_layers, float(n_groups * full_rank))
  cont = _water_fill(flat_scores, caps, budget) / n_groups  # continuous group ranks
  ranks = np.clip(np.round(cont / multiple) * multiple, lo, full_rank).astype(np.int64)

  # Step 4: greedy single-step corrections towards the exact budget.
  def total(r):
    return float(n_groups * r.sum())

  for _ in range(4 * len(ranks) * max(1, full_rank // multiple)):
    deficit = budget - total(ranks)
    resid = cont - ranks
    if deficit > 0:
      room = ranks < full_rank
      if not room.any():
        break
      i = int(np.argmax(np.where(room, resid, -np.inf)))
      new = min(int(ranks[i]) + multiple, full_rank)
    else:
      room = ranks > lo
      if not room.any():
        break
      i = int(np.argmin(np.where(room, resid, np.inf)))
      new = max(int(ranks[i]) - multiple, lo)
    step = n_groups * (new - int(ranks[i]))
    if abs(deficit - step) >= abs(deficit):
      break
    ranks[i] = new
  ranks = ranks.reshape(n_layers, 2)
  return tuple(int(x) for x in ranks[:, 0]), tuple(int(x) for x in ranks[:, 1])
