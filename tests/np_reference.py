"""Float64 numpy reference of the Llama-family decoder (independent of kvlowrank.model):
per-head loops, explicit masks, the RoPE formulas written out. Shared by the tests."""

import jax
import numpy as np


def np_rope(x, pos, spec):
  """x [T, heads, H] float64, pure numpy (independent of kvlowrank.model.rope)."""
  if spec.rope_layout == "none":
    return x
  h = spec.head_dim
  inv = 1.0 / spec.rope_theta ** (np.arange(0, h, 2) / h)
  ang = pos[:, None, None] * inv
  c, s = np.cos(ang), np.sin(ang)
  if spec.rope_layout == "half":
    x1, x2 = x[..., :h // 2], x[..., h // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
  out = np.empty_like(x)
  out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
  out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
  return out


def np_forward(params, tokens, spec):
  """Logits [T, V] of one unpadded sequence, float64, per-head loops."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  norm = lambda x, w: w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + spec.norm_eps)
  t = len(tokens)
  pos = np.arange(t)
  x = p["embed"][np.asarray(tokens)]
  causal = pos[None, :] <= pos[:, None]
  if spec.sliding_window:
    causal &= pos[None, :] > pos[:, None] - spec.sliding_window
  for lp in p["layers"]:
    h = norm(x, lp["attn_norm"])
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if spec.qkv_bias:
      q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = np_rope(q.reshape(t, spec.n_heads, -1), pos, spec)
    k = np_rope(k.reshape(t, spec.n_kv_heads, -1), pos, spec)
    v = v.reshape(t, spec.n_kv_heads, -1)
    out = np.zeros_like(q)
    for n in range(spec.n_heads):
      kh = n // spec.group_size
      s = np.where(causal, q[:, n] @ k[:, kh].T / np.sqrt(spec.head_dim), -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      out[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, kh]
    x = x + out.reshape(t, -1) @ lp["wo"]
    h = norm(x, lp["mlp_norm"])
    g = h @ lp["w_gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ lp["w_up"])) @ lp["w_down"]
  x = norm(x, p["final_norm"])
  return x @ (p["embed"].T if spec.tie_embeddings else p["lm_head"])
