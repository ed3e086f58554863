"""Plain-jnp float32 reference for GEAR decode attention (`operands` for the layout).

Exactly dense attention (scale 1/sqrt(H) by default, GQA) over the q_len[b] reconstructed
tokens K~ = D^_k + S_k + L_k, V~ = D^_v + S_v + L_v, then the w_len[b] exact window tokens,
combined by their log-sum-exp like `kivi.reference`. The low-rank terms stay factored (no
[S, H] low-rank matrix is built):
  scores[t] = q . (D^_k + S_k)[t] + (q B) . a_k[t]        (B = bp_k or b_k[t // NB])
  out       = sum_t p_t (D^_v + S_v)[t] + (sum_{t in prefill} p_t a_v[t, :RP]) bp_v^T
              + sum_c (sum_{t in c} p_t a_v[t, :RG]) b_v[c]^T.
The sparse terms are scattered into the float32 dequantized D^ (which the KIVI reference
builds anyway).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.splitk import combine_partials
from ..dense.reference import decode_attention_reference, masked_softmax
from ..kivi.planar import KiviKeys, KiviValues, dequantize_keys, dequantize_values
from ..kivi.reference import check_shapes
from .operands import GearLowRank, GearSparseKeys, GearSparseValues, check_operands

HI = jax.lax.Precision.HIGHEST


def add_key_outliers(kf, sparse_k: GearSparseKeys):
  """kf [B, S, K, H] float32 + the key outliers (scatter-add)."""
  b, s, kh, h = kf.shape
  _, _, c, nk, _ = sparse_k.idx.shape
  nb = s // c
  tok = (jnp.arange(c)[:, None, None] * nb + sparse_k.idx.astype(jnp.int32))  # [B,K,C,NK,H]
  bi = jnp.arange(b)[:, None, None, None, None]
  ki = jnp.arange(kh)[None, :, None, None, None]
  ci = jnp.arange(h)[None, None, None, None, :]
  return kf.at[bi, tok, ki, ci].add(sparse_k.val.astype(jnp.float32))


def add_value_outliers(vf, sparse_v: GearSparseValues):
  """vf [B, S, K, H] float32 + the value outliers (scatter-add)."""
  b, s, kh, _ = vf.shape
  bi = jnp.arange(b)[:, None, None, None]
  ki = jnp.arange(kh)[None, :, None, None]
  ti = jnp.arange(s)[None, None, :, None]
  return vf.at[bi, ti, ki, sparse_v.idx.astype(jnp.int32)].add(sparse_v.val.astype(jnp.float32))


def _prefill_tokens(lr: GearLowRank, s: int):
  """[B, S] bool: token t lies in the prefill segment."""
  nb = s // lr.n_chunks
  return (jnp.arange(s) // nb)[None, :] < lr.n_pchunks[:, None]


def lowrank_scores(qf, lr: GearLowRank):
  """(q B) . a_k[t]: [B, K, G, S] float32 from qf [B, K, G, H]."""
  b, kh, s, _ = lr.a_k.shape
  c, rp, rg = lr.n_chunks, lr.prefill_rank, lr.chunk_rank
  a = lr.a_k.astype(jnp.float32)
  qbp = jnp.einsum("bkgh,bkhr->bkgr", qf, lr.bp_k.astype(jnp.float32), precision=HI)
  qbc = jnp.einsum("bkgh,bkchr->bkgcr", qf, lr.b_k.astype(jnp.float32), precision=HI)
  sp = jnp.einsum("bkgr,bksr->bkgs", qbp, a[..., :rp], precision=HI)
  sc = jnp.einsum("bkgcr,bkcnr->bkgcn", qbc, a[..., :rg].reshape(b, kh, c, s // c, rg),
                  precision=HI).reshape(sp.shape)
  return jnp.where(_prefill_tokens(lr, s)[:, None, None, :], sp, sc)


def lowrank_values(p, lr: GearLowRank):
  """(sum_t p_t a_v[t]) B^T per segment: [B, K, G, H] float32 from p [B, K, G, S]."""
  b, kh, s, ra = lr.a_v.shape
  c, rp, rg = lr.n_chunks, lr.prefill_rank, lr.chunk_rank
  g = p.shape[2]
  pac = jnp.einsum("bkgcn,bkcnr->bkgcr", p.reshape(b, kh, g, c, s // c),
                   lr.a_v.astype(jnp.float32).reshape(b, kh, c, s // c, ra), precision=HI)
  pre = (jnp.arange(c)[None, :] < lr.n_pchunks[:, None])[:, None, None, :, None]  # [B,1,1,C,1]
  pp = jnp.sum(jnp.where(pre, pac, 0.0), axis=3)[..., :rp]
  ps = jnp.where(pre, 0.0, pac)[..., :rg]
  return (jnp.einsum("bkgr,bkhr->bkgh", pp, lr.bp_v.astype(jnp.float32), precision=HI)
          + jnp.einsum("bkgcr,bkchr->bkgh", ps, lr.b_v.astype(jnp.float32), precision=HI))


def check_gear_shapes(q, keys, values, k_win, v_win, q_len, w_len, lowrank, sparse_k, sparse_v):
  """The KIVI checks plus the residual operands' (ValueError naming the field)."""
  check_shapes(q, keys, values, k_win, v_win, q_len, w_len)
  b, _, h = q.shape
  _, kh, s, _ = keys.codes.shape
  for name, x, cls in (("lowrank", lowrank, GearLowRank), ("sparse_k", sparse_k, GearSparseKeys),
                       ("sparse_v", sparse_v, GearSparseValues)):
    if x is not None and not isinstance(x, cls):
      raise ValueError(f"gear: {name} must be a {cls.__name__} or None, got {type(x).__name__}")
  check_operands(b, kh, s, h, lowrank, sparse_k, sparse_v)


