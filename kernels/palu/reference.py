"""Plain-jnp float32 reference for Palu's fused latent decode attention (G-LRD, RoPE).

Per layer, the cache holds pre-RoPE latents of each head group (Palu §3.1-3.2):
  keys   hk [B, S, Gr, rk]: group gr's keys are hk @ B_k[gr] (+ k_bias[gr]),
         i.e. the g KV heads of the group side by side, [B, S, g * H];
  values hv [B, S, Gr, rv]: B_v is folded into W_o (Palu Eq. 6), so attention
         returns the probability-weighted value latent, out [B, N, rv].
Keys get half-rotation RoPE at position = slot index, after the bias (Palu's
bias sits on the reconstruction side). Query head n uses KV head
kv = n // (N / K) with K = Gr * g, and group gr = kv // g. Slots s < lengths[b]
are attended; a length-0 sequence gives out 0 and lse -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common.rope import inv_frequencies, rope_angles  # noqa: F401  (re-exported)
from ..dense.reference import decode_attention_reference
from .packed import PackedLatent, latent_f32


def rope_inv_freq(head_dim: int, rope_theta: float = 10000.0, inv_freq=None):
  """[H/2] float32 inverse frequencies (HF layout, `common.rope.inv_frequencies`); `inv_freq`
  overrides (e.g. Llama-3 scaling)."""
  if inv_freq is not None:
    inv = jnp.asarray(inv_freq, jnp.float32)
    if inv.shape != (head_dim // 2,):
      raise ValueError(f"inv_freq must have shape ({head_dim // 2},), got {inv.shape}")
    return inv
  return jnp.asarray(inv_frequencies(head_dim, rope_theta), jnp.float32)


def check_shapes(q, hk, hv, b_k, lengths, k_bias):
  """Validates the latent-attention arguments; returns (Gr, g, QPK, rk, rv)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
  b, n, h = q.shape
  if h % 2:
    raise ValueError(f"head dim must be even for RoPE, got {h}")
  for name, x in (("hk", hk), ("hv", hv)):
    shp = x.shape
    if len(shp) != 4 or shp[0] != b or shp[1] != hk.shape[1]:
      raise ValueError(f"{name} must be [B={b}, S, Gr, r], got shape {shp}")
  if b_k.ndim != 3:
    raise ValueError(f"b_k must be [Gr, rk, g*H], got shape {b_k.shape}")
  gr, rk, gh = b_k.shape
  if hk.shape[2] != gr or hv.shape[2] != gr or hk.shape[3] != rk:
    raise ValueError(f"latent groups/ranks {hk.shape}, {hv.shape} do not match b_k {b_k.shape}")
  if gh % h:
    raise ValueError(f"b_k last dim ({gh}) must be a multiple of the head dim ({h})")
  g = gh // h
  if n % (gr * g):
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads Gr*g = {gr * g}")
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B]={b}, got shape {lengths.shape}")
  if k_bias is not None and k_bias.shape != (gr, gh):
    raise ValueError(f"k_bias must be [Gr, g*H] = {(gr, gh)}, got {k_bias.shape}")
  return gr, g, n // (gr * g), rk, hv.shape[3]


def reconstruct_keys(hk, b_k, k_bias, head_dim: int, rope_theta=10000.0, inv_freq=None):
  """Post-RoPE keys [B, S, K, H] float32 from key latents (array or PackedLatent)."""
  hk_f = latent_f32(hk)
  keys = jnp.einsum("bsgr,grc->bsgc", hk_f, b_k.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
  if k_bias is not None:
    keys = keys + k_bias.astype(jnp.float32)
  bsz, s, gr, gh = keys.shape
  keys = keys.reshape(bsz, s, gr * (gh // head_dim), head_dim)
  inv = rope_inv_freq(head_dim, rope_theta, inv_freq)
  ang = rope_angles(inv, jnp.arange(s))
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  k1, k2 = keys[..., :head_dim // 2], keys[..., head_dim // 2:]
  return jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)


def palu_attention_reference(q, hk, hv, b_k, lengths, *, rope_theta=10000.0, inv_freq=None,
                               k_bias=None, scale=None, out_dtype=None):
  """Palu latent decode attention in float32.

  Args:
    q: [B, N, H] decode query (RoPE applied).
    hk: key latents [B, S, Gr, rk] (float array or `PackedLatent`).
    hv: value latents [B, S, Gr, rv] (float array or `PackedLatent`).
    b_k: [Gr, rk, g*H] key reconstruction of each group's g KV heads.
    lengths: [B] int, valid slots.
    rope_theta / inv_freq: RoPE frequencies (half-rotation layout).
    k_bias: optional [Gr, g*H] key bias (added before RoPE).
    scale: score scale, default H ** -0.5.
    out_dtype: default q.dtype.
  Returns:
    (out [B, N, rv], lse [B, N] float32).
  """
  gr, g, _, _, _ = check_shapes(q, hk, hv, b_k, lengths, k_bias)
  h = q.shape[-1]
  keys = reconstruct_keys(hk, b_k, k_bias, h, rope_theta, inv_freq)
  hv_f = latent_f32(hv)
  # Every KV head of group gr reads the group's value latent.
  values = jnp.repeat(hv_f, g, axis=2)
  return decode_attention_reference(q, keys, values, lengths, scale=scale,
                                    out_dtype=out_dtype)


__all__ = ["palu_attention_reference", "reconstruct_keys", "rope_inv_freq", "check_shapes",
           "PackedLatent"]
