"""GEAR cache vs a float64 numpy transcription of GEAR's Algorithms 1-2 (same seeded init)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.cache.base import AttnInputs
from kvlowrank.methods import GearCache, GearSpec, init_caches
from kvlowrank.methods.gear import outliers, power
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.spec import ModelSpec
from docs_check import cites_results

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_dim=64, max_seq_len=128)
# n_b = 8, g = 4, s = 20 %: key channels (8 tokens) get 1 + 1 outliers, value tokens
# (16 channels) 2 + 2; r_p = 4, r_g = 2.
GSPEC = GearSpec(bits=2, group_size=4, buffer=8, sparsity=20.0, rank_prefill=4, rank_chunk=2)
TIE = 1e-4


def ref_quant(x, bits, axis, group):
  """float64 min/max quantize-dequantize with fp16 scale/zero (the project's quantizer's
  formula); returns (x_hat, near_tie bool)."""
  x = np.moveaxis(x, axis, -1)
  xg = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
  qmax = 2 ** bits - 1
  s = ((mx - mn) / qmax).astype(np.float16).astype(np.float64)
  z = mn.astype(np.float16).astype(np.float64)
  u = (xg - z) / np.where(s > 0, s, 1.0)
  code = np.where(s > 0, np.clip(np.round(u), 0, qmax), 0)
  tie = (np.abs(u - np.floor(u) - 0.5) < TIE) & (s > 0)
  back = lambda a: np.moveaxis(a.reshape(x.shape), -1, axis)
  return back(code * s + z), back(tie)


def ref_outliers(x, top, bottom):
  """Mask of the `top` largest and then `bottom` smallest of the rest, along the last axis."""
  order = np.argsort(-x, axis=-1, kind="stable")
  mask = np.zeros(x.shape, bool)
  np.put_along_axis(mask, order[..., :top], True, -1)
  rest = np.where(mask, np.inf, x)
  np.put_along_axis(mask, np.argsort(rest, axis=-1, kind="stable")[..., :bottom], True, -1)
  return mask


def ref_power(x, r, seed, iters):
  """Algorithm 2 in float64 from the same B0 (`power.init_right`)."""
  b = np.asarray(power.init_right(seed, x.shape[-1], r), np.float64)
  for l in range(iters):
    last = l == iters - 1
    if last:
      b = np.linalg.qr(b)[0]
    a = x @ b
    if last:
      a = np.linalg.qr(a)[0]
    b = x.T @ a
  return a, b


def ref_fill(x, m, how):
  """x with the outliers m replaced along the last axis: "mean" of the other entries
  (the official code) or "zero" (Eq. 5's X - S read literally)."""
  if how == "zero":
    return np.where(m, 0.0, x)
  mean = np.where(m, 0, x).sum(-1, keepdims=True) / np.maximum((~m).sum(-1, keepdims=True), 1)
  return np.where(m, mean, x)


class GearRef:
  """One sequence, all KV heads: Algorithm 1 (prefill: one r_p factor over the whole
  compressed prompt; decode: the buffer compressed every n_b tokens with its own r_g
  factor), outliers and quantization per chunk (the contract's choice), the spec's fill.
  The stored outlier S is X - D^ at the outliers with mean fill (D^ + S = X there) and X
  with zero fill (Eq. 4; D^ + S = X + Q(0) there, the low rank sees -Q(0))."""

  def __init__(self, gs: GearSpec, h: int):
    self.gs, self.h, self.nb = gs, h, gs.buffer
    # KIVI: g-token key groups, g-channel value groups; KCVT: a chunk's channel, a token.
    kivi = gs.backbone == "kivi"
    self.kg, self.vg = (gs.group_size, gs.group_size) if kivi else (gs.buffer, h)
    self.k, self.v, self.tie = [], [], []     # reconstructed compressed tokens [K, H] rows
    self.buf_k, self.buf_v = [], []

  def _chunk(self, x, key: bool):
    """One n_b-token chunk [nb, K, H] -> (D^ + S, residual, tie [nb, K])."""
    gs = self.gs
    if key:   # vectors: channels over the chunk's tokens
      xt = np.moveaxis(x, 0, -1)                                   # [K, H, nb]
      m = ref_outliers(xt, *outliers.counts(gs.sparsity, self.nb)) if gs.sparsity else \
          np.zeros(xt.shape, bool)
      fill = np.moveaxis(ref_fill(xt, m, gs.outlier_fill), -1, 0)
      m = np.moveaxis(m, -1, 0)
      d, tie = ref_quant(fill, gs.bits, 0, self.kg)
    else:     # vectors: a head's token
      m = ref_outliers(x, *outliers.counts(gs.sparsity, self.h)) if gs.sparsity else \
          np.zeros(x.shape, bool)
      d, tie = ref_quant(ref_fill(x, m, gs.outlier_fill), gs.bits, -1, self.vg)
    stored = x - d if gs.outlier_fill == "mean" else x
    s = np.where(m, stored.astype(np.float16).astype(np.float64), 0.0)
    return d + s, x - d - s, tie.any(-1)

  def _compress(self, xk, xv, rank):
    n = len(xk)
    out, tie = [], np.zeros((n, xk.shape[1]), bool)
    for x, key in ((xk, True), (xv, False)):
      parts = [self._chunk(x[i:i + self.nb], key) for i in range(0, n, self.nb)]
      ds = np.concatenate([p[0] for p in parts])
      res = np.concatenate([p[1] for p in parts])
      tie |= np.concatenate([p[2] for p in parts])
      if rank:
        for kh in range(x.shape[1]):
          a, b = ref_power(res[:, kh], rank, self.gs.seed, self.gs.iterations)
          f16 = lambda z: z.astype(np.float16).astype(np.float64)
          ds[:, kh] += f16(a) @ f16(b).T
      out.append(ds)
    # A near-tie anywhere in a (chunk, head) can flip a code, which moves that head's
    # whole factor: flag the head's whole segment.
    seg_tie = np.broadcast_to(tie.any(0, keepdims=True), tie.shape)
    return out[0], out[1], seg_tie

  def prefill(self, k, v):
    n = (len(k) // self.nb) * self.nb
    if n:
      rk, rv, tie = self._compress(k[:n], v[:n], self.gs.rank_prefill)
      self.k.append(rk), self.v.append(rv), self.tie.append(tie)
    self.buf_k, self.buf_v = list(k[n:]), list(v[n:])

  def decode(self, k1, v1):
    self.buf_k.append(k1[0]), self.buf_v.append(v1[0])
    if len(self.buf_k) == self.nb:
      rk, rv, tie = self._compress(np.stack(self.buf_k), np.stack(self.buf_v),
                                   self.gs.rank_chunk)
      self.k.append(rk), self.v.append(rv), self.tie.append(tie)
      self.buf_k, self.buf_v = [], []

  def view(self):
    kh = SPEC.n_kv_heads
    cat = lambda parts, buf: np.concatenate(parts + [np.reshape(buf, (-1, kh, self.h))])
    tie = np.concatenate(self.tie + [np.zeros((len(self.buf_k), kh), bool)])
    return cat(self.k, self.buf_k), cat(self.v, self.buf_v), tie


_materialize = jax.jit(lambda c: c.materialize())


def check_against_refs(cache, refs, stats=None):
  """Every token of every row vs the reference; heads of segments with a near-tie are
  skipped (they must be rare)."""
  k, v, valid = (np.asarray(a, np.float64) for a in _materialize(cache))
  n_tie = n_all = 0
  for b, ref in enumerate(refs):
    rk, rv, tie = ref.view()
    n = len(rk)
    assert int(cache.lens[b]) == n and valid[b].sum() == n
    scale = 1e-4 * max(np.abs(rk).max(), np.abs(rv).max())   # measured: <= 2e-6
    ok = ~tie
    np.testing.assert_allclose(k[b, :n][ok], rk[ok], atol=scale, rtol=0)
    np.testing.assert_allclose(v[b, :n][ok], rv[ok], atol=scale, rtol=0)
    n_tie, n_all = n_tie + tie.sum(), n_all + tie.size
    if stats is not None:
      stats.append(max(np.abs(k[b, :n][ok] - rk[ok]).max(initial=0),
                       np.abs(v[b, :n][ok] - rv[ok]).max(initial=0)) / scale)
  assert n_tie <= 0.1 * n_all, (n_tie, n_all)


@jax.jit
def _update(cache, k, v, pos):
  return cache.update(AttnInputs(x=None, k=k, k_pre=k, v=v, positions=pos), {})


@jax.jit
def _attend_both(cache, q, pos):
  out, lse = cache.attend(q, pos, {}, spec=SPEC)
  k, v, valid = cache.materialize()
  s_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), valid.shape)
  dense, dlse = dot_product_attention(q, k, v, pos, s_pos, valid, out_dtype=jnp.float32)
  return out, lse, dense, dlse


