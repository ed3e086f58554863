"""Plain-jnp float32 reference for single-token (decode) GQA attention over a slot cache.

Semantics shared by every implementation in this package: query head n uses KV
head n // (N // K); slot s of sequence b is attended iff s < lengths[b] (slot s
holds position s, and the decode token sits at position lengths[b] - 1, so
causality is automatic). A sequence of length 0 gets output 0 and lse -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_shapes(q, k, v, lengths):
  """ValueError naming the offending argument when shapes do not line up."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
  if k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"k and v must be [B, S, K, H], got {k.shape} and {v.shape}")
  b, n, h = q.shape
  if k.shape[0] != b or k.shape[3] != h:
    raise ValueError(f"k shape {k.shape} does not match q shape {q.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v shape {v.shape} does not match k shape {k.shape}")
  if n % k.shape[2]:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({k.shape[2]})")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got shape {lengths.shape}")


def masked_softmax(scores, valid):
  """Softmax over the last axis of fp32 `scores` where `valid` (broadcastable): (p, lse),
  lse keeping the reduced axis (size 1); a row with no valid key gets p = 0, lse = -inf.
  The jnp references of every decode kernel normalise their scores through this."""
  scores = jnp.where(valid, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(valid, jnp.exp(scores - m_safe), 0.0)
  z = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(z > 0, z, 1.0)
  lse = jnp.where(z > 0, m_safe + jnp.log(jnp.where(z > 0, z, 1.0)), -jnp.inf)
  return p, lse


def decode_attention_reference(q, k, v, lengths, *, scale=None, out_dtype=None):
  """Decode attention in float32 (HIGHEST precision).

  Args:
    q: [B, N, H] query of the decode token (RoPE applied).
    k: [B, S, K, H] keys (RoPE applied); v: [B, S, K, Hv] values.
    lengths: [B] int, valid slots per sequence.
    scale: score scale, default H ** -0.5.
    out_dtype: output dtype, default q.dtype.
  Returns:
    (out [B, N, Hv], lse [B, N] float32, natural log).
  """
  check_shapes(q, k, v, lengths)
  b, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  qf = q.astype(jnp.float32).reshape(b, kh, n // kh, h)
  scores = jnp.einsum("bkgh,bskh->bkgs", qf, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
  p, lse = masked_softmax(scores, valid)
  out = jnp.einsum("bkgs,bskv->bkgv", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return (out.reshape(b, n, v.shape[-1]).astype(out_dtype or q.dtype),
          lse.reshape(b, n))
