"""GEAR cache (Kang et al. 2024, Algorithm 1): D^ + S + L over a quantized backbone.

Storage (per layer; the arrays GEAR's decode kernel reads, `kvlowrank_kernels.gear`):
  * store: the backbone's codes D^ = Q(X - S) in a KIVI store (`backbone.py`,
    `GearSpec.layout`): the Mosaic kernel's warp layout (`kivi.mosaic_layout.KiviMosaic`,
    2-bit, g = 32 or 64) where GEAR-L's Mosaic kernel takes the configuration, else the planar
    store (`kvlowrank_kernels.kivi.planar`: keys [B, K, S, R] + scale/zero [B, K, S/Gk, H],
    values token-blocked [B, K, S, R] + scale/zero [B, K, S, H/Gv]);
  * k_win, v_win [B, W, K, H] (cache dtype), W = n_b: GEAR's streaming buffer. Both K and V
    stay exact until n_b tokens accumulate; then the whole chunk is compressed at once
    (outliers, quantization, low-rank), so the compressed prefix `q_lens` [B] int32 is a
    whole number of chunks aligned at multiples of n_b, and window slot i holds position
    q_len + i (i < w_len = len - q_len <= n_b); `lens` [B] int32. After a model decode
    step that completed a chunk, its full window (w_len = n_b) waits for the next step's
    `settle`; otherwise q_len = (len // n_b) n_b;
  * low-rank factors (fp16), left per token, right per chunk:
      a_k, a_v [B, K, S, RA] (RA = max(r_p, r_g); row t = the left factor row of the
      segment that compressed t, zero beyond that segment's rank),
      b_k, b_v [B, K, C, H, r_g] (C = S / n_b: chunk c's right factor),
      bp_k, bp_v [B, K, H, r_p] (the prefill segment's right factor),
      n_pchunks [B] int32: tokens t < n_pchunks n_b use bp with a[t, :r_p], later
      compressed tokens b[t // n_b] with a[t, :r_g];
    so L[t] = a[t] B^T and a decode step adds (q B) a[t] to the scores and
    (sum_t p_t a[t]) B^T to the output; L is never formed as [S, H] (`attend`);
  * sparse outliers (fp16 values + uint8 indices, `outliers.py`): keys per channel per
    chunk sk_idx/sk_val [B, K, C, NK, H] (token within the chunk), values per token
    sv_idx/sv_val [B, K, S, NV] (channel); a written vector's slots are distinct (the
    top / bottom selections are disjoint), which the Triton kernel relies on (it selects
    where slots meet: `kvlowrank_kernels.gear.operands`); unwritten slots hold value 0.
  GEAR-L has no sparse arrays (None), outlier-only no low-rank arrays (None).

Algorithm (per update; one traced path for prefill and decode, ragged rows as KIVI's):
the exact window and the new tokens form E (positions [q0, q0 + Ec)); every chunk of E
that becomes whole is compressed:
  1. S: outliers per vector in the quantization direction, replaced before quantizing
     (`outliers.py`: count, fill and stored value are paper-vs-code choices written there);
  2. D^ = Q_b(X with outliers filled) by the backbone; S = X - D^ (or X) at the outliers;
  3. R = X - D^ - S; per (batch element, KV head), power iteration (`power.py`, Alg. 2):
     the prefill segment -- the chunks compressed by a row's first call that brings it
     more than one token (valid positions, counted per row; nothing compressed before) --
     gets ONE rank-r_p factor over all of them, as Algorithm 1's prefill; every other
     chunk its own rank-r_g factor of that chunk only (never recomputed). A later
     multi-token call (chunked prefill) compresses its chunks as streaming chunks (r_g
     each): evaluate with prefill_chunk = 0 for the paper's single prefill factor.
     Padding (position -1) may sit anywhere in a row: the eviction wrapper
     (`methods.evict`) hands every candidate, admitted ones at consecutive slots.
  Decode steps that complete no chunk skip the compression and write their token into its
  window slot in place (`lax.cond`; E is built only where a chunk completes). KIVI's decode
  flush needs none (it quantizes one group per step, `methods.kivi.cache`); GEAR's chunk
  factor depends on the whole chunk, and compressing it every step with masked writes was
  slower (`results/decode_ablations.md`): the power iteration is not small.
  The model's decode steps (`kvlowrank.model.forward` at T = 1, so `generate`; and
  `model.segments`' one-token calls, so decode-mode perplexity and the drift metric) defer
  it instead (`deferring`): each layer writes its token into
  the window, no conditional, and the next decode step starts with one `lax.cond` (`settle`,
  via `cache.base.settle_step`) that compresses every layer's full window. The per-layer
  conditionals were slower than one per step (measured: `results/gear_kernel.md`, "One
  conditional per decode step"). Choice: the token that completes
  a chunk is attended with its chunk still exact, and the layers above compute its K/V over
  that exact buffer -- Algorithm 1 as written (the full buffer is compressed before the next
  token); the per-layer path (direct `update` calls, multi-token calls) compresses it within
  the step, before attention, and compresses a chunk left waiting by a decode step as the
  streaming chunk `settle` would have made of it.
GQA: compressed per KV head. Attention (prefill and decode) follows the update, so a
query sees the tokens of its own call compressed once their chunk is whole (GEAR prefill
attends exact K/V; here prompt queries see the compressed cache, as the KIVI cache does:
a one-pass perplexity then measures the compression error).

Decode path: a decode step (T = 1) on a GPU runs a kernel on the cache's arrays as stored:
on the warp layout (Hopper) `kvlowrank_kernels.gear.gear_attention_mosaic` (the Mosaic KIVI
warp kernel with GEAR-L's low-rank terms as its extra MMAs), on the planar store
`gear_attention`'s Triton kernel (the Triton KIVI planar kernel with its GEAR terms:
outliers and the factored low rank added inside the dequantized tiles, never in HBM);
anything else (CPU, prefill, shapes the kernels' plans refuse) runs the jnp reference below,
the reason logged once (`cache.dispatch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp

from kvlowrank.cache import base, dispatch
from kvlowrank.methods.gear import outliers, power
from kvlowrank.methods.gear.backbone import StoreBackbone, make_backbone
from kvlowrank.methods.gear.spec import GearSpec
from kvlowrank.model.attention import (SCORE_ELEMENTS, attention_mask, combine,
                                       dot_product_attention, masked_softmax_lse)
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import gear as gear_kernels
from kvlowrank_kernels.kivi import store as kstore

_HI = jax.lax.Precision.HIGHEST
# Jitted so that the layers' identical kernel calls are lowered once per model.
_kernel_attention = jax.jit(gear_kernels.gear_attention,
                            static_argnames=("scale", "out_dtype", "implementation"))
_mosaic_attention = jax.jit(gear_kernels.gear_attention_mosaic,
                            static_argnames=("chunk", "scale", "out_dtype"))
F16 = jnp.float16


_rows, _scatter_rows = base.gather_rows, base.scatter_rows


def _scatter_axis2(buf, first, ok, vals):
  """buf [B, K, N, ...] at [b, :, first[b] + m] <- vals [B, M, K, ...] where ok [B, M]."""
  m = vals.shape[1]
  idx = jnp.where(ok, first[:, None] + jnp.arange(m)[None, :], buf.shape[2])
  return buf.at[jnp.arange(buf.shape[0])[:, None], :, idx].set(vals.astype(buf.dtype),
                                                                mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GearCache(base.KVCache):
  store: Any                 # the backbone's D^: kivi.store.PlanarStore or mosaic_layout.KiviMosaic
  k_win: jax.Array           # [B, W, K, H] exact streaming buffer (slot i = q_len + i)
  v_win: jax.Array
  lens: jax.Array            # [B] int32
  q_lens: jax.Array          # [B] int32: the compressed prefix (whole chunks)
  n_pchunks: jax.Array       # [B] int32
  a_k: Optional[jax.Array]   # [B, K, S, RA] fp16
  a_v: Optional[jax.Array]
  b_k: Optional[jax.Array]   # [B, K, C, H, r_g] fp16
  b_v: Optional[jax.Array]
  bp_k: Optional[jax.Array]  # [B, K, H, r_p] fp16
  bp_v: Optional[jax.Array]
  sk_idx: Optional[jax.Array]   # [B, K, C, NK, H] uint8
  sk_val: Optional[jax.Array]   # [B, K, C, NK, H] fp16
  sv_idx: Optional[jax.Array]   # [B, K, S, NV] uint8
  sv_val: Optional[jax.Array]   # [B, K, S, NV] fp16
  backbone: StoreBackbone = base.static_field(default=None)
  rank_prefill: int = base.static_field(default=4)
  rank_chunk: int = base.static_field(default=2)
  k_counts: tuple = base.static_field(default=(0, 0))   # (top, bottom) per key channel
  v_counts: tuple = base.static_field(default=(0, 0))   # (top, bottom) per value token
  iterations: int = base.static_field(default=3)
  seed: int = base.static_field(default=0)
  outlier_fill: str = base.static_field(default="mean")
  sliding_window: Optional[int] = base.static_field(default=None)
  implementation: Optional[str] = base.static_field(default=None)
  defer: bool = base.static_field(default=False)   # `deferring`: set by the model's decode step

  name = "gear"

  def shard_axes(self) -> dict:
    """Every array splits by KV head (`base.KVCache.shard_axes`): the backbone's codes and
    scales and every GEAR array are [B, K, ...], the streaming window [B, W, K, H]. The
    power iteration's seeded start B0 is shared by every (batch row, head), so a device's
    factors of its heads are the single device's."""
    return {".store": (0, 1), ".k_win": (0, 2), ".v_win": (0, 2), ".lens": (0, None),
            ".q_lens": (0, None), ".n_pchunks": (0, None), ".a_k": (0, 1), ".a_v": (0, 1),
            ".b_k": (0, 1), ".b_v": (0, 1), ".bp_k": (0, 1), ".bp_v": (0, 1),
            ".sk_idx": (0, 1), ".sk_val": (0, 1), ".sv_idx": (0, 1), ".sv_val": (0, 1)}

  @classmethod
  def init(cls, gspec: GearSpec, spec: ModelSpec, *, batch: int, capacity: int,
           dtype=jnp.bfloat16):
    """An empty cache for `capacity` positions (rounded up to the store's multiple)."""
    h, kh, nb = spec.head_dim, spec.n_kv_heads, gspec.buffer
    gspec.check_model(h)
    bb = make_backbone(gspec, h)
    m = bb.capacity_multiple(nb)
    s = -(-capacity // m) * m
    c = s // nb
    rp, rg = gspec.rank_prefill, gspec.rank_chunk
    ra = max(rp, rg)
    kc, vc = outliers.counts(gspec.sparsity, nb), outliers.counts(gspec.sparsity, h)
    nk, nv = sum(kc), sum(vc)
    z = jnp.zeros
    opt = lambda cond, shape, dt: (z(shape, dt), z(shape, dt)) if cond else (None, None)
    a_k, a_v = opt(ra > 0, (batch, kh, s, ra), F16)
    b_k, b_v = opt(rg > 0, (batch, kh, c, h, rg), F16)
    bp_k, bp_v = opt(rp > 0, (batch, kh, h, rp), F16)
    sparse = gspec.sparsity > 0
    return cls(
        store=bb.empty(batch=batch, kv_heads=kh, capacity=s, head_dim=h),
        k_win=z((batch, nb, kh, h), dtype), v_win=z((batch, nb, kh, h), dtype),
        lens=z((batch,), jnp.int32), q_lens=z((batch,), jnp.int32),
        n_pchunks=z((batch,), jnp.int32),
        a_k=a_k, a_v=a_v, b_k=b_k, b_v=b_v, bp_k=bp_k, bp_v=bp_v,
        sk_idx=z((batch, kh, c, nk, h), jnp.uint8) if sparse else None,
        sk_val=z((batch, kh, c, nk, h), F16) if sparse else None,
        sv_idx=z((batch, kh, s, nv), jnp.uint8) if sparse else None,
        sv_val=z((batch, kh, s, nv), F16) if sparse else None,
        backbone=bb, rank_prefill=rp, rank_chunk=rg, k_counts=kc, v_counts=vc,
        iterations=gspec.iterations, seed=gspec.seed, outlier_fill=gspec.outlier_fill,
        sliding_window=spec.sliding_window, implementation=gspec.implementation)

  # ------------------------------------------------------------------ shapes
  @property
  def capacity(self) -> int:
    return kstore.capacity(self.store)

  @property
  def warp(self) -> bool:
    """The backbone is stored in the Mosaic kernel's warp layout (`GearSpec.layout`)."""
    return self.backbone.layout == "warp"

  @property
  def lengths(self):
    return self.lens

  @property
  def buffer(self) -> int:
    return self.k_win.shape[1]

  @property
  def sparse(self) -> bool:
    return self.sk_idx is not None

  def segments(self):
    """(q_len [B], w_len [B]): the compressed prefix [0, q_len) (whole chunks) and the live
    window slots [0, w_len) holding positions [q_len, len)."""
    return self.q_lens, self.lens - self.q_lens

  # ------------------------------------------------------------------ update
  def update(self, inputs: base.AttnInputs, lp):
    del lp
    nb, cap = self.buffer, self.capacity
    b, t = inputs.positions.shape
    pos = jnp.where((inputs.positions >= 0) & (inputs.positions < cap), inputs.positions, -1)
    l0, q0 = self.lens, self.q_lens
    l1 = base.new_lengths(l0, pos)
    # Deferring (a decode step): compress only what the window cannot hold; `settle` does
    # the rest. T > 1 here too: the eviction wrapper's decode step hands its inner cache
    # W + 1 candidates, at most one admitted (`methods.evict`; `test_gear`'s deferred test).
    if self.defer:
      q1 = jnp.maximum(q0, -(-(l1 - nb) // nb) * nb)
    else:
      q1 = (l1 // nb) * nb
    ec = -(-(nb + t) // nb) * nb       # E: positions [q0, q0 + ec)
    slot = pos - q0[:, None]

    def window(win, new):
      e = jnp.zeros((b, ec) + win.shape[2:], win.dtype).at[:, :nb].set(win)
      return _scatter_rows(e, slot, pos >= 0, new)

    # A row's prefill: its first call that brings it > 1 token and compresses a chunk
    # (counted per row: a one-token step padded to T > 1 is a decode step), unless its
    # window holds a whole chunk that decode steps completed (left for `settle`): that chunk
    # is a streaming chunk, as `settle` would have compressed it.
    n_new = jnp.sum(pos >= 0, axis=1)
    prefill_row = ((q0 == 0) & (q1 > 0) & (n_new > 1) & (l0 - q0 < nb) if t > 1
                   else jnp.zeros((b,), bool))

    def compress(c):  # E = [window; new tokens], its whole chunks compressed, the rest kept
      ek, ev = window(c.k_win, inputs.k), window(c.v_win, inputs.v)
      c = c._compress(ek, ev, q0, q1, prefill_row, t > 1)
      idx = (q1 - q0)[:, None] + jnp.arange(nb)[None, :]
      return dataclasses.replace(c, k_win=_rows(ek, idx), v_win=_rows(ev, idx))

    def append(c):  # no row completes a chunk: each new token goes to its window slot
      return dataclasses.replace(c, k_win=_scatter_rows(c.k_win, slot, pos >= 0, inputs.k),
                                 v_win=_scatter_rows(c.v_win, slot, pos >= 0, inputs.v))

    if self.defer and t == 1:
      # The model's decode step (`deferring`): the window, settled at the step's start, has
      # room for the token; a chunk it completes waits there, exact, for the next `settle`.
      return dataclasses.replace(append(self), lens=l1)
    # Most decode steps complete no chunk: they write one token in place, without E.
    new = jax.lax.cond(jnp.any(q1 > q0), compress, append, self)
    return dataclasses.replace(new, lens=l1, q_lens=q1)

  def deferring(self, on: bool) -> "GearCache":
    return dataclasses.replace(self, defer=on)

  def _full_windows(self):
    """[B] bool: the row's window holds a whole chunk, left by a deferred update."""
    return self.lens - self.q_lens >= self.buffer

  def pending(self):
    return jnp.any(self._full_windows())

  def settle(self) -> "GearCache":
    """Compresses each full window (a whole chunk, positions [q_len, q_len + n_b)) as the
    update would have: a streaming chunk (rank r_g), never a prefill segment."""
    nb, b = self.buffer, self.lens.shape[0]
    q1 = self.q_lens + jnp.where(self._full_windows(), nb, 0)
    c = self._compress(self.k_win, self.v_win, self.q_lens, q1, jnp.zeros((b,), bool),
                       multi=False)
    return dataclasses.replace(c, q_lens=q1)

  def _compress(self, ek, ev, q0, q1, prefill_row, multi: bool):
    """Compresses the chunks of E = positions [q0, q0 + Ec) that lie below q1; `multi`
    (static): the call had T > 1 tokens, so rows in `prefill_row` form a prefill segment."""
    b, ec, kh, h = ek.shape
    nb, bb = self.buffer, self.backbone
    nch = ec // nb
    due = q0[:, None] + jnp.arange(ec)[None, :] < q1[:, None]          # [B, Ec]
    chunk_due = due.reshape(b, nch, nb)[..., 0]                         # [B, nch]
    xk, xv = ek.astype(jnp.float32), ev.astype(jnp.float32)
    upd = {}
    # 1. outliers: keys per channel of a chunk, values per token of a head.
    if self.sparse:
      kch = jnp.transpose(xk.reshape(b, nch, nb, kh, h), (0, 1, 3, 4, 2))  # [B,nch,K,H,nb]
      ik, mk = outliers.select(kch, *self.k_counts)
      to_tok = lambda a: jnp.transpose(a, (0, 1, 4, 2, 3)).reshape(b, ec, kh, h)
      kfill, mask_k = to_tok(outliers.fill(kch, mk, self.outlier_fill)), to_tok(mk)
      iv, mask_v = outliers.select(xv, *self.v_counts)                  # [B,Ec,K,NV]
      vfill = outliers.fill(xv, mask_v, self.outlier_fill)
    else:
      kfill, vfill = xk, xv
    # 2. backbone quantization of the outlier-free chunk.
    kq, vq = bb.quantize_keys(kfill), bb.quantize_values(vfill)
    rk, rv = xk - kq[3], xv - vq[3]
    if self.sparse:
      sk = outliers.stored_values(xk, kq[3], self.outlier_fill)          # dense fp16
      sv = outliers.stored_values(xv, vq[3], self.outlier_fill)
      rk = rk - jnp.where(mask_k, sk.astype(jnp.float32), 0.0)
      rv = rv - jnp.where(mask_v, sv.astype(jnp.float32), 0.0)
      skc = jnp.transpose(sk.reshape(b, nch, nb, kh, h), (0, 1, 3, 4, 2))
      sk_val = jnp.take_along_axis(skc, ik, axis=-1)                     # [B,nch,K,H,NK]
      c0 = q0 // nb
      to_store = lambda a: jnp.swapaxes(a, -1, -2)                       # [B,nch,K,NK,H]
      upd["sk_idx"] = _scatter_axis2(self.sk_idx, c0, chunk_due, to_store(ik))
      upd["sk_val"] = _scatter_axis2(self.sk_val, c0, chunk_due, to_store(sk_val))
      upd["sv_idx"] = _scatter_axis2(self.sv_idx, q0, due, iv)
      upd["sv_val"] = _scatter_axis2(self.sv_val, q0, due, jnp.take_along_axis(sv, iv, -1))
    upd["store"] = bb.write(self.store, q0, due, kq, vq)
    # 3. low-rank factors of the residual, per (batch element, KV head).
    if self.a_k is not None:
      upd.update(self._low_rank(rk, rv, q0, due, chunk_due, prefill_row, multi))
    upd["n_pchunks"] = jnp.where(prefill_row, q1 // nb, self.n_pchunks)
    return dataclasses.replace(self, **upd)

  def _low_rank(self, rk, rv, q0, due, chunk_due, prefill_row, multi):
    b, ec, kh, h = rk.shape
    nb, rp, rg = self.buffer, self.rank_prefill, self.rank_chunk
    ra = self.a_k.shape[-1]
    nch = ec // nb
    kw = dict(seed=self.seed, iterations=self.iterations)
    heads = lambda r: jnp.transpose(r, (0, 2, 1, 3))                     # [B, K, Ec, H]
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, ra - a.shape[-1])])
    out = {}
    for name, r in (("k", rk), ("v", rv)):
      rows = jnp.zeros((b, kh, ec, ra), jnp.float32)
      if rg:
        chunks = heads(r).reshape(b, kh, nch, nb, h)
        a_c, b_c = power.factor(chunks, rg, **kw)                       # [B,K,nch,nb,rg]
        rows = pad(a_c.reshape(b, kh, ec, rg))
        ok = chunk_due & ~prefill_row[:, None]
        out[f"b_{name}"] = _scatter_axis2(getattr(self, f"b_{name}"), q0 // nb, ok,
                                          jnp.swapaxes(b_c, 1, 2))
      if rp and multi:
        mask = jnp.broadcast_to(due[:, None, :], (b, kh, ec))
        a_p, b_p = power.factor(heads(r), rp, row_mask=mask, **kw)       # [B,K,Ec,rp]
        rows = jnp.where(prefill_row[:, None, None, None], pad(a_p), rows)
        out[f"bp_{name}"] = jnp.where(prefill_row[:, None, None, None], b_p.astype(F16),
                                      getattr(self, f"bp_{name}"))
      out[f"a_{name}"] = _scatter_axis2(getattr(self, f"a_{name}"), q0, due,
                                        jnp.swapaxes(rows, 1, 2))
    return out

  # ------------------------------------------------------------------ reading
  def dequantized(self):
    """(D^_k + S_k, D^_v + S_v) float32 [B, S, K, H] of every slot: the backbone's
    dequantized store with the sparse outliers scattered in (the contract lets a kernel
    add S inside its dequantized tiles the same way)."""
    k, v = self.backbone.dequantize(self.store, self.k_win.shape[-1])
    if not self.sparse:
      return k, v
    b, kh, c, nk, h = self.sk_idx.shape
    nb, s = self.buffer, self.capacity
    ix = lambda n, ax, nd: jnp.arange(n).reshape([n if i == ax else 1 for i in range(nd)])
    sk = jnp.zeros((b, kh, c, nb, h), jnp.float32).at[
        ix(b, 0, 5), ix(kh, 1, 5), ix(c, 2, 5), self.sk_idx.astype(jnp.int32),
        ix(h, 4, 5)].add(self.sk_val.astype(jnp.float32))
    sv = jnp.zeros((b, kh, s, h), jnp.float32).at[
        ix(b, 0, 4), ix(kh, 1, 4), ix(s, 2, 4), self.sv_idx.astype(jnp.int32)].add(
            self.sv_val.astype(jnp.float32))
    k = k + jnp.transpose(sk.reshape(b, kh, s, h), (0, 2, 1, 3))
    return k, v + jnp.transpose(sv, (0, 2, 1, 3))

  def _prefill_mask(self):
    """[B, S] bool: slot t is covered by the prefill factor (t < n_pchunks n_b)."""
    return jnp.arange(self.capacity)[None, :] < (self.n_pchunks * self.buffer)[:, None]

  def low_rank_dense(self, which: str):
    """L [B, S, K, H] float32 of every slot (k or v): a TEST ORACLE only (`materialize`);
    attention never forms it."""
    a, b_c, b_p = (getattr(self, f"{p}_{which}") for p in ("a", "b", "bp"))
    b, kh, s = self.lens.shape[0], self.k_win.shape[2], self.capacity
    h, nb = self.k_win.shape[-1], self.buffer
    out = jnp.zeros((b, kh, s, h), jnp.float32)
    if a is None:
      return jnp.transpose(out, (0, 2, 1, 3))
    a = a.astype(jnp.float32)
    if b_c is not None:
      rg = b_c.shape[-1]
      ac = a[..., :rg].reshape(b, kh, s // nb, nb, rg)
      out = jnp.einsum("bkcnr,bkchr->bkcnh", ac, b_c.astype(jnp.float32),
                       precision=_HI).reshape(b, kh, s, h)
    if b_p is not None:
      rp = b_p.shape[-1]
      lp = jnp.einsum("bksr,bkhr->bksh", a[..., :rp], b_p.astype(jnp.float32), precision=_HI)
      out = jnp.where(self._prefill_mask()[:, None, :, None], lp, out)
    return jnp.transpose(out, (0, 2, 1, 3))

  def materialize(self):
    """(k, v [B, S, K, H] as attention sees them, valid [B, S]): D^ + S + L for the
    compressed tokens, the exact window after them -- test oracle."""
    q_len, _ = self.segments()
    k_hat, v_hat = self.dequantized()
    k_hat = k_hat + self.low_rank_dense("k")
    v_hat = v_hat + self.low_rank_dense("v")
    b, s = k_hat.shape[:2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    w_idx = jnp.clip(s_pos - q_len[:, None], 0, self.buffer - 1)
    comp = (s_pos < q_len[:, None])[..., None, None]
    k = jnp.where(comp, k_hat, _rows(self.k_win, w_idx).astype(jnp.float32))
    v = jnp.where(comp, v_hat, _rows(self.v_win, w_idx).astype(jnp.float32))
    return k.astype(self.k_win.dtype), v.astype(self.k_win.dtype), s_pos < self.lens[:, None]

  def kernel_operands(self):
    """(lowrank, sparse_k, sparse_v) operand groups of `gear_attention` (None if absent)."""
    lowrank = None
    if all(x is not None for x in (self.a_k, self.b_k, self.bp_k)):
      lowrank = gear_kernels.GearLowRank(a_k=self.a_k, a_v=self.a_v, b_k=self.b_k,
                                         b_v=self.b_v, bp_k=self.bp_k, bp_v=self.bp_v,
                                         n_pchunks=self.n_pchunks)
    sk = sv = None
    if self.sparse:
      sk = gear_kernels.GearSparseKeys(idx=self.sk_idx, val=self.sk_val)
      sv = gear_kernels.GearSparseValues(idx=self.sv_idx, val=self.sv_val)
    return lowrank, sk, sv

  def kernel_candidates(self, q_shape):
    """The GEAR kernels for a query [B, N, H] (fastest first) with their fit checks: the
    Mosaic GEAR-L kernel on the warp layout, the Triton kernel on planar."""
    def fit(check):
      def go():
        if self.k_win.dtype not in (jnp.bfloat16, jnp.float16):
          return f"{jnp.dtype(self.k_win.dtype).name} cache (the kernels take bf16/fp16)"
        if (self.a_k is not None) != (self.b_k is not None and self.bp_k is not None):
          return "a low-rank residual of rank 0 in the prefill or the chunks"
        return check()
      return go

    lowrank, sk, sv = self.kernel_operands()
    if self.warp:
      mosaic = lambda: gear_kernels.mosaic_fit(q_shape, self.store, lowrank, self.buffer,
                                               sparse=self.sparse)
      triton = lambda: "the backbone is stored in the warp layout"
    else:
      mosaic = lambda: "the backbone is stored in the planar layout"
      triton = lambda: gear_kernels.triton_fit(q_shape, self.store.keys, self.store.values,
                                               self.buffer, lowrank, sk, sv)
    return [("mosaic", "hopper", fit(mosaic)), ("triton", "gpu", fit(triton))]

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    del lp, spec
    impl = self.decode_implementation(q.shape, implementation)
    q_len, w_len = self.segments()
    if impl == "mosaic":
      lowrank, _, _ = self.kernel_operands()
      out, lse = _mosaic_attention(q[:, 0], self.store, self.k_win, self.v_win, q_len, w_len,
                                   lowrank, chunk=self.buffer, scale=q.shape[-1] ** -0.5,
                                   out_dtype=q.dtype)
      return base.mask_padding_queries(out[:, None], lse[:, None], q_positions, q.dtype)
    if impl != dispatch.REFERENCE:
      lowrank, sk, sv = self.kernel_operands()
      out, lse = _kernel_attention(
          q[:, 0], self.store.keys, self.store.values, self.k_win, self.v_win, q_len, w_len,
          lowrank=lowrank, sparse_k=sk, sparse_v=sv, scale=q.shape[-1] ** -0.5,
          out_dtype=q.dtype, implementation=impl)
      return base.mask_padding_queries(out[:, None], lse[:, None], q_positions, q.dtype)
    b, t, n, h = q.shape
    k_eff, v_eff = self.dequantized()
    kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_eff, v_eff))   # [B, K, S, H]
    s = kt.shape[2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = s_pos < q_len[:, None]
    chunk = max(1, SCORE_ELEMENTS // max(1, b * n * s))
    if t <= chunk:
      comp = self._attend_compressed(q, q_positions, kt, vt, s_pos, valid)
    else:
      n_chunks = -(-t // chunk)
      pad = n_chunks * chunk - t
      qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
      pp = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)
      split = lambda a: jnp.moveaxis(a.reshape(b, n_chunks, chunk, *a.shape[2:]), 1, 0)
      o, l = jax.lax.map(lambda xs: self._attend_compressed(xs[0], xs[1], kt, vt, s_pos,
                                                            valid), (split(qp), split(pp)))
      merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n_chunks * chunk, *a.shape[3:])[:, :t]
      comp = (merge(o), merge(l))
    w_pos = q_len[:, None] + jnp.arange(self.buffer)[None, :]
    w_valid = jnp.arange(self.buffer)[None, :] < w_len[:, None]
    exact = dot_product_attention(q, self.k_win, self.v_win, q_positions, w_pos, w_valid,
                                  sliding_window=self.sliding_window, out_dtype=jnp.float32)
    return combine([comp, exact], out_dtype=q.dtype)

  def _attend_compressed(self, q, q_pos, kt, vt, s_pos, valid):
    """Attention of q [B, T, N, H] over the compressed tokens, factored: scores
    q (D^ + S)^T + (q B) a^T, output p (D^ + S) + (p a) B^T. Returns (out f32, lse)."""
    b, t, n, h = q.shape
    kh, s = kt.shape[1], kt.shape[2]
    g, nb = n // kh, self.buffer
    qg = q.reshape(b, t, kh, g, h).astype(jnp.float32).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,H]
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, kt, precision=_HI)
    pre = self._prefill_mask()[:, None, None, None, :]                        # [B,1,1,1,S]
    if self.a_k is not None:
      scores = scores + self._low_rank_scores(qg, pre)
    mask = attention_mask(q_pos, s_pos, valid, self.sliding_window)[:, None, None]
    probs, lse = masked_softmax_lse(scores * h ** -0.5, mask)
    out = jnp.einsum("bkgts,bksh->bkgth", probs, vt, precision=_HI)
    if self.a_v is not None:
      a = self.a_v.astype(jnp.float32)
      if self.bp_v is not None:
        rp = self.bp_v.shape[-1]
        pa = jnp.einsum("bkgts,bksr->bkgtr", jnp.where(pre, probs, 0.0), a[..., :rp],
                        precision=_HI)
        out = out + jnp.einsum("bkgtr,bkhr->bkgth", pa, self.bp_v.astype(jnp.float32),
                               precision=_HI)
      if self.b_v is not None:
        rg = self.b_v.shape[-1]
        pc = jnp.where(pre, 0.0, probs).reshape(b, kh, g, t, s // nb, nb)
        pa = jnp.einsum("bkgtcn,bkcnr->bkgtcr", pc, a[..., :rg].reshape(b, kh, s // nb, nb, rg),
                        precision=_HI)
        out = out + jnp.einsum("bkgtcr,bkchr->bkgth", pa, self.b_v.astype(jnp.float32),
                               precision=_HI)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return out, lse.transpose(0, 3, 1, 2).reshape(b, t, n)

  def _low_rank_scores(self, qg, pre):
    """(q B) a[t]^T for every slot t: [B, K, G, T, S] (never forms L)."""
    b, kh, g, t, _ = qg.shape
    s, nb = self.capacity, self.buffer
    a = self.a_k.astype(jnp.float32)
    out = jnp.zeros((b, kh, g, t, s), jnp.float32)
    if self.b_k is not None:
      rg = self.b_k.shape[-1]
      qb = jnp.einsum("bkgth,bkchr->bkgtcr", qg, self.b_k.astype(jnp.float32), precision=_HI)
      out = jnp.einsum("bkgtcr,bkcnr->bkgtcn", qb,
                       a[..., :rg].reshape(b, kh, s // nb, nb, rg),
                       precision=_HI).reshape(b, kh, g, t, s)
    if self.bp_k is not None:
      rp = self.bp_k.shape[-1]
      qb = jnp.einsum("bkgth,bkhr->bkgtr", qg, self.bp_k.astype(jnp.float32), precision=_HI)
      lp = jnp.einsum("bkgtr,bksr->bkgts", qb, a[..., :rp], precision=_HI)
      out = jnp.where(pre, lp, out)
    return out

  # ------------------------------------------------------------------ bytes
  def nbytes_breakdown(self) -> dict[str, int]:
    """Allocated bytes by role (sums to `nbytes()`): sparse indices and factors counted."""
    size = lambda *xs: int(sum(x.size * x.dtype.itemsize for x in xs if x is not None))
    st = self.store
    if self.warp:   # ks / vs hold a scale and a zero point per group (`mosaic_layout`)
      codes, sz = size(st.kc, st.vc), size(st.ks, st.vs)
    else:
      codes = size(st.keys.codes, st.values.codes)
      sz = size(st.keys.scale, st.values.scale, st.keys.zero, st.values.zero)
    return {"codes": codes, "scales": sz // 2,
            "zeros": sz // 2, "window": size(self.k_win, self.v_win),
            "low_rank_left": size(self.a_k, self.a_v),
            "low_rank_right": size(self.b_k, self.b_v, self.bp_k, self.bp_v),
            "sparse_values": size(self.sk_val, self.sv_val),
            "sparse_indices": size(self.sk_idx, self.sv_idx),
            "lengths": size(self.lens, self.q_lens, self.n_pchunks)}

  def bytes_per_token(self) -> float:
    """Asymptotic bytes per cached token (this layer): everything that grows with the
    capacity (codes, scales/zeros, left factors, per-chunk right factors, sparse values
    and indices); the window, the prefill factor and the lengths are O(1) and excluded."""
    p = self.nbytes_breakdown()
    fixed = {"window", "lengths"}
    grow = sum(v for k, v in p.items() if k not in fixed)
    grow -= sum(x.size * x.dtype.itemsize for x in (self.bp_k, self.bp_v) if x is not None)
    return grow / (self.lens.shape[0] * self.capacity)


@base.register_cache("gear")
def _make_gear(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  del params
  if method_spec is None:
    method_spec = GearSpec()
  elif isinstance(method_spec, Mapping):
    method_spec = GearSpec(**method_spec)
  elif not isinstance(method_spec, GearSpec):
    raise ValueError(f"gear cache needs a GearSpec, got {type(method_spec).__name__}")
  return tuple(GearCache.init(method_spec, spec, batch=batch, capacity=capacity, dtype=dtype)
               for _ in range(spec.n_layers))