def run_stream(gs, prefill_lens, n_decode, seed, corrupt=None, spec=SPEC, ref_spec=None):
  """Ragged prefill then decode steps on random K/V (channel-dependent ranges, a few
  spikes); checks the cache against GearRef after every step and attend against dense
  attention over materialize(). corrupt: f(cache) -> cache applied before the final
  check; ref_spec: the reference's spec if not gs (negative controls)."""
  rng = np.random.default_rng(seed)
  bsz, kh, h = len(prefill_lens), spec.n_kv_heads, spec.head_dim
  t0 = max(prefill_lens)
  cache = GearCache.init(gs, spec, batch=bsz, capacity=48, dtype=jnp.float32)

  def mk(t):
    x = rng.standard_normal((bsz, t, kh, h)) * np.linspace(1.0, 6.0, h)
    spikes = rng.random(x.shape) < 0.02
    return np.where(spikes, x * 8, x).astype(np.float32)

  k, v = mk(t0), mk(t0)
  pos = np.where(np.arange(t0)[None] < np.array(prefill_lens)[:, None], np.arange(t0), -1)
  refs = [GearRef(ref_spec or gs, h) for _ in prefill_lens]
  for b, n in enumerate(prefill_lens):
    refs[b].prefill(k[b, :n].astype(np.float64), v[b, :n].astype(np.float64))
  cache = _update(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos, jnp.int32))
  check_against_refs(cache, refs)
  lens = np.array(prefill_lens)
  for step in range(n_decode):
    k1, v1 = mk(1), mk(1)
    active = np.ones(bsz, bool)
    active[-1] = step % 4 != 2            # the last row idles on some steps (padding)
    p = np.where(active, lens, -1)[:, None]
    for b in range(bsz):
      if active[b]:
        refs[b].decode(k1[b].astype(np.float64), v1[b].astype(np.float64))
    lens = lens + active
    cache = _update(cache, jnp.asarray(k1), jnp.asarray(v1), jnp.asarray(p, jnp.int32))
    q1 = jnp.asarray(rng.standard_normal((bsz, 1, spec.n_heads, h)), jnp.float32)
    out, lse, dense, dlse = _attend_both(cache, q1, jnp.asarray(p, jnp.int32))
    live = p[:, 0] >= 0
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(dense)[live], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(dlse)[live], atol=1e-5)
    if corrupt is None:
      check_against_refs(cache, refs)
  if corrupt is not None:
    check_against_refs(corrupt(cache), refs)
  return cache, refs


