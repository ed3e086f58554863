"""Running a forward call over its batch a slice of rows at a time.

A cache may bound how many rows one pass runs on it (`KVCache.rows_per_pass`). XQuant-CL is
the case: its step rebuilds the fp32 accumulator X̂ [rows, S, D] for every slot at every
layer (16 KiB per token and row at the Llama-3-8B shape, 4× a layer of its dense K/V). Run
over the whole batch, that one temporary, not the codes, sets its largest batch. `forward`
then calls `run`: one `lax.scan` over slices of `rows` rows (and one more call for a
remainder). Each pass takes its rows of every cache array (the batch axis each cache
declares in `shard_axes`), runs the layers on them and writes them back in place. Arrays
without a batch axis (weights a cache keeps, e.g. XQuant's U) are passed whole.

Cost: the model's weights are read once per pass, and each pass copies its rows' cache arrays
in and out. For XQuant-CL that is small beside the work of a row: a weight read is the weights'
bytes at the HBM bandwidth (Llama-3-8B: ~16 GB of bf16, ~3.3 ms at the H200's 4.8 TB/s), while
each row rematerialises K/V of all its slots from X̂ at every layer (latent path: about
8·D·kv_dim FLOPs per token and layer, ~35 TFLOP per row and step at 32K, >= 35 ms even at the
H200's ~990 TFLOP/s bf16 peak). Measured step times with and without passes:
results/decode_ablations.md, "BENCHMARKS.md notes" (XQuant-CL-2). Rows never mix in a forward
call, so the logits and caches are the whole batch's up to the floating-point order of the
row-blocked products (`tests/test_row_slices.py`).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kvlowrank.cache import base as cache_base


def rows_per_pass(caches) -> Optional[int]:
  """The fewest rows any cache of `caches` allows in one pass (None: no bound)."""
  if not caches:
    return None
  bounds = [r for r in (c.rows_per_pass() for c in caches) if r is not None]
  return min(bounds) if bounds else None


def plan(batch: int, rows: int) -> tuple[int, int, int]:
  """(rows per scanned pass, scanned passes, remainder rows): the fewest passes of at most
  `rows` rows, their sizes as equal as one scan and one remainder call allow."""
  if rows < 1:
    raise ValueError(f"rows_per_pass must be >= 1, got {rows}")
  passes = -(-batch // rows)
  size = -(-batch // passes)
  return size, batch // size, batch % size


def _batch_axes(caches) -> list[list]:
  """Per cache, the batch axis of each array leaf in flatten order (None: no batch axis)."""
  return [[b for _, _, (b, _) in cache_base.leaf_axes(c)[0]] for c in caches]


def _rows_of(caches, axes, start, size):
  out = []
  for c, ax in zip(caches, axes):
    leaves, treedef = jax.tree_util.tree_flatten(c)
    out.append(jax.tree_util.tree_unflatten(treedef, [
        leaf if b is None else jax.lax.dynamic_slice_in_dim(leaf, start, size, axis=b)
        for leaf, b in zip(leaves, ax)]))
  return tuple(out)


def _put_rows(caches, axes, sub, start):
  out = []
  for c, ax, s in zip(caches, axes, sub):
    leaves, treedef = jax.tree_util.tree_flatten(c)
    out.append(jax.tree_util.tree_unflatten(treedef, [
        leaf if b is None else jax.lax.dynamic_update_slice_in_dim(leaf, n.astype(leaf.dtype),
                                                                  start, axis=b)
        for leaf, b, n in zip(leaves, ax, jax.tree_util.tree_leaves(s))]))
  return tuple(out)


def _merge(y, axis):
  """[passes, ..., size at `axis` + 1, ...] -> [..., passes * size at `axis`, ...]."""
  y = jnp.moveaxis(y, 0, axis)
  return y.reshape(y.shape[:axis] + (-1,) + y.shape[axis + 2:])


def run(call: Callable, rows: int, batch_args: tuple, caches: tuple, out_axes: tuple):
  """`call(*batch_args, caches) -> (outputs..., caches)` over `rows` rows at a time.

  Args:
    call: one forward pass over a slice: its batch arguments' rows and the caches' rows.
    rows: the most rows one pass may run.
    batch_args: arrays with the batch on axis 0 (tokens, positions, ...), or None.
    caches: the model-level cache (tuple of per-layer caches).
    out_axes: the batch axis of each output but the caches (None: the output is absent).
  Returns:
    (outputs..., caches): the outputs assembled over the whole batch.
  """
  batch = next(a.shape[0] for a in batch_args if a is not None)
  size, full, rem = plan(batch, rows)
  axes = _batch_axes(caches)

  def one(caches, start, n):
    args = [None if a is None else jax.lax.dynamic_slice_in_dim(a, start, n, axis=0)
            for a in batch_args]
    *outs, sub = call(*args, _rows_of(caches, axes, start, n))
    return _put_rows(caches, axes, sub, start), tuple(outs)

  parts = []
  if full:
    caches, ys = jax.lax.scan(lambda c, i: one(c, i * size, size), caches,
                              jnp.arange(full, dtype=jnp.int32))
    parts.append(tuple(None if y is None else _merge(y, a) for y, a in zip(ys, out_axes)))
  if rem:
    caches, ys = one(caches, full * size, rem)
    parts.append(ys)
  outs = tuple(None if a is None else jnp.concatenate([p[i] for p in parts], axis=a)
               for i, a in enumerate(out_axes))
  return (*outs, caches)
