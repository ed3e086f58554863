"""Token eviction around another cache: SnapKV-style selection into a smaller inner cache.

Inner caches: dense, KIVI, GEAR, Palu, XQuant, FDC/ZACK (`check_inner`). Refused: XQuant-CL
(its cross-layer accumulator adds each layer's delta to the previous layer's row of the
same slot, so every layer must hold the same tokens, while eviction selects per layer).

Policy choice (issue 22 item 5). H2O ranks tokens by attention accumulated over every
decode step; our inner caches' decode kernels return (out, lse), not per-key
probabilities, and an append-only inner cache (slot s = the s-th stored token; KIVI
quantizes keys in blocks of consecutive slots) cannot drop a token once written. So the
wrapper uses SnapKV (Li et al. 2024, FasterDecoding/SnapKV `SnapKVCluster.update_kv`): a
token's fate is decided ONCE, when it is pushed out of the recent window, from the
attention it receives from the last `observe` queries of that call; kept tokens are then
written into the inner cache with their original post-RoPE keys, and never touched again.
For a prompt prefilled in one call on an empty cache this is exactly SnapKV: the last
`window` prompt tokens are kept, and of the others the budget - window with the highest
average-pooled observation-window attention.

Layout, per layer (B rows, W = window, C = budget - W):
  * inner: the wrapped method's own cache with capacity C (`init_caches` of `inner`).
    Inner slot j holds the j-th admitted token of the row (compact addressing); pos_map
    [B, C] records its original position (sorted, since tokens are admitted in order).
  * the window ring: the last W tokens not (yet) admitted, in position order: ring_k,
    ring_v [B, W, K, H] at the cache dtype, ring_pos [B, W] (-1 = empty), plus ring_x
    [B, W, D] and ring_kpre when the inner cache reads them (Palu, XQuant: latents of x;
    held at the cache dtype, so such a cache sees x rounded once more than without the
    wrapper when a token reaches it through the window).
  * lens [B]: one past the highest original position seen.
Every call: the candidates are the ring followed by the new tokens; `select.admit` decides
(admit everything while it fits, else keep the last W in the ring, admit the best `room`
of the rest by SnapKV score, evict the others); admitted tokens go to inner.update at
compact slots n_in, n_in + 1, ... (their original keys, values, x); the ring is rebuilt.
Stored tokens never exceed budget: C in the inner cache + W in the ring. The budget is a
hard cap for generation too: once the inner cache is full, the token leaving the window at
each decode step is evicted (StreamingLLM-like behaviour past the budget, with SnapKV's
selected prompt tokens in place of attention sinks).

Attention: the inner cache with queries at their compact positions c(p) = #{inner tokens
at positions <= p} - 1 (so the inner's causal mask `slot <= c` is the original
`position <= p`), merged by log-sum-exp (`model.attention.combine`) with attention over
the tokens not in the inner cache:
  * ring="exact" (auto for dense, KIVI and GEAR, whose attention is softmax(q K^T) V over
    the stored post-RoPE K, V -- GEAR's D^ + S + L, factored): exact attention over every
    candidate of the call that was not admitted, i.e. the window AND the tokens this call
    evicts. `step` is overridden for
    this (update, then attend with the call's candidates): eviction takes effect after the
    call, so a prompt's queries see the whole prompt as in SnapKV's prefill, and the
    deeper layers' keys and values of the prompt are computed from full attention.
    (A cache with its own `step` runs the token-major schedule of
    `model.segments`: slower on CPU, same results.)
  * ring="inner" (auto for every other cache: Palu/FDC/ZACK outputs are value LATENTS
    folded into W_o, XQuant stores x): the window goes through a scratch copy of the inner
    cache (capacity W, rebuilt from the ring's inputs each call), so both segments come
    out in the inner cache's value space. The scratch holds W tokens, so here the tokens a
    call evicts are not seen by that call's own queries (a departure from SnapKV's prefill
    for these caches; a scratch of capacity W + T would need a per-cache constructor).
Caches that re-apply RoPE at slot positions (Palu, XQuant: pre-RoPE latents / x) see their
keys at compact positions; their queries are re-rotated from p to the compact position
(RoPE(c - p) composed with RoPE(p) = RoPE(c)), i.e. StreamingLLM's "positions within the
cache". Post-RoPE caches (dense, KIVI, rotated K' = RoPE(K) R) keep the original relative
positions exactly.

Choices and departures (deliberate):
  * GQA: ONE selection per layer shared by all KV heads (scores summed over every query
    head). SnapKV selects per head; a per-KV-head selection would put different tokens in
    one inner slot, which caches storing per-token data shared by heads (XQuant's x, Palu's
    group latents, KIVI's one length per row) cannot hold. Shared selection composes with
    every cache.
  * The softmax of the scores is over the candidates (ring + new tokens), not over tokens
    already in the inner cache; on an empty cache (SnapKV's prefill) that is the same.
  * Tokens admitted to the inner cache are seen through it (quantized for KIVI) by the
    call's own queries too, as KIVI's prefill attends its quantized cache here.
  * When nothing is evicted (the budget covers the sequence) the wrapper is transparent:
    the inner cache sees the same tokens at the same positions and its output is returned
    unchanged.
  * Models with sliding-window attention and cross-layer caches (XQuant-CL, above) are
    refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from kvlowrank.cache import base
from kvlowrank.methods.evict import select
from kvlowrank.methods.evict.spec import EvictSpec
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank.model.rope import apply_rope
from kvlowrank.spec import ModelSpec

# Inner caches whose attention is softmax(q K^T) V over the stored post-RoPE K and V at the
# head width (ring="exact" applies; they read only inputs.k and inputs.v).
KV_INNER = ("dense", "kivi", "gear")
# Inner caches that store post-RoPE keys (relative positions kept exactly).
POST_ROPE_INNER = KV_INNER + ("fdc", "zack", "rotated")
# Inner caches that re-apply RoPE at their slot positions (queries re-rotated).
PRE_ROPE_INNER = ("palu", "xquant")
EMPTY = jnp.iinfo(jnp.int32).max   # pos_map of an unused inner slot


def check_inner(inner: str, ring: str) -> str:
  """The ring mode for `inner` ("exact" | "inner"); ValueError naming the field."""
  if inner not in POST_ROPE_INNER + PRE_ROPE_INNER:
    raise ValueError(f"EvictSpec.inner={inner!r} is not supported: eviction needs to know "
                     f"how the cache applies RoPE; supported: "
                     f"{', '.join(POST_ROPE_INNER + PRE_ROPE_INNER)}")
  if ring == "exact" and inner not in KV_INNER:
    raise ValueError(f"EvictSpec.ring='exact' needs an inner cache that attends over stored "
                     f"K and V ({', '.join(KV_INNER)}), not {inner!r}: use 'inner'")
  if ring == "auto":
    return "exact" if inner in KV_INNER else "inner"
  return ring


_rows = base.gather_rows


def _compact_positions(slot_pos, valid, q_pos):
  """[B, T]: #{slots with position <= q_pos} - 1 (-1 for padding queries)."""
  c = jnp.sum(valid[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, :, None]), axis=-1) - 1
  return jnp.where(q_pos >= 0, c, -1).astype(jnp.int32)



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EvictCache(base.KVCache):
  inner: Any                 # the wrapped method's per-layer cache (capacity C)
  scratch: Any               # empty inner cache of capacity W (ring="inner"), else None
  ring_k: jax.Array          # [B, W, K, H] keys (post-RoPE) of the window, position order
  ring_v: jax.Array          # [B, W, K, H]
  ring_x: Any                # [B, W, D] or None (only caches that read x / k_pre)
  ring_kpre: Any             # [B, W, K, H] or None
  ring_pos: jax.Array        # [B, W] int32, -1 = empty
  pos_map: jax.Array         # [B, C] int32 original position of inner slot j (EMPTY)
  lens: jax.Array            # [B] int32
  model: ModelSpec = base.static_field(default=None)
  max_len: int = base.static_field(default=0)
  limit: int = base.static_field(default=0)
  window: int = base.static_field(default=0)
  observe: int = base.static_field(default=1)
  pool: int = base.static_field(default=1)
  ring: str = base.static_field(default="exact")
  reindex: bool = base.static_field(default=False)

  name = "evict"

  @property
  def capacity(self) -> int:
    return self.max_len

  @property
  def lengths(self):
    return self.lens

  # A decode step's deferred work (`base.KVCache.deferring`) is the inner cache's.
  def deferring(self, on: bool) -> "EvictCache":
    return dataclasses.replace(self, inner=self.inner.deferring(on))

  def pending(self):
    return self.inner.pending()

  def settle(self) -> "EvictCache":
    return dataclasses.replace(self, inner=self.inner.settle())

  def choose_implementation(self, q_shape, implementation=None, platform=None):
    """The inner cache's choice: `attend` hands the request to the inner cache, whose
    decode kernel runs on its arrays; the window (at most W tokens) is attended by the jnp
    reference, or by the scratch inner cache (ring="inner")."""
    return self.inner.choose_implementation(q_shape, implementation, platform)

  def _candidates(self, inputs: base.AttnInputs, pos):
    """AttnInputs of the candidates E = ring then new tokens (positions original)."""
    def cat(ring, new):
      if ring is None:
        ring = jnp.zeros((new.shape[0], self.window) + new.shape[2:], new.dtype)
      return jnp.concatenate([ring.astype(new.dtype), new], axis=1)
    return base.AttnInputs(x=cat(self.ring_x, inputs.x), k=cat(self.ring_k, inputs.k),
                           k_pre=cat(self.ring_kpre, inputs.k_pre),
                           v=cat(self.ring_v, inputs.v),
                           positions=jnp.concatenate([self.ring_pos, pos], axis=1))

  def _observation_queries(self, x, pos, lp):
    """Post-RoPE queries [B, O, N, H] and positions [B, O] of each row's last O tokens."""
    spec = self.model
    o = min(self.observe, pos.shape[1])
    p_obs, idx = jax.lax.top_k(pos, o)
    xo = _rows(x, idx)
    q = xo @ lp["wq"]
    if spec.qkv_bias:
      q = q + lp["bq"]
    q = q.reshape(x.shape[0], o, spec.n_heads, spec.head_dim)
    return apply_rope(q, jnp.maximum(p_obs, 0), spec), p_obs

  def _update(self, inputs: base.AttnInputs, lp):
    """(new cache, candidates E, admitted [B, M], valid [B, M]) for this call."""
    w, t = self.window, inputs.positions.shape[1]
    pos = jnp.where((inputs.positions >= 0) & (inputs.positions < self.max_len),
                    inputs.positions, -1)
    e = self._candidates(inputs, pos)
    valid = e.positions >= 0
    n_in = self.inner.lengths
    eligible = valid & ~select.recent_mask(valid, w)
    if t > 1:
      q_obs, p_obs = self._observation_queries(inputs.x, pos, lp)
      scores = select.snapkv_scores(q_obs, p_obs, e.k, e.positions, valid, pool=self.pool,
                                    eligible=eligible)
    else:  # one new token: at most one candidate leaves the window, nothing to rank
      scores = jnp.zeros(valid.shape, jnp.float32)
    admitted, in_ring = select.admit(valid, scores, n_in, self.limit, w)
    slot = n_in[:, None] + jnp.cumsum(admitted, axis=1) - 1
    inner = base.update_unchecked(
        self.inner,
        dataclasses.replace(e, positions=jnp.where(admitted, slot, -1).astype(jnp.int32)), lp)
    c = self.pos_map.shape[1]
    pos_map = self.pos_map.at[jnp.arange(slot.shape[0])[:, None],
                              jnp.where(admitted, slot, c)].set(e.positions, mode="drop")
    m = valid.shape[1]
    order = jnp.argsort(jnp.where(in_ring, 0, m) + jnp.arange(m)[None, :], axis=1)[:, :w]
    keep = _rows(in_ring, order)
    ring = lambda a, old: None if old is None else _rows(a, order).astype(old.dtype)
    new = dataclasses.replace(
        self, inner=inner, ring_k=ring(e.k, self.ring_k), ring_v=ring(e.v, self.ring_v),
        ring_x=ring(e.x, self.ring_x), ring_kpre=ring(e.k_pre, self.ring_kpre),
        ring_pos=jnp.where(keep, _rows(e.positions, order), -1).astype(jnp.int32),
        pos_map=pos_map, lens=base.new_lengths(self.lens, pos))
    return new, e, admitted, valid

  def update(self, inputs: base.AttnInputs, lp):
    return self._update(inputs, lp)[0]

  def step(self, inputs: base.AttnInputs, q, lp, carry, *, spec: ModelSpec):
    """update, then attention in which the call's queries also see the tokens this call
    evicts (they were in the cache while the call ran: SnapKV's full-prompt prefill).

    With ring="exact" the candidates that were not admitted (window + evicted now) are
    attended exactly; with ring="inner" only the post-update window is (the scratch copy
    of the inner cache holds W tokens), as `attend`."""
    cache, e, admitted, valid = self._update(inputs, lp)
    if self.ring != "exact" or self.window + inputs.positions.shape[1] == 0:
      out, lse = cache.attend(q, inputs.positions, lp, spec=spec)
      return out, lse, cache, carry
    inner = cache._attend_inner(q, inputs.positions, lp, spec)
    recent = dot_product_attention(q, e.k, e.v, inputs.positions, e.positions,
                                   valid & ~admitted, out_dtype=jnp.float32)
    out, lse = combine([inner, recent], out_dtype=q.dtype)
    return out, lse, cache, carry

  def _requery(self, q, c, q_positions, spec: ModelSpec):
    """q rotated from its position to the compact position c (pre-RoPE inner caches)."""
    if not self.reindex:
      return q
    return apply_rope(q, jnp.where(q_positions >= 0, c - q_positions, 0), spec)

  def _attend_inner(self, q, q_positions, lp, spec: ModelSpec, implementation=None):
    c_in = _compact_positions(self.pos_map, self.pos_map != EMPTY, q_positions)
    return self.inner.attend(self._requery(q, c_in, q_positions, spec), c_in, lp, spec=spec,
                             implementation=implementation)

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    """Attention over what the cache holds: the inner cache and the window."""
    inner = self._attend_inner(q, q_positions, lp, spec, implementation)
    if self.window == 0:
      return inner
    ring_valid = self.ring_pos >= 0
    if self.ring == "exact":
      recent = dot_product_attention(q, self.ring_k, self.ring_v, q_positions, self.ring_pos,
                                     ring_valid, out_dtype=jnp.float32)
    else:
      w = self.window
      slots = jnp.where(ring_valid, jnp.arange(w, dtype=jnp.int32)[None, :], -1)
      scratch = self.scratch.update(base.AttnInputs(
          x=self.ring_x, k=self.ring_k, k_pre=self.ring_kpre, v=self.ring_v,
          positions=slots), lp)
      c_r = _compact_positions(self.ring_pos, ring_valid, q_positions)
      recent = scratch.attend(self._requery(q, c_r, q_positions, spec), c_r, lp, spec=spec,
                              implementation=implementation)
    return combine([inner, recent], out_dtype=q.dtype)

  def materialize(self):
    """(k, v [B, S, K, H] at original positions, valid [B, S]): the inner cache's view of
    its kept tokens (keys of pre-RoPE inner caches rotated at their compact slot) and the
    ring's exact window. Evicted positions are invalid."""
    k_in, v_in, valid_in = self.inner.materialize()
    b, c = self.pos_map.shape
    k_in, v_in, valid_in = k_in[:, :c], v_in[:, :c], valid_in[:, :c]
    s = self.max_len
    bidx = jnp.arange(b)[:, None]
    dst = jnp.where(valid_in & (self.pos_map != EMPTY), self.pos_map, s)
    shape = (b, s) + self.ring_k.shape[2:]
    k = jnp.zeros(shape, k_in.dtype).at[bidx, dst].set(k_in, mode="drop")
    v = jnp.zeros(shape, v_in.dtype).at[bidx, dst].set(v_in, mode="drop")
    valid = jnp.zeros((b, s), bool).at[bidx, dst].set(True, mode="drop")
    rdst = jnp.where(self.ring_pos >= 0, self.ring_pos, s)
    k = k.at[bidx, rdst].set(self.ring_k.astype(k.dtype), mode="drop")
    v = v.at[bidx, rdst].set(self.ring_v.astype(v.dtype), mode="drop")
    valid = valid.at[bidx, rdst].set(True, mode="drop")
    return k, v, valid

  def nbytes(self) -> int:
    """Cache storage: the inner cache's and the scratch copy's own `nbytes()` (without the
    weights they keep beside it, e.g. FDC/ZACK's rotations, Palu's B), the window ring,
    the position map and the lengths."""
    own = (self.ring_k, self.ring_v, self.ring_x, self.ring_kpre, self.ring_pos,
           self.pos_map, self.lens)
    total = sum(a.size * a.dtype.itemsize for a in own if a is not None)
    return int(total + self.inner.nbytes() + (0 if self.scratch is None
                                              else self.scratch.nbytes()))

  def weights_nbytes(self) -> int:
    """Weights kept by the inner cache and by its scratch copy (each holds its own)."""
    w = lambda c: getattr(c, "weights_nbytes", lambda: 0)() if c is not None else 0
    return int(w(self.inner) + w(self.scratch))

  def stored_tokens(self):
    """[B] tokens held (inner + ring): never more than the budget."""
    return self.inner.lengths + jnp.sum(self.ring_pos >= 0, axis=1)


