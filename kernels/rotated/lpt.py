"""LPT (longest processing time first) scheduling of the ragged decode kernel's chunks.

FDC §5.3 / ZACK §5.2: decode work is one task per (request, KV head) of cost
~ s_kv * (k_h + v_h); sort the tasks longest first and give each in turn to the SM with the
smallest load so far. Graham's bound: the LPT makespan is at most (4/3 - 1/(3m)) of the optimum
on m machines. `lpt_assign` is that textbook greedy.

The kernel (`triton_ragged`) keeps the idea in its dispatch form. Greedy LPT gives the next
longest task to the least-loaded machine; when the estimates are the run times, the
least-loaded machine is the one that frees up first. So the kernel's 1-D grid is the chunk
list in LPT order (computed under jit from the lengths and the static widths), and the GPU's
block scheduler, which starts blocks in block-index order on whichever SM slot frees up
first, performs the greedy step with real run times. `dispatch` simulates that rule; the
tests check that it equals `lpt_assign` on the same order.
Why not a persistent kernel with per-program task lists: the greedy step is sequential (an
argmin over the machines per task); for ~10^3 chunks it costs as much as the attention
itself, as an XLA while loop or a one-program Triton kernel. The dispatch form costs one
small sort (`descending`: counting ranks, no XLA sort kernel).

The kernel's tasks are (request, KV head group) (`triton_plan`: heads packed into the MMA's
16 query rows), of cost ~ s_kv * sum over the group of (k_h + v_h), each cut into chunks
along the sequence (one chunk size for all groups).

Orders (`order`; the kernel's `schedule` knob):
  "lpt"    every chunk by its own cost, valid tokens x group width, longest first;
  "rows"   (the default) LPT over row tasks (b, c), cost = the sum of their groups' chunk
           costs, each row task's group chunks in consecutive programs (widest group first):
           with one chunk size, co-running programs read neighbouring slices of the same cache
           rows (the packed layout puts every head of a token in one row). On the H200 it
           matched or beat "lpt" (results/rotated_kernel.md);
  "static" chunk-id order (b, c, group), no sort (an ablation).
"""

from __future__ import annotations

import heapq

import jax.numpy as jnp
import numpy as np

SCHEDULES = ("lpt", "rows", "static")


def lpt_assign(costs, machines: int):
  """Textbook LPT: tasks longest first (ties: lower index first), each to the machine with the
  smallest load (ties: lower machine index).

  Args:
    costs: [n] task costs (>= 0).
    machines: m >= 1.
  Returns:
    (assign [n] int machine of each task, loads [m] float64).
  """
  if machines < 1:
    raise ValueError(f"lpt_assign: machines must be >= 1, got {machines}")
  costs = np.asarray(costs, np.float64)
  assign = np.zeros(costs.shape[0], np.int64)
  loads = np.zeros(machines, np.float64)
  for t in np.argsort(-costs, kind="stable"):
    j = int(np.argmin(loads))
    assign[t] = j
    loads[j] += costs[t]
  return assign, loads


def dispatch(costs_in_order, slots: int):
  """Which slot runs each task when tasks start in the given order, each on the first slot to
  free up (ties: lower slot index): the GPU block scheduler's rule with the estimates as run
  times. Returns (slot [n] int, finish time of each slot [slots])."""
  heap = [(0.0, j) for j in range(slots)]
  slot = np.zeros(len(costs_in_order), np.int64)
  for i, c in enumerate(costs_in_order):
    free, j = heapq.heappop(heap)
    slot[i] = j
    heapq.heappush(heap, (free + float(c), j))
  finish = np.zeros(slots)
  for free, j in heap:
    finish[j] = free
  return slot, finish


# Up to this many keys `descending` ranks by counting (two small [N, N] XLA fusions) instead of
# XLA's sort kernel, which was slower for the few hundred row tasks of a decode step
# (results/rotated_kernel.md, "Compact partials, counting-rank order"); beyond, argsort.
COUNT_SORT_MAX = 2048


def descending(keys):
  """int32 [N]: the stable descending order of keys [N] (jnp, traceable), i.e. numpy's
  argsort(-keys, kind="stable"). Rank i = #{j: key_j > key_i} + #{j < i: key_j == key_i};
  order[r] = the i of rank r."""
  n = keys.shape[0]
  if n > COUNT_SORT_MAX:
    return jnp.argsort(-keys, stable=True).astype(jnp.int32)
  i = jnp.arange(n, dtype=jnp.int32)
  before = (keys[None, :] > keys[:, None]) | ((keys[None, :] == keys[:, None])
                                              & (i[None, :] < i[:, None]))
  rank = jnp.sum(before, axis=1, dtype=jnp.int32)
  return jnp.sum(jnp.where(rank[None, :] == i[:, None], i[None, :], 0), axis=1, dtype=jnp.int32)


def valid_tokens(lengths, n_chunks: int, chunk_tokens):
  """int32 [B, n_chunks, NG]: slots of chunk c of each (row, head group) below the row's length
  (jnp, traceable); chunk_tokens: static [NG] chunk sizes. Chunks past the capacity (groups
  with larger chunks have fewer) get 0."""
  ct = jnp.asarray(np.asarray(chunk_tokens, np.int32))[None, None, :]
  start = jnp.arange(n_chunks, dtype=jnp.int32)[None, :, None] * ct
  return jnp.clip(lengths.astype(jnp.int32)[:, None, None] - start, 0, ct)


def order(schedule: str, lengths, n_chunks: int, chunk_tokens, widths):
  """int32 [B * n_chunks * NG]: the chunk ids ((b * n_chunks + c) * NG + group) in launch order.

  Args:
    schedule: one of SCHEDULES (module docstring).
    lengths: [B] int (traced); chunk_tokens, widths: static [NG] ints (chunk size and
      elements read per token of each head group).
  Sorts are stable: equal costs keep the static order.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"ragged_attention: schedule must be one of {SCHEDULES}, got {schedule!r}")
  widths = np.asarray(widths, np.int32)
  ng = widths.shape[0]
  cost = valid_tokens(lengths, n_chunks, chunk_tokens) * jnp.asarray(widths)   # [B, NC, NG]
  total = cost.size
  if schedule == "static":
    return jnp.arange(total, dtype=jnp.int32)
  if schedule == "lpt":
    return descending(cost.reshape(-1))
  rows = descending(jnp.sum(cost, axis=-1).reshape(-1))
  grps = np.argsort(-widths, kind="stable").astype(np.int32)
  return (rows[:, None] * ng + jnp.asarray(grps)[None, :]).reshape(-1)