def gear_attention_reference(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len,
                             *, lowrank=None, sparse_k=None, sparse_v=None, scale=None,
                             out_dtype=None):
  """GEAR decode attention in float32.

  Args:
    q: [B, N, H] decode query (RoPE applied).
    keys, values: the KIVI planar store of D^ (capacity S).
    k_win, v_win: [B, W, K, H] exact window; q_len, w_len: [B] token counts.
    lowrank, sparse_k, sparse_v: `operands` groups or None.
    scale: default H ** -0.5; out_dtype: default q.dtype.
  Returns:
    (out [B, N, H], lse [B, N] float32).
  """
  check_gear_shapes(q, keys, values, k_win, v_win, q_len, w_len, lowrank, sparse_k, sparse_v)
  b, n, h = q.shape
  _, kh, s, _ = keys.codes.shape
  scale = h ** -0.5 if scale is None else scale
  kf = dequantize_keys(keys, h)
  vf = dequantize_values(values, h)
  if sparse_k is not None:
    kf = add_key_outliers(kf, sparse_k)
  if sparse_v is not None:
    vf = add_value_outliers(vf, sparse_v)
  qf = q.astype(jnp.float32).reshape(b, kh, n // kh, h)
  scores = jnp.einsum("bkgh,bskh->bkgs", qf, kf, precision=HI)
  if lowrank is not None:
    scores = scores + lowrank_scores(qf, lowrank)
  scores = scores * scale
  valid = (jnp.arange(s)[None, :] < q_len[:, None])[:, None, None, :]
  p, l1 = masked_softmax(scores, valid)
  o1 = jnp.einsum("bkgs,bskh->bkgh", p, vf, precision=HI)
  if lowrank is not None:
    o1 = o1 + lowrank_values(p, lowrank)
  o1, l1 = o1.reshape(b, n, h), l1.reshape(b, n)
  o2, l2 = decode_attention_reference(q, k_win, v_win, w_len, scale=scale, out_dtype=jnp.float32)
  return combine_partials(jnp.stack([o1, o2], axis=-2), jnp.stack([l1, l2], axis=-1),
                          out_dtype or q.dtype)
