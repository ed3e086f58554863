"""Masked dot-product attention with log-sum-exp output, and the segment combine.

This is the dense reference every cache's `attend` is tested against. Keys are
addressed by *position*: slot s of a cache holds the token at position s, so
causality is `k_pos <= q_pos`. Queries with position < 0 are padding.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def attention_mask(q_pos, k_pos, k_valid, sliding_window: Optional[int] = None):
  """Boolean mask [B, T, S]: key valid, causal, inside the sliding window."""
  qp = q_pos[:, :, None]
  kp = k_pos[:, None, :]
  mask = k_valid[:, None, :] & (kp <= qp) & (qp >= 0)
  if sliding_window is not None:
    mask = mask & (kp > qp - sliding_window)
  return mask


def masked_softmax_lse(scores, mask):
  """scores [..., T, S] fp32, mask broadcastable → (probs, lse [..., T]).

  Rows with no valid key get probs 0 and lse -inf (so combine ignores them).
  """
  s = jnp.where(mask, scores, NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(s - m), 0.0)
  z = jnp.sum(e, axis=-1, keepdims=True)
  any_valid = jnp.any(mask, axis=-1, keepdims=True)
  probs = e / jnp.where(any_valid, z, 1.0)
  lse = jnp.where(any_valid, m + jnp.log(jnp.where(any_valid, z, 1.0)), -jnp.inf)
  return probs, lse[..., 0]


def dot_product_attention(q, k, v, q_pos, k_pos, k_valid, *, sliding_window=None,
                          scale: Optional[float] = None, out_dtype=None):
  """GQA attention.

  Args:
    q: [B, T, N, H] queries (RoPE applied).
    k: [B, S, K, H] keys (RoPE applied); N % K == 0.
    v: [B, S, K, Hv] values.
    q_pos: [B, T] int positions (<0: padding query).
    k_pos: [B, S] int positions of the keys.
    k_valid: [B, S] bool.
  Returns:
    out [B, T, N, Hv] (dtype of v unless out_dtype), lse [B, T, N] fp32.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  g = n // kh
  scale = (h ** -0.5) if scale is None else scale
  # Heads-major operands ([B,K,G*T,H] queries, [B,K,S,H] keys and values) make both
  # products plain batched matmuls whose outputs are already in the layout the next
  # step reads (scores [B,K,G,T,S] with S contiguous for the softmax). Einsums over the
  # cache's [B,S,K,H] layout made XLA:CPU transpose the [B,K,G,T,S] scores and the
  # products (1.5-2x the attention time); the cast + transpose of K/V fuse into one copy.
  qg = q.reshape(b, t, kh, g, h).astype(jnp.float32).transpose(0, 2, 3, 1, 4)
  kt = k.astype(jnp.float32).transpose(0, 2, 1, 3)
  vt = v.astype(jnp.float32).transpose(0, 2, 1, 3)
  scores = jnp.einsum("bkgth,bksh->bkgts", qg, kt,
                      precision=jax.lax.Precision.HIGHEST) * scale
  mask = attention_mask(q_pos, k_pos, k_valid, sliding_window)[:, None, None]
  probs, lse = masked_softmax_lse(scores, mask)
  out = jnp.einsum("bkgts,bksv->bkgtv", probs, vt, precision=jax.lax.Precision.HIGHEST)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, v.shape[-1]).astype(out_dtype or v.dtype)
  lse = lse.transpose(0, 3, 1, 2).reshape(b, t, n)
  return out, lse


def combine(parts: Sequence[tuple[jax.Array, jax.Array]], out_dtype=None):
  """Merges attention over disjoint key segments: [(out [B,T,N,Hv], lse [B,T,N])] → (out, lse).

  Each part's `out` is normalised over its own segment; the flash-decoding
  combine re-weights by exp(lse_i - lse). Segments with lse=-inf contribute 0.
  """
  lses = jnp.stack([l for _, l in parts])  # [P, B, T, N]
  total = jax.nn.logsumexp(lses, axis=0)
  safe_total = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.where(jnp.isfinite(lses), jnp.exp(lses - safe_total), 0.0)
  out = sum(w[..., None] * o.astype(jnp.float32) for w, (o, _) in zip(weights, parts))
  return out.astype(out_dtype or parts[0][0].dtype), total