ZERO_FILL = dataclasses.replace(GSPEC, outlier_fill="zero")


@pytest.mark.parametrize("gs", [
    GSPEC,                                                      # GEAR (Q + S + L)
    ZERO_FILL,                                                  # GEAR, outliers -> 0
    dataclasses.replace(GSPEC, sparsity=0.0),                   # GEAR-L (Q + L)
    dataclasses.replace(GSPEC, rank_prefill=0, rank_chunk=0),   # outlier-only (Q + S)
    dataclasses.replace(ZERO_FILL, rank_prefill=0, rank_chunk=0),
], ids=["gear", "gear_zero_fill", "gear_l", "outlier", "outlier_zero_fill"])
def test_matches_reference_around_buffer_boundary(gs):
  """Prefill n_b - 1, n_b, n_b + 1 tokens (GQA, batch 3), then decode across two more
  chunk boundaries."""
  cache, _ = run_stream(gs, (7, 8, 9), 18, seed=1)
  assert [int(x) for x in cache.n_pchunks] == [0, 1, 1]
  q_len, w_len = cache.segments()
  assert np.all(np.asarray(q_len) % gs.buffer == 0)
  lowrank = gs.rank_prefill > 0
  assert gs.variant == ("gear_l" if gs.sparsity == 0 else "gear" if lowrank else "outlier")
  assert (cache.sk_idx is None) == (gs.sparsity == 0)
  assert (cache.a_k is None) == (gs.rank_prefill == gs.rank_chunk == 0)
  if cache.sk_idx is not None:
    assert_distinct_slots(cache)


def distinct_or_unwritten(idx, val, axis):
  """[...] bool per vector: its slots' indices along `axis` are pairwise distinct, or every
  slot's value is 0 (a vector not written yet)."""
  idx, val = np.moveaxis(np.asarray(idx), axis, -1), np.moveaxis(np.asarray(val), axis, -1)
  srt = np.sort(idx, axis=-1)
  distinct = np.all(srt[..., 1:] != srt[..., :-1], axis=-1)
  return distinct | np.all(val == 0, axis=-1)


def assert_distinct_slots(cache):
  """The kernels' contract (`kvlowrank_kernels.gear.operands`): a key channel's slots are
  distinct tokens of its chunk, a value token's slots distinct channels; the Triton kernel
  selects where slots meet, so a repeated index would drop an outlier."""
  assert distinct_or_unwritten(cache.sk_idx, cache.sk_val, -2).all()
  assert distinct_or_unwritten(cache.sv_idx, cache.sv_val, -1).all()


def test_distinct_slots_check_catches_a_repeated_index():
  """Negative control of assert_distinct_slots: one written value token's two slots made
  equal fails it."""
  cache, _ = run_stream(GSPEC, (7, 8, 9), 2, seed=1)
  assert_distinct_slots(cache)
  t = int(np.argmax(np.any(np.asarray(cache.sv_val[0, 0]) != 0, axis=-1)))
  bad = dataclasses.replace(cache,
                            sv_idx=cache.sv_idx.at[0, 0, t, 1].set(cache.sv_idx[0, 0, t, 0]))
  with pytest.raises(AssertionError):
    assert_distinct_slots(bad)


def test_kcvt_4bit_and_long_prefill_match_reference():
  """KCVT backbone (key group = n_b, value group = H), 4 bits; a prefill of
  several chunks gets one rank-r_p factor over all of them."""
  gs = GearSpec(backbone="kcvt", bits=4, buffer=8, sparsity=20.0, rank_prefill=4,
                rank_chunk=2)

  cache, _ = run_stream(gs, (27, 13), 12, seed=4)
  assert [int(x) for x in cache.n_pchunks] == [3, 1]
  assert cache.store.keys.group == 8 and cache.store.values.group == SPEC.head_dim


@pytest.mark.parametrize("gs", [GSPEC, ZERO_FILL], ids=["mean_fill", "zero_fill"])
def test_negative_control_dropped_chunk_factors_fail(gs):
  """Zeroing one streaming chunk's right factors (keys) must break the comparison."""
  run_stream(gs, (7, 8, 9), 9, seed=2)

  def drop(c):
    return dataclasses.replace(c, b_k=c.b_k.at[0, :, 1].set(0))   # row 0, chunk 1 (tokens 8-15)

  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    run_stream(gs, (7, 8, 9), 9, seed=2, corrupt=drop)


@pytest.mark.parametrize("gs,other", [(GSPEC, ZERO_FILL), (ZERO_FILL, GSPEC)],
                         ids=["mean_vs_zero_ref", "zero_vs_mean_ref"])
def test_negative_control_other_fill_reference_fails(gs, other):
  """The two fills give different caches: each fails against the other's reference (so
  the reference's fill is what the parametrized comparison checks)."""
  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    run_stream(gs, (7, 8, 9), 0, seed=1, ref_spec=other)


