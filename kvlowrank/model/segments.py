"""Cached forward over a schedule of token segments, as one jittable function.

`forward_segments(params, tokens, positions, caches, spec, segments)` returns what
feeding the segments to the cache one `forward` call at a time returns::

    for s, e in segments:
      logits[:, s:e], caches = forward(params, tokens[:, s:e], positions[:, s:e], caches,
                                       spec)

e.g. perplexity in decode mode (kvlowrank.eval.perplexity): a prompt prefilled in
chunks, then one token per call. Runs of equal-length segments go through `lax.scan`
(one compiled body, no per-call dispatch). Two schedules of the work:

* Layer-major (per-layer caches, the protocol's own `step`): only attention mixes
  tokens, and a cached attention sees earlier tokens through the cache alone, so the
  work can be reordered without changing what any cache call sees. Layer by layer, the
  norms, projections, RoPE and MLP run once over all tokens (matrix-matrix products
  that stream each weight once instead of once per call: a decode step of a small
  model is bound by reading its weights), and only the cache calls (`step` = update
  then attend) run segment by segment, in schedule order; a one-token call as
  `forward`'s decode step makes it (the previous decode call's deferred work first,
  `KVCache.deferring`). With `scan_layers`, a
  homogeneous stack (every layer's params and cache of one pytree structure, shapes
  and dtypes) also scans over layers: one compiled layer body instead of n_layers
  unrolled copies, which is most of the compile time of a 30-layer model.
  Heterogeneous stacks (Palu's per-layer ranks) unroll the layers.
* Token-major (cross-layer caches that override `step`, e.g. XQuant-CL): the carry
  handed from layer i to layer i+1 within a call can be as large as the cache
  (XQuant-CL's accumulated X̂ [B, S, D]), so keeping one per segment between layers
  is not an option; each segment runs the whole `forward` (inside the scan).

Results equal the call-by-call loop up to fp32 round-off (matmuls over more rows may
block their reductions differently; quantizing caches can turn such round-off into a
different code at a rounding boundary).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from kvlowrank.cache.base import (KVCache, begin_decode_step, concrete, end_decode_step,
                                  poison_rows)
from kvlowrank.model.transformer import check_context, decoder_layer, forward, lm_head
from kvlowrank.spec import ModelSpec


def segment_runs(segments: Sequence[tuple[int, int]], n_tokens: int
                 ) -> tuple[tuple[int, int, int], ...]:
  """Groups a schedule into runs of consecutive equal-length segments.

  Args:
    segments: (start, end) pairs that tile [0, n_tokens) in order.
    n_tokens: T.
  Returns:
    ((start, length, count), ...): `count` segments of `length` tokens from `start`.
  Raises:
    ValueError when the segments do not tile [0, n_tokens) in order.
  """
  runs: list[list[int]] = []
  pos = 0
  for s, e in segments:
    s, e = int(s), int(e)
    if s != pos or e <= s:
      raise ValueError(f"segments must tile [0, {n_tokens}) in order with non-empty "
                       f"segments; got {tuple(segments)!r}")
    if runs and runs[-1][1] == e - s:
      runs[-1][2] += 1
    else:
      runs.append([s, e - s, 1])
    pos = e
  if pos != n_tokens:
    raise ValueError(f"segments cover [0, {pos}) but there are {n_tokens} tokens")
  return tuple(tuple(r) for r in runs)


def _split(a, start, length, count):
  """[B, T, ...] → [count, B, length, ...] for the run's tokens."""
  a = a[:, start:start + length * count]
  a = a.reshape(a.shape[0], count, length, *a.shape[2:])
  return jnp.moveaxis(a, 1, 0)


def _merge(a):
  """[count, B, length, ...] → [B, count * length, ...]."""
  a = jnp.moveaxis(a, 0, 1)
  return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _cache_call(cache: KVCache, inputs, q, lp, spec, length: int):
  """One segment's cache call as `forward` makes it: a one-token (decode) call first does
  the work the previous decode step deferred, then runs with deferring on
  (`cache.base.begin_decode_step` / `end_decode_step`: GEAR's chunk compression waits for the
  next decode call); longer calls run as they are."""
  decode = length == 1
  if decode:
    (cache,) = begin_decode_step((cache,))
  out, _, cache, _ = cache.step(inputs, q, lp, None, spec=spec)
  return out, (end_decode_step((cache,))[0] if decode else cache)


def _segmentwise_step(runs):
  """A `step` for kvlowrank.model.transformer.attention_block that feeds a per-layer
  cache the segments of `runs` in order (layer-major; no cross-layer carry)."""

  def step(cache, inputs, q, lp, carry, spec):
    del carry  # per-layer caches: always None
    outs = []
    for start, length, count in runs:
      if count == 1:
        sl = lambda a, s=start, e=start + length: a[:, s:e]
        out, cache = _cache_call(cache, jax.tree.map(sl, inputs), sl(q), lp, spec, length)
        outs.append(out)
      else:
        split = lambda a, s=start, n=length, c=count: _split(a, s, n, c)

        def body(c, xs, n=length):
          out, c = _cache_call(c, xs[0], xs[1], lp, spec, n)
          return c, out

        cache, out = jax.lax.scan(body, cache, (jax.tree.map(split, inputs), split(q)))
        outs.append(_merge(out))
    return jnp.concatenate(outs, axis=1), cache, None

  return step


