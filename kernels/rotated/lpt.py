"""LPT (longest processing time first) scheduling of the ragged decode kernel's chunks.

FDC §5.3 / ZACK §5.2: decode work is one task per (request, KV head) of cost
~ s_kv * (k_h + v_h); sort the tasks longest first and give each in turn to the SM with the
smallest load so far. Graham's bound: the LPT makespan is at most (4/3 - 1/(3m)) of the optimum
on m machines.

The kernel (`triton_ragged`) keeps that idea in its dispatch form. Greedy LPT gives the next
longest task to the least-loaded machine; when the estimates are the run times, the
least-loaded machine is the one that frees up first. So the kernel's grid is the chunk list
sorted longest first (`chunk_order`, computed under jit from the lengths and the static
widths), and the GPU's block scheduler, which starts blocks in block-index order on whichever
SM slot frees up first, is the greedy step. `dispatch` simulates that rule; the tests check that
it equals `lpt_assign` (the textbook greedy), and check LPT against brute-force optima.
Why not a persistent kernel with per-program task lists: the greedy step is sequential (one
argmin over the machines per task); with ~10^3 chunks it costs milliseconds as an XLA while
loop and tens of microseconds in a one-program Triton kernel, the same order as the attention
itself (~60-300 us here). Dispatch order costs one sort, and it uses real run times rather
than estimates.
"""

from __future__ import annotations

import heapq

import jax.numpy as jnp
import numpy as np


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


def chunk_costs(lengths, chunk_b, chunk_start, chunk_tokens, chunk_width):
  """Estimated cost of each chunk (jnp, traceable): the valid tokens it reads times the bytes
  per token of its head (k_h + v_h elements).

  Args:
    lengths: [B] int32 (traced).
    chunk_b, chunk_start, chunk_tokens, chunk_width: [T] static int arrays: the chunk's
      batch row, first slot, slot count and k_h + v_h.
  """
  valid = jnp.clip(lengths[chunk_b] - chunk_start, 0, chunk_tokens)
  return valid * chunk_width


def chunk_order(lengths, chunk_b, chunk_start, chunk_tokens, chunk_width):
  """int32 [T]: the chunks longest first (`chunk_costs`; stable, so equal costs keep the
  static head-major order): the kernel's program i runs chunk order[i]."""
  cost = chunk_costs(lengths, chunk_b, chunk_start, chunk_tokens, chunk_width)
  return jnp.argsort(-cost, stable=True).astype(jnp.int32)