def _padded_call(rng, k, v, n_valid, t, first):
  """The eviction wrapper's layout: row r's n_valid[r] tokens (consecutive positions from
  first[r], in order) at random columns of a T-column call, the rest padding (-1) holding
  garbage K/V."""
  b, _, kh, h = k.shape
  cols = [np.sort(rng.choice(t, n, replace=False)) for n in n_valid]
  kp = rng.standard_normal((b, t, kh, h)).astype(np.float32) * 50
  vp = rng.standard_normal((b, t, kh, h)).astype(np.float32) * 50
  pos = np.full((b, t), -1, np.int32)
  for r, c in enumerate(cols):
    kp[r, c], vp[r, c] = k[r, :len(c)], v[r, :len(c)]
    pos[r, c] = first[r] + np.arange(len(c))
  return jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(pos)


def test_padding_anywhere_in_a_row_equals_the_compacted_call():
  """The eviction wrapper (`methods.evict`) calls update with every candidate: evicted
  ones as padding (position -1) anywhere in a row, admitted ones at consecutive slots, and
  a decode step as W + 1 candidates of which at most one is valid. The cache must equal
  the one fed only the valid tokens (ragged prefill, then one-token steps): in particular
  a row whose first chunk completes in a padded one-token step gets a streaming (r_g)
  factor, not the prefill factor."""
  rng = np.random.default_rng(8)
  kh, h = SPEC.n_kv_heads, SPEC.head_dim
  lens = np.array([13, 6])                     # row 1's first chunk completes in decode
  mk = lambda t: (rng.standard_normal((2, t, kh, h)) * np.linspace(1, 6, h)).astype(np.float32)
  k, v = mk(13), mk(13)
  ref = GearCache.init(GSPEC, SPEC, batch=2, capacity=48, dtype=jnp.float32)
  pos = np.where(np.arange(13)[None] < lens[:, None], np.arange(13), -1).astype(np.int32)
  ref = prefilled = _update(ref, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
  empty = GearCache.init(GSPEC, SPEC, batch=2, capacity=48, dtype=jnp.float32)
  got = _update(empty, *_padded_call(rng, k, v, lens, 20, [0, 0]))
  # Negative control below: two tokens swapped in the padded call.
  swapped = _update(empty, *_padded_call(rng, k[:, [1, 0] + list(range(2, 13))], v, lens,
                                         20, [0, 0]))
  for step in range(12):
    k1, v1 = mk(1), mk(1)
    live = np.array([step % 3 != 1, True])    # row 0 idles on some steps
    ref = _update(ref, jnp.asarray(k1), jnp.asarray(v1),
                  jnp.asarray(np.where(live, lens, -1)[:, None], jnp.int32))
    got = _update(got, *_padded_call(rng, k1, v1, live.astype(int), 5, lens))
    lens = lens + live
  assert [int(x) for x in got.n_pchunks] == [1, 0] == [int(x) for x in ref.n_pchunks]
  assert [int(x) for x in got.lens] == [int(x) for x in ref.lens]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=1e-5, rtol=1e-5)
  # Negative control: the padded prefill with two tokens swapped is another cache.
  assert np.abs(np.asarray(_materialize(swapped)[0]) -
                np.asarray(_materialize(prefilled)[0])).max() > 0.1


def test_deferred_multi_token_update_then_settle_equals_the_undeferred_update():
  """With `deferring` on (a decode step; the eviction wrapper's hands its inner cache
  W + 1 candidates), an update compresses only the chunks its window cannot hold: a chunk
  the call completes waits, exact, and `settle` then compresses it as a streaming chunk, as
  the undeferred update does. Rows past their prefill (q_len 8): row 0 ends on a chunk
  boundary (24), row 1 inside a chunk (20, padded). Negative controls: before `settle` the
  waiting chunk is exact (differs from the compressed one); a deferred one-token update that
  completes a chunk leaves it pending too."""
  rng = np.random.default_rng(7)
  kh, h = SPEC.n_kv_heads, SPEC.head_dim
  mk = lambda t: jnp.asarray(rng.standard_normal((2, t, kh, h)).astype(np.float32) * 3)
  cache = GearCache.init(GSPEC, SPEC, batch=2, capacity=48, dtype=jnp.float32)
  pos0 = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  cache = _update(cache, mk(9), mk(9), pos0)
  assert [int(x) for x in cache.q_lens] == [8, 8]
  pos = jnp.asarray(np.stack([np.arange(9, 24), np.r_[np.arange(9, 20), [-1] * 4]]),
                    jnp.int32)
  k, v = mk(15), mk(15)
  off = _update(cache, k, v, pos)
  on = _update(cache.deferring(True), k, v, pos).deferring(False)
  assert [int(x) for x in off.q_lens] == [24, 16] and [int(x) for x in on.q_lens] == [16, 16]
  assert bool(on.pending()) and not bool(off.pending())
  settled = jax.jit(lambda c: c.settle())(on)
  assert not bool(settled.pending())

  def same(a, b, q_lens=True):
    if q_lens:
      np.testing.assert_array_equal(np.asarray(a.q_lens), np.asarray(b.q_lens))
    (ak, av, am), (bk, bv, bm) = a.materialize(), b.materialize()
    np.testing.assert_array_equal(np.asarray(am), np.asarray(bm))
    m = np.asarray(am)[..., None, None]                       # valid slots only
    np.testing.assert_allclose(np.where(m, ak, 0), np.where(m, bk, 0), atol=1e-5)
    np.testing.assert_allclose(np.where(m, av, 0), np.where(m, bv, 0), atol=1e-5)

  same(settled, off)
  with pytest.raises(AssertionError, match="Not equal to tolerance"):
    same(on, off, q_lens=False)                               # the waiting chunk is exact
  k1, v1 = mk(1), mk(1)
  c16 = _update(cache, mk(7), mk(7), pos[:, :7])              # 16 tokens, all compressed
  pos_b = jnp.asarray(np.stack([np.arange(16, 23)] * 2), jnp.int32)
  c23 = _update(c16, mk(7), mk(7), pos_b)                     # window: tokens 16..22
  pos1 = jnp.full((2, 1), 23, jnp.int32)                      # token 23 completes the chunk
  off1 = _update(c23, k1, v1, pos1)
  on1 = _update(c23.deferring(True), k1, v1, pos1).deferring(False)
  assert [int(x) for x in off1.q_lens] == [24, 24] and [int(x) for x in on1.q_lens] == [16, 16]
  assert bool(on1.pending())
  same(jax.jit(lambda c: c.settle())(on1), off1)


