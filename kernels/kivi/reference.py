"""Plain-jnp float32 reference for KIVI decode attention: quantized prefix + exact window.

Sequence b's keys/values are the first q_len[b] slots of the quantized cache
(dequantized in float32) followed by the first w_len[b] slots of the
full-precision window. Attention over both is the LSE-combine of the two
segments (flash-decoding identity), so the result equals dense attention over
the concatenation.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..dense.reference import decode_attention_reference
from ..common.splitk import combine_partials
from .planar import KiviKeys, KiviValues, dequantize_keys, dequantize_values


def check_shapes(q, kq: KiviKeys, vq: KiviValues, k_win, v_win, q_len, w_len):
  """ValueError naming the bad argument."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
  b, n, h = q.shape
  if kq.codes.ndim != 4 or kq.codes.shape[0] != b:
    raise ValueError(f"keys.codes must be [B, K, S, H*bits/8], got {kq.codes.shape}")
  _, kh, s, _ = kq.codes.shape
  if vq.codes.shape[:3] != (b, kh, s):
    raise ValueError(f"values.codes {vq.codes.shape} do not match keys.codes {kq.codes.shape}")
  if kq.scale.shape != (b, kh, s // kq.group, h):
    raise ValueError(f"keys.scale must be {(b, kh, s // kq.group, h)}, got {kq.scale.shape}")
  if vq.scale.shape != (b, kh, s, h // vq.group):
    raise ValueError(f"values.scale must be {(b, kh, s, h // vq.group)}, got {vq.scale.shape}")
  if k_win.ndim != 4 or k_win.shape[0] != b or k_win.shape[2:] != (kh, h):
    raise ValueError(f"k_win must be [B, W, K={kh}, H={h}], got {k_win.shape}")
  if v_win.shape != k_win.shape:
    raise ValueError(f"v_win shape {v_win.shape} != k_win shape {k_win.shape}")
  if n % kh:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kh})")
  for name, x in (("q_len", q_len), ("w_len", w_len)):
    if x.shape != (b,):
      raise ValueError(f"{name} must be [B]={b}, got shape {x.shape}")


def kivi_attention_reference(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len,
                             *, scale=None, out_dtype=None):
  """KIVI decode attention in float32.

  Args:
    q: [B, N, H] decode query (RoPE applied).
    keys, values: quantized prefix (`planar`), capacity S.
    k_win, v_win: [B, W, K, H] full-precision recent tokens.
    q_len: [B] quantized tokens per sequence; w_len: [B] window tokens.
    scale: default H ** -0.5; out_dtype: default q.dtype.
  Returns:
    (out [B, N, H], lse [B, N] float32).
  """
  check_shapes(q, keys, values, k_win, v_win, q_len, w_len)
  h = q.shape[-1]
  kf = dequantize_keys(keys, h)
  vf = dequantize_values(values, h)
  o1, l1 = decode_attention_reference(q, kf, vf, q_len, scale=scale, out_dtype=jnp.float32)
  o2, l2 = decode_attention_reference(q, k_win, v_win, w_len, scale=scale, out_dtype=jnp.float32)
  return combine_partials(jnp.stack([o1, o2], axis=-2), jnp.stack([l1, l2], axis=-1),
                          out_dtype or q.dtype)