def _token_major(params, tokens, positions, caches, spec, runs, allow):
  """Segment by segment, each through the whole `forward` (cross-layer caches)."""
  outs = []
  for start, length, count in runs:
    if count == 1:
      e = start + length
      logits, caches = forward(params, tokens[:, start:e], positions[:, start:e], caches,
                               spec, allow_beyond_max_seq_len=allow)
    else:
      def body(c, xs):
        logits, c = forward(params, xs[0], xs[1], c, spec, allow_beyond_max_seq_len=allow)
        return c, logits

      split = lambda a, s=start, n=length, c=count: _split(a, s, n, c)
      caches, logits = jax.lax.scan(body, caches, (split(tokens), split(positions)))
      logits = _merge(logits)
    outs.append(logits)
  return jnp.concatenate(outs, axis=1), caches


def per_layer(caches: Sequence[KVCache]) -> bool:
  """True when every cache uses the protocol's per-layer `step` (no cross-layer carry):
  the layer-major schedule applies."""
  return all(type(c).step is KVCache.step for c in caches)


def _signature(tree):
  return (jax.tree.structure(tree),
          tuple((x.shape, jnp.result_type(x)) for x in jax.tree.leaves(tree)))


def homogeneous(layers: Sequence[dict], caches: Sequence[KVCache]) -> bool:
  """True when layers and caches can be stacked along a leading layer axis and scanned:
  equal pytree structures (static cache fields included), shapes and dtypes, and caches
  that use the protocol's per-layer `step` (no cross-layer carry)."""
  if len(layers) != len(caches) or not layers or not per_layer(caches):
    return False
  p0, c0 = _signature(layers[0]), _signature(caches[0])
  return all(_signature(lp) == p0 for lp in layers) and all(
      _signature(c) == c0 for c in caches)


def forward_segments(params, tokens, positions, caches: tuple, spec: ModelSpec,
                     segments: Sequence[tuple[int, int]], *, scan_layers: bool = True,
                     allow_beyond_max_seq_len: bool = False) -> tuple[jax.Array, tuple]:
  """The call-by-call cached forward over `segments` (module docstring).

  Args:
    params: parameter pytree (kvlowrank.model.params layout; `layers` a list).
    tokens: [B, T] int32.
    positions: [B, T] int32 (< 0: padding).
    caches: tuple of per-layer caches (kvlowrank.cache.base), as `forward` takes.
    spec: static ModelSpec.
    segments: static (start, end) pairs tiling [0, T) in order: the token ranges of the
      successive forward calls.
    scan_layers: layer-major schedule: scan over layers when
      `homogeneous(params["layers"], caches)`.
    allow_beyond_max_seq_len: as `forward`'s (positions past spec.max_seq_len).
  Returns:
    (logits [B, T, V] fp32, caches after the last segment); as `forward`, rows with a
    traced position beyond the capacity (or max_seq_len) get NaN logits.
  Raises:
    ValueError: as `forward` (`check_context`), or segments that do not tile [0, T).
  """
  if caches is None:
    raise ValueError("forward_segments needs caches (segments only exist through a cache)")
  limit = check_context(positions, caches, spec,
                        allow_beyond_max_seq_len=allow_beyond_max_seq_len)
  runs = segment_runs(segments, tokens.shape[1])
  if not per_layer(caches):
    return _token_major(params, tokens, positions, caches, spec, runs,
                        allow_beyond_max_seq_len)
  step = _segmentwise_step(runs)
  layers = params["layers"]
  x = params["embed"][tokens]
  if scan_layers and homogeneous(layers, caches):
    stack = lambda *xs: jnp.stack(xs)

    def body(x, layer):
      lp, cache = layer
      x, _, cache, _ = decoder_layer(lp, x, positions, cache, None, spec, step=step)
      return x, cache

    x, stacked = jax.lax.scan(body, x, (jax.tree.map(stack, *layers),
                                        jax.tree.map(stack, *caches)))
    new_caches = tuple(jax.tree.map(lambda a, i=i: a[i], stacked)
                       for i in range(len(layers)))
  else:
    new_caches = []
    for lp, cache in zip(layers, caches):
      x, _, cache, _ = decoder_layer(lp, x, positions, cache, None, spec, step=step)
      new_caches.append(cache)
    new_caches = tuple(new_caches)
  logits = lm_head(params, x, spec)
  if limit is not None and concrete(positions) is None:
    logits = poison_rows(logits, positions, limit)
  return logits, new_caches