def test_power_iteration_recovers_exact_low_rank():
  rng = np.random.default_rng(0)
  pi = jax.jit(power.power_iteration, static_argnums=2)
  for r in (1, 2, 4):
    x = rng.standard_normal((3, 40, r)) @ rng.standard_normal((3, r, 16))
    a, b = pi(jnp.asarray(x, jnp.float32), power.init_right(7, 16, r), 3)
    rec = np.asarray(jnp.einsum("...nr,...dr->...nd", a, b))
    np.testing.assert_allclose(rec, x, atol=1e-4 * np.abs(x).max())
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(a, -1, -2) @ a),
                               np.broadcast_to(np.eye(r), (3, r, r)), atol=1e-5)
    if r > 1:   # negative control: one rank short does not recover it
      a1, b1 = pi(jnp.asarray(x, jnp.float32), power.init_right(7, 16, r - 1), 3)
      assert np.abs(np.asarray(a1 @ jnp.swapaxes(b1, -1, -2)) - x).max() > 1e-2 * np.abs(x).max()
  # Rows outside the mask stay zero.
  a, _ = power.factor(jnp.asarray(x, jnp.float32), 2, seed=0, iterations=3,
                      row_mask=jnp.arange(40) < 24)
  assert np.all(np.asarray(a)[:, 24:] == 0)


@pytest.mark.parametrize("qr", ["householder_q", "orthonormalize"])
def test_orthonormalize_spans_what_numpy_qr_spans(qr):
  """`power.householder_q` (Householder in jnp, no cuSOLVER: the GPU's) and
  `power.orthonormalize` (on the CPU: LAPACK) vs float64 numpy QR: the same projector Q Q^T
  and orthonormal columns, also for near-parallel columns; for dependent or zero columns Q
  is still an orthonormal basis containing them (Q Q^T M = M), as LAPACK's. Negative
  control: one pass of classical Gram-Schmidt on the near-parallel columns loses
  orthogonality."""
  orthonormalize = jax.jit(getattr(power, qr))
  rng = np.random.default_rng(3)
  m = rng.standard_normal((5, 40, 4))
  m[..., 1] = m[..., 0] + 1e-3 * m[..., 1]                # near-parallel: cond ~ 1e3
  eye = lambda r: np.broadcast_to(np.eye(r), (5, r, r))
  q = np.asarray(orthonormalize(jnp.asarray(m, jnp.float32)), np.float64)
  qn = np.linalg.qr(m)[0]
  proj = lambda a: a @ np.swapaxes(a, -1, -2)
  np.testing.assert_allclose(proj(q), proj(qn), atol=2e-4)
  np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, eye(4), atol=2e-6)
  dep = m.copy()
  dep[..., 3] = 2.0 * dep[..., 0] - dep[..., 2]           # the last column is dependent
  dep[1, :, 2] = 0.0                                      # and a zero column
  for x in (dep, np.zeros((5, 40, 4))):
    qd = np.asarray(orthonormalize(jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(np.swapaxes(qd, -1, -2) @ qd, eye(4), atol=2e-6)
    np.testing.assert_allclose(proj(qd) @ x, x, atol=1e-4)
  # Columns whose squares overflow fp32 (the power iteration's unnormalised products).
  big = np.asarray(orthonormalize(jnp.asarray(m * 1e25, jnp.float32)), np.float64)
  np.testing.assert_allclose(proj(big), proj(qn), atol=2e-4)
  # Full rank r = n: Q spans everything, so the power iteration reproduces the matrix.
  sq = rng.standard_normal((3, 8, 8))
  a, b = power.power_iteration(jnp.asarray(sq, jnp.float32), power.init_right(0, 8, 8), 3)
  np.testing.assert_allclose(np.asarray(a @ jnp.swapaxes(b, -1, -2)), sq, atol=1e-4)
  # Negative control: classical Gram-Schmidt, one pass, in float32.
  x = jnp.asarray(m, jnp.float32)
  c0 = x[..., 0] / jnp.linalg.norm(x[..., 0], axis=-1, keepdims=True)
  v = x[..., 1] - jnp.sum(c0 * x[..., 1], -1, keepdims=True) * c0
  c1 = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
  bad = np.asarray(jnp.stack([c0, c1], -1), np.float64)
  assert np.abs(np.swapaxes(bad, -1, -2) @ bad - np.eye(2)).max() > 1e-5


def test_outlier_counts_and_signs():
  assert outliers.counts(2.0, 64) == (1, 1)      # the paper's s = 2 %: one from each end
  assert outliers.counts(1.0, 64) == (1, 0)
  assert outliers.counts(4.0, 64) == (2, 1)
  assert outliers.counts(0.0, 64) == (0, 0)
  assert outliers.counts(2.0, 128) == (2, 1)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((5, 7, 32)).astype(np.float32)
  idx, mask = outliers.select(jnp.asarray(x), 2, 1)
  idx, mask = np.asarray(idx), np.asarray(mask)
  assert mask.sum(-1).tolist() == [[3] * 7] * 5
  srt = np.sort(x, -1)
  picked = np.take_along_axis(x, idx, -1)
  np.testing.assert_array_equal(np.sort(picked[..., :2], -1), srt[..., -2:])   # largest
  np.testing.assert_array_equal(picked[..., 2], srt[..., 0])                   # smallest
  # In the cache: key outliers are the chunk channel's extremes, stored as X - D^ (fp16).
  cache, _ = run_stream(GSPEC, (16, 7, 9), 0, seed=5)
  sk_val = np.asarray(cache.sk_val[0, :, :2], np.float32)          # [K, 2 chunks, 2, H]
  assert np.all(sk_val[:, :, 0] > 0) and np.all(sk_val[:, :, 1] < 0)   # top above D^, bottom below
  assert np.all(np.asarray(cache.sk_idx[0, :, :2]) < GSPEC.buffer)


def test_attend_prefill_queries_equal_dense_over_materialize():
  """Several causal queries (a prefill call) through the factored path, query-chunked."""
  rng = np.random.default_rng(6)
  cache = GearCache.init(GSPEC, SPEC, batch=2, capacity=48, dtype=jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 30, 2, 16)), jnp.float32)
  pos = jnp.asarray(np.where(np.arange(30)[None] < np.array([[30], [21]]), np.arange(30), -1),
                    jnp.int32)
  cache = _update(cache, k, k * 0.5 + 1, pos)
  q = jnp.asarray(rng.standard_normal((2, 30, 4, 16)), jnp.float32)
  out, lse, dense, dlse = _attend_both(cache, q, pos)
  live = np.asarray(pos) >= 0
  np.testing.assert_allclose(np.asarray(out)[live], np.asarray(dense)[live], atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(dlse)[live], atol=1e-5)
  import kvlowrank.methods.gear.cache as gc
  old = gc.SCORE_ELEMENTS
  gc.SCORE_ELEMENTS = 2 * 4 * 48 * 7          # 7 queries per chunk
  try:
    out2, _ = jax.jit(lambda c, q, p: c.attend(q, p, {}, spec=SPEC))(cache, q, pos)
  finally:
    gc.SCORE_ELEMENTS = old
  np.testing.assert_allclose(np.asarray(out2)[live], np.asarray(out)[live], atol=1e-6)


