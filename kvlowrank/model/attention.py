"""Masked dot-product attention with log-sum-exp output, and the segment combine.

This is the dense reference every cache's `attend` is tested against, and what the
caches' jnp paths (prefill, CPU) run. Keys are addressed by *position*: slot s of a cache
holds the token at position s, so causality is `k_pos <= q_pos`. Queries with position
< 0 are padding.

Long prompts: the fp32 score matrix of T queries over S keys is [B, N, T, S]; above
SCORE_ELEMENTS elements the queries are processed in chunks (`lax.map`), so a 32K-token
prompt never materialises its [T, S] scores at once (each chunk's rows are computed
exactly as without chunking).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from kvlowrank_kernels.common.splitk import combine_partials

NEG_INF = -1e30
# Largest fp32 score block (elements) computed at once: 2^26 = 256 MiB.
SCORE_ELEMENTS = 1 << 26


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
                          scale: Optional[float] = None, out_dtype=None,
                          score_elements: int = SCORE_ELEMENTS):
  """GQA attention.

  Args:
    q: [B, T, N, H] queries (RoPE applied).
    k: [B, S, K, H] keys (RoPE applied); N % K == 0.
    v: [B, S, K, Hv] values.
    q_pos: [B, T] int positions (<0: padding query).
    k_pos: [B, S] int positions of the keys.
    k_valid: [B, S] bool.
    score_elements: largest [B, N, Tc, S] score block; more queries run in chunks of Tc.
  Returns:
    out [B, T, N, Hv] (dtype of v unless out_dtype), lse [B, T, N] fp32.
  """
  b, t, n, h = q.shape
  s = k.shape[1]
  scale = (h ** -0.5) if scale is None else scale
  out_dtype = out_dtype or v.dtype
  # Heads-major operands ([B,K,G*T,H] queries, [B,K,S,H] keys and values) make both
  # products plain batched matmuls whose outputs are already in the layout the next
  # step reads (scores [B,K,G,T,S] with S contiguous for the softmax). Einsums over the
  # cache's [B,S,K,H] layout made XLA:CPU transpose the [B,K,G,T,S] scores and the
  # products; the cast + transpose of K/V fuse into one copy.
  kt = k.astype(jnp.float32).transpose(0, 2, 1, 3)
  vt = v.astype(jnp.float32).transpose(0, 2, 1, 3)
  chunk = max(1, score_elements // max(1, b * n * s))
  if t <= chunk:
    return _attend(q, kt, vt, q_pos, k_pos, k_valid, sliding_window, scale, out_dtype)
  n_chunks = -(-t // chunk)
  pad = n_chunks * chunk - t
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  pp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
  split = lambda a: jnp.moveaxis(a.reshape(b, n_chunks, chunk, *a.shape[2:]), 1, 0)
  out, lse = jax.lax.map(
      lambda xs: _attend(xs[0], kt, vt, xs[1], k_pos, k_valid, sliding_window, scale,
                         out_dtype), (split(qp), split(pp)))
  merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n_chunks * chunk, *a.shape[3:])[:, :t]
  return merge(out), merge(lse)


def _attend(q, kt, vt, q_pos, k_pos, k_valid, sliding_window, scale, out_dtype):
  """`dot_product_attention` of q [B, T, N, H] over fp32 heads-major kt, vt [B, K, S, .]."""
  b, t, n, h = q.shape
  kh = kt.shape[1]
  g = n // kh
  qg = q.reshape(b, t, kh, g, h).astype(jnp.float32).transpose(0, 2, 3, 1, 4)
  scores = jnp.einsum("bkgth,bksh->bkgts", qg, kt,
                      precision=jax.lax.Precision.HIGHEST) * scale
  mask = attention_mask(q_pos, k_pos, k_valid, sliding_window)[:, None, None]
  probs, lse = masked_softmax_lse(scores, mask)
  out = jnp.einsum("bkgts,bksv->bkgtv", probs, vt, precision=jax.lax.Precision.HIGHEST)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, vt.shape[-1]).astype(out_dtype)
  lse = lse.transpose(0, 3, 1, 2).reshape(b, t, n)
  return out, lse


def combine(parts: Sequence[tuple[jax.Array, jax.Array]], out_dtype=None):
  """Merges attention over disjoint key segments: [(out [B,T,N,Hv], lse [B,T,N])] → (out, lse).

  Each part's `out` is normalised over its own segment; the flash-decoding
  combine re-weights by exp(lse_i - lse) (`kvlowrank_kernels.common.splitk.combine_partials`,
  the one log-sum-exp combine the kernels' split-K partials use too). Segments with
  lse=-inf contribute 0.
  """
  o = jnp.stack([o.astype(jnp.float32) for o, _ in parts], axis=-2)   # [B, T, N, P, Hv]
  lse = jnp.stack([l.astype(jnp.float32) for _, l in parts], axis=-1)  # [B, T, N, P]
  return combine_partials(o, lse, out_dtype or parts[0][0].dtype)