def as_spec(method_spec) -> EvictSpec:
  if isinstance(method_spec, EvictSpec):
    return method_spec
  if isinstance(method_spec, Mapping):
    return EvictSpec(**method_spec)
  raise ValueError(f"evict cache needs an EvictSpec, got {type(method_spec).__name__}")


@base.register_cache("evict")
def _make_evict(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  es = as_spec(method_spec)
  ring = check_inner(es.inner, es.ring)
  if spec.sliding_window is not None:
    raise ValueError("EvictSpec: sliding-window models are not supported (the inner cache "
                     "would apply the window to compact positions)")
  w = es.window
  # Budget covering the whole capacity: nothing is ever evicted.
  limit = capacity if capacity <= es.budget else es.budget - w
  inners = base.init_caches(es.inner, es.inner_spec, spec, params, batch=batch,
                            capacity=limit, dtype=dtype)
  if type(inners[0]).step is not base.KVCache.step:
    raise ValueError(f"EvictSpec.inner={es.inner!r}: cross-layer caches (own `step`) cannot "
                     "be wrapped")
  scratches = (base.init_caches(es.inner, es.inner_spec, spec, params, batch=batch,
                                capacity=w, dtype=dtype)
               if ring == "inner" and w > 0 else (None,) * spec.n_layers)
  kv = (batch, w, spec.n_kv_heads, spec.head_dim)
  full = ring == "inner" or es.inner not in KV_INNER
  return tuple(
      EvictCache(inner=inner, scratch=scratch, ring_k=jnp.zeros(kv, dtype),
                 ring_v=jnp.zeros(kv, dtype),
                 ring_x=jnp.zeros((batch, w, spec.dim), dtype) if full else None,
                 ring_kpre=jnp.zeros(kv, dtype) if full else None,
                 ring_pos=jnp.full((batch, w), -1, jnp.int32),
                 pos_map=jnp.full((batch, limit), EMPTY, jnp.int32),
                 lens=jnp.zeros((batch,), jnp.int32), model=spec, max_len=capacity,
                 limit=limit, window=w, observe=es.observe_queries, pool=es.pool, ring=ring,
                 reindex=es.inner in PRE_ROPE_INNER)
      for inner, scratch in zip(inners, scratches))
