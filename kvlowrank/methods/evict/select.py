"""The eviction policy as pure functions: SnapKV scores and the admission rule.

Each cache call hands the wrapper a candidate set E (the window's tokens from earlier
calls, then the call's new tokens, in position order). The rule (`admit`):
  * if every valid candidate fits in the inner cache's remaining room, all are admitted
    (nothing is evicted; the wrapper is then transparent);
  * otherwise the last `window` valid candidates stay in the window (never evicted), and
    of the others the `room` best by pooled score are admitted, the rest evicted.

Scores (`snapkv_scores`, SnapKV Alg. 1 / SnapKVCluster.update_kv): the attention
probabilities of the call's last `observe` queries over the candidates (causal, scaled
by 1/sqrt(H), softmax over the candidates), summed over the observation queries and over
ALL query heads (one selection shared by the layer's KV heads, see cache.py), then
average-pooled along the candidate order with a centred window of `pool` (zero padding,
F.avg_pool1d(padding=pool // 2) as SnapKV). SnapKV pools only the non-window prefix: here
window candidates are zeroed before pooling, which is the same thing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvlowrank.model.attention import attention_mask, masked_softmax_lse


def snapkv_scores(q_obs, q_pos, k, k_pos, k_valid, *, pool: int, eligible):
  """Pooled observation-window attention per candidate.

  Args:
    q_obs: [B, O, N, H] observation queries (RoPE applied).
    q_pos: [B, O] their positions (< 0: padding, ignored).
    k: [B, M, K, H] candidate keys (RoPE applied).
    k_pos: [B, M] candidate positions; k_valid [B, M] bool.
    pool: odd pooling width.
    eligible: [B, M] bool, candidates that may be evicted (others are zeroed before pooling).
  Returns:
    [B, M] float32 scores (0 where not eligible).
  """
  b, o, n, h = q_obs.shape
  kh = k.shape[2]
  qg = q_obs.astype(jnp.float32).reshape(b, o, kh, n // kh, h)
  s = jnp.einsum("bokgh,bmkh->bkgom", qg, k.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * (h ** -0.5)
  mask = attention_mask(q_pos, k_pos, k_valid)[:, None, None]      # [B,1,1,O,M]
  probs, _ = masked_softmax_lse(s, mask)
  score = jnp.where(eligible, jnp.sum(probs, axis=(1, 2, 3)), 0.0)  # [B, M]
  if pool > 1:
    pad = pool // 2
    padded = jnp.pad(score, ((0, 0), (pad, pad)))
    score = sum(padded[:, i:i + score.shape[1]] for i in range(pool)) / pool
  return jnp.where(eligible, score, 0.0)


def recent_mask(valid, window: int):
  """[B, M] bool: the last `window` valid entries of each row."""
  after = jnp.cumsum(valid[:, ::-1].astype(jnp.int32), axis=1)[:, ::-1] - valid
  return valid & (after < window)


def admit(valid, scores, n_in, limit: int, window: int):
  """The admission rule (module docstring).

  Args:
    valid: [B, M] bool candidates; scores [B, M] (higher = keep).
    n_in: [B] int tokens already in the inner cache; limit: its logical capacity.
    window: recent tokens kept out of the inner cache when not everything fits.
  Returns:
    (admitted [B, M] bool: written to the inner cache, in_window [B, M] bool: kept in the
    window ring). Everything else valid is evicted.
  """
  m = valid.shape[1]
  n_valid = jnp.sum(valid, axis=1)
  fits = (n_in + n_valid <= limit)[:, None]
  recent = recent_mask(valid, window)
  eligible = valid & ~recent
  room = (limit - n_in)[:, None]
  # Rank eligible candidates by score (descending); ties go to the earlier position.
  key = jnp.where(eligible, scores, -jnp.inf)
  order = jnp.argsort(-key, axis=1, stable=True)
  rank = jnp.zeros_like(order).at[jnp.arange(valid.shape[0])[:, None], order].set(
      jnp.broadcast_to(jnp.arange(m), order.shape))
  chosen = eligible & (rank < room)
  return jnp.where(fits, valid, chosen), jnp.where(fits, False, recent)