def test_nbytes_equals_arithmetic():
  spec = SPEC.replace(head_dim=128, n_heads=8, n_kv_heads=2)
  b, kh, h = 3, 2, 128
  gs = GearSpec()                                   # 2-bit KIVI g = 64, n_b = 64, s = 2 %
  c = GearCache.init(gs, spec, batch=b, capacity=1000, dtype=jnp.bfloat16)
  s = 1024                                          # capacity rounded up to lcm(64, 32, 64)
  ch = s // 64
  nk, nv = 2, 3                                     # ceil(2 % of 64) = 2, of 128 = 3
  expect = {
      "codes": 2 * b * kh * s * (h * 2 // 8),
      "scales": b * kh * (s // 64) * h * 2 + b * kh * s * (h // 64) * 2,
      "zeros": b * kh * (s // 64) * h * 2 + b * kh * s * (h // 64) * 2,
      "window": 2 * b * 64 * kh * h * 2,
      "low_rank_left": 2 * b * kh * s * 4 * 2,
      "low_rank_right": 2 * b * kh * ch * h * 2 * 2 + 2 * b * kh * h * 4 * 2,
      "sparse_values": b * kh * ch * nk * h * 2 + b * kh * s * nv * 2,
      "sparse_indices": b * kh * ch * nk * h + b * kh * s * nv,
      "lengths": 3 * 4 * b,
  }
  assert c.nbytes_breakdown() == expect
  assert c.nbytes() == sum(expect.values())
  from kvlowrank.methods.gear.method import bytes_per_head_token
  per = (2 * 32 + 4 * 128 / 64 + 4 * 2 + 4 * 4 + 4 * 128 * 2 / 64 + 3 * nk * 128 / 64 + 3 * nv)
  assert bytes_per_head_token(h, gs) == per
  assert c.bytes_per_token() == pytest.approx(kh * per)
  # GEAR-L / outlier-only drop their arrays.
  gl = GearCache.init(dataclasses.replace(gs, sparsity=0.0), spec, batch=1, capacity=64)
  assert gl.nbytes_breakdown()["sparse_indices"] == 0
  oo = GearCache.init(dataclasses.replace(gs, rank_prefill=0, rank_chunk=0), spec, batch=1,
                      capacity=64)
  assert oo.nbytes_breakdown()["low_rank_left"] == 0


def test_kv_size_in_both_conventions_equals_hand_arithmetic():
  """kv_size on SmolLM2 (30 layers x 3 KV heads x H = 64; bf16 K + V = 30 x 3 x 256 =
  23040 B/token). Honest, per layer and KV head: 2-bit KIVI codes 2 x 16 B + scale/zero
  4 + 4 B (40 B backbone), left factors 2 x 2 RA B, right factors 2 x 2 x 64 r_g / 64 B,
  outliers 3 B each (2 per 64-token key channel chunk: 6 B/token; 2 per value token: 6 B).
  Paper convention: backbone + 23040 x (1.9 r_p / 4 + 2 s [KIVI] or s [KCVT]) / 100."""
  from kvlowrank.methods.gear.size import kv_size
  smol = ModelSpec(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                   head_dim=64, ffn_dim=1536, tie_embeddings=True)
  per = 30 * 3
  gear2 = kv_size(smol, GearSpec())                               # s = 2 %, r = 4/2
  assert gear2.dense == 23040
  assert gear2.honest == (40 + 16 + 8 + 12) * per == 6840
  assert gear2.paper_table9 == pytest.approx(40 * per + 23040 * (1.9 + 4.0) / 100)  # 4959.36
  assert round(gear2.percent("honest"), 1) == 29.7
  assert round(gear2.percent("paper_table9"), 1) == 21.5
  gear_l = kv_size(smol, GearSpec(sparsity=0.0, rank_prefill=8, rank_chunk=4))
  assert gear_l.honest == (40 + 32 + 16) * per
  assert gear_l.paper_table9 == pytest.approx(40 * per + 23040 * 1.9 * 2 / 100)
  # 4-bit KCVT: codes 2 x 32 B, one key scale/zero per 64-token channel chunk and one value
  # scale/zero per token (4 + 4 B): 72 B; Table 9's sparse cost over KCVT is s, not 2 s.
  kcvt = dict(backbone="kcvt", bits=4)
  gear4 = kv_size(smol, GearSpec(**kcvt))
  assert gear4.honest == (72 + 16 + 8 + 12) * per
  assert gear4.paper_table9 == pytest.approx(72 * per + 23040 * (1.9 + 2.0) / 100)
  outlier4 = kv_size(smol, GearSpec(**kcvt, rank_prefill=0, rank_chunk=0))
  assert outlier4.paper_table9 == pytest.approx(72 * per + 23040 * 2.0 / 100)
  # The honest figure is the cache's own count (and the registry's).
  from kvlowrank.methods import get_method
  assert gear2.honest == get_method("gear").kv_bytes_per_token(smol, GearSpec(), None, None)
  # Negative control: the conventions agree on a bare backbone and differ once S or L is
  # on (the paper's overheads are below the fp16 factors' and indexed outliers' bytes).
  bare = kv_size(smol, GearSpec(sparsity=0.0, rank_prefill=0, rank_chunk=0))
  assert bare.honest == bare.paper_table9 == 40 * per
  assert gear2.honest - gear2.paper_table9 > 0.08 * 23040


@pytest.mark.parametrize("kwargs,field", [
    (dict(sparsity=-1.0), "GearSpec.sparsity"), (dict(sparsity=100.0), "GearSpec.sparsity"),
    (dict(buffer=48), "GearSpec.buffer"), (dict(buffer=300, group_size=60), "GearSpec.buffer"),
    (dict(bits=5), "GearSpec.bits"), (dict(rank_chunk=-1), "GearSpec.rank_chunk"),
    (dict(rank_prefill=128), "GearSpec.rank_prefill"),
    (dict(iterations=0), "GearSpec.iterations"), (dict(backbone="palu"), "GearSpec.backbone"),
    (dict(backbone="xquant"), "GearSpec.backbone"), (dict(outlier_fill="median"), "outlier_fill"),
    (dict(implementation="pallas"), "GearSpec.implementation"),
    (dict(layout="tiled"), "GearSpec.layout"),
    (dict(scale_dtype="int8"), "GearSpec.scale_dtype"),
])
def test_bad_spec_errors(kwargs, field):
  with pytest.raises(ValueError, match=field):
    GearSpec(**kwargs)


def test_rank_above_head_dim_and_group_errors():
  with pytest.raises(ValueError, match="GearSpec.rank_prefill"):
    init_caches("gear", GearSpec(group_size=4, buffer=32, rank_prefill=32), SPEC, None,
                batch=1, capacity=8)
  with pytest.raises(ValueError, match="GearSpec.group_size"):
    init_caches("gear", GearSpec(group_size=32, buffer=32), SPEC, None, batch=1, capacity=8)
  from kvlowrank.methods import get_method
  with pytest.raises(ValueError, match="config.gear.rank_chunk"):
    get_method("gear").build_spec({"group_size": 4, "buffer": 32, "rank_chunk": 17}, SPEC)
  with pytest.raises(ValueError, match="GearSpec"):
    init_caches("gear", "gear2", SPEC, None, batch=1, capacity=8)


def test_configs_build_every_sweep_point():
  """configs/gear.py's sweep (and the main job's GEAR rows) build valid specs for SmolLM2;
  the registry's analytic bytes/token equals the cache's own count."""
  import importlib.util
  from pathlib import Path
  from kvlowrank.experiment import config as config_lib
  from kvlowrank.experiment.spec import from_config
  from kvlowrank.methods import get_method
  smol = ModelSpec(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                   head_dim=64, ffn_dim=1536, tie_embeddings=True)
  repo = Path(__file__).resolve().parents[1]
  mods = {}
  for name in ("gear", "main"):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", repo / "configs" / f"{name}.py")
    mods[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mods[name])
  assert "python experiments/" in mods["gear"].__doc__ and cites_results(mods["gear"].__doc__)
  gear_points = [p for p in mods["gear"].get_sweep() if p["method"] == "gear"]
  assert len(gear_points) == 18
  grid = {(p.get("gear.sparsity"), p.get("gear.rank_prefill")) for p in gear_points}
  assert {(s, r) for s in (0.0, 1.0, 2.0, 4.0) for r in (0, 2, 4, 8)} <= grid
  for name in ("gear", "main"):
    c = mods[name].get_config()
    for point in mods[name].get_sweep():
      exp = from_config(config_lib.apply_overrides(c, point), smol)
      if point["method"] == "gear":
        gs = exp.method_spec
        per = get_method("gear").kv_bytes_per_token(smol, gs, None, None)
        cache = GearCache.init(gs, smol, batch=1, capacity=128)
        assert per == pytest.approx(cache.bytes_per_token() * smol.n_layers)
  # GEAR-2 on SmolLM2: 30 layers x 3 KV heads x (2 x 16 B codes + 4 + 4 B scale/zero +
  # 16 B left factors + 8 B right factors + 6 B key + 6 B value outliers) = 6840 B/token.
  assert get_method("gear").kv_bytes_per_token(smol, GearSpec(), None, None) == 6840.0


def test_bench_random_fill_gives_valid_indices():
  """bench_decode's random fill (GEAR-2 at n_b = 64, H = 128): outlier indices inside the
  chunk / head and distinct per vector, the lengths and n_pchunks = the context (every
  compressed token on the prefill factor, as after a prefill), and a finite decode step."""
  from kvlowrank.bench.decode import METHODS, fill_caches
  spec = SPEC.replace(head_dim=128, n_layers=1)
  caches = init_caches("gear", METHODS["gear2"].spec, spec, None, batch=1, capacity=128)
  (c,) = fill_caches(caches, jax.random.key(0), 100)
  assert int(np.asarray(c.sk_idx).max()) < 64 and int(np.asarray(c.sv_idx).max()) < 64
  assert distinct_or_unwritten(c.sk_idx, np.ones(c.sk_idx.shape), -2).all()
  assert distinct_or_unwritten(c.sv_idx, np.ones(c.sv_idx.shape), -1).all()
  assert int(c.lens[0]) == 100 and int(c.n_pchunks[0]) == 100
  q = jnp.ones((1, 1, spec.n_heads, 128), jnp.bfloat16)
  out, lse = jax.jit(lambda c, q, p: c.attend(q, p, {}, spec=spec))(
      c, q, jnp.full((1, 1), 100, jnp.int32))
  assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()


def test_warp_layout_backbone_holds_the_planar_numbers():
  """GEAR-L with g = 32 stores its backbone in the Mosaic kernel's warp layout (`layout`
  "auto"): after the same prefill and decode steps (crossing a chunk boundary, ragged rows)
  its dequantized backbone, factors, attention (reference path) and bytes equal a planar
  cache's; negative control: different data differ. layout="warp" where it does not apply
  is one error naming GearSpec.layout."""
  spec = SPEC.replace(head_dim=128, n_heads=8, n_kv_heads=2)
  gs = GearSpec(bits=2, group_size=32, buffer=64, sparsity=0.0)
  rng = np.random.default_rng(11)
  mk = lambda t: jnp.asarray(rng.standard_normal((2, t, 2, 128)) * (1 + np.arange(128) / 64),
                             jnp.float32)
  k, v = mk(100), mk(100)
  pos = jnp.asarray(np.where(np.arange(100)[None] < np.array([[100], [70]]), np.arange(100),
                             -1), jnp.int32)
  steps = [(mk(1), mk(1)) for _ in range(36)]
  q = jnp.asarray(rng.standard_normal((2, 1, 8, 128)), jnp.float32)

  def run(layout, k0=k):
    c = GearCache.init(dataclasses.replace(gs, layout=layout), spec, batch=2, capacity=384,
                       dtype=jnp.float32)
    c = _update(c, k0, v, pos)
    lens = np.array([100, 70])
    for k1, v1 in steps:
      c = _update(c, k1, v1, jnp.asarray(lens[:, None], jnp.int32))
      lens = lens + 1
    qp = jnp.asarray(lens[:, None] - 1, jnp.int32)
    out, lse = jax.jit(lambda c, q, p: c.attend(q, p, {}, spec=spec))(c, q, qp)
    return c, out, lse

  warp, out_w, lse_w = run("auto")
  planar, out_p, lse_p = run("planar")
  assert warp.warp and not planar.warp
  assert type(warp.store).__name__ == "KiviMosaic"
  assert [int(x) for x in warp.n_pchunks] == [1, 1] and [int(x) for x in warp.lens] == [136, 106]
  for a, b in zip(warp.dequantized(), planar.dequantized()):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  for f in ("a_k", "a_v", "b_k", "b_v", "bp_k", "bp_v"):
    assert np.array_equal(np.asarray(getattr(warp, f)), np.asarray(getattr(planar, f))), f
  np.testing.assert_allclose(np.asarray(out_w), np.asarray(out_p), atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse_w), np.asarray(lse_p), atol=1e-6)
  assert warp.nbytes_breakdown() == planar.nbytes_breakdown()
  assert warp.nbytes() == sum(warp.nbytes_breakdown().values())
  other, _, _ = run("auto", k0=k * 1.5)
  assert not np.array_equal(np.asarray(other.dequantized()[0]), np.asarray(warp.dequantized()[0]))
  with pytest.raises(ValueError, match="GearSpec.layout='warp'"):
    GearCache.init(GearSpec(layout="warp"), spec, batch=1, capacity=64)
