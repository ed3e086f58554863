"""Plain-jnp float32 reference of ragged-head decode attention over a rotated (FDC / ZACK) cache.

The operand contract (shared with `kvlowrank.methods.rotated.cache`): per layer, KV head h keeps
k_h rotated key dims and v_h value dims (static tuples `k_widths`, `v_widths`, multiples of 16);
its slice of a packed last axis starts at sum(widths[:h]) and nothing is padded.

  q_rot   [B, G, sum k]  query head n = h*G + g has its rotated query at q_rot[b, g, koff_h:+k_h]
  k_rot   [B, S, sum k]  K'_h = RoPE(K_h) R_h[:, :k_h], heads concatenated
  v_rot   [B, S, sum v]  V'_h (the value reconstruction is folded into W_o)
  lengths [B] int32      slot s of row b is attended iff s < lengths[b]

Per KV head h: scores = q_rot[:, g, koff_h:+k_h] . k_rot[:, s, koff_h:+k_h] * scale (scale =
1/sqrt(H) with H the ORIGINAL head dim, passed by the caller), masked by lengths, softmax,
out[:, g, voff_h:+v_h] = p @ v_rot[:, :, voff_h:+v_h]. A row of length 0 gets 0 and lse -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..dense.reference import masked_softmax


def offsets(widths):
  """Start of each head's slice of a packed axis: (0, w0, w0 + w1, ...)."""
  out, acc = [], 0
  for w in widths:
    out.append(acc)
    acc += int(w)
  return tuple(out)


def unpack(x, widths, width: int):
  """[..., sum w] → [..., K, width]: head h's packed slice, zero-padded to `width`."""
  pad = [(0, 0)] * (x.ndim - 1)
  return jnp.stack([jnp.pad(x[..., o:o + w], pad + [(0, width - w)])
                    for o, w in zip(offsets(widths), widths)], axis=-2)


def check_widths(k_widths, v_widths):
  """ValueError naming the field unless the widths are non-empty tuples of equal length whose
  entries are multiples of 16 and >= 16 (the contract)."""
  for name, ws in (("k_widths", k_widths), ("v_widths", v_widths)):
    if not isinstance(ws, (tuple, list)) or not ws:
      raise ValueError(f"ragged_attention: {name} must be a non-empty tuple of ints, got {ws!r}")
    for w in ws:
      if int(w) != w or w < 16 or w % 16:
        raise ValueError(f"ragged_attention: {name} entries must be multiples of 16 >= 16, "
                         f"got {tuple(ws)}")
  if len(k_widths) != len(v_widths):
    raise ValueError(f"ragged_attention: k_widths ({len(k_widths)} heads) and v_widths "
                     f"({len(v_widths)} heads) must name the same KV heads")


def check_inputs(q_rot, k_rot, v_rot, lengths, k_widths, v_widths):
  """ValueError naming the offending argument when the operands do not follow the contract."""
  check_widths(k_widths, v_widths)
  sk, sv = sum(k_widths), sum(v_widths)
  if q_rot.ndim != 3 or q_rot.shape[-1] != sk:
    raise ValueError(f"ragged_attention: q_rot must be [B, G, sum(k_widths)={sk}], "
                     f"got {q_rot.shape}")
  b = q_rot.shape[0]
  if k_rot.ndim != 3 or k_rot.shape[0] != b or k_rot.shape[-1] != sk:
    raise ValueError(f"ragged_attention: k_rot must be [B={b}, S, sum(k_widths)={sk}], "
                     f"got {k_rot.shape}")
  if v_rot.ndim != 3 or v_rot.shape[:2] != k_rot.shape[:2] or v_rot.shape[-1] != sv:
    raise ValueError(f"ragged_attention: v_rot must be [B, S, sum(v_widths)={sv}] with k_rot's "
                     f"B, S {k_rot.shape[:2]}, got {v_rot.shape}")
  if lengths.shape != (b,):
    raise ValueError(f"ragged_attention: lengths must be [B]={b}, got shape {lengths.shape}")


def ragged_attention_reference(q_rot, k_rot, v_rot, lengths, *, k_widths, v_widths, scale,
                               out_dtype=None):
  """Ragged-head decode attention in float32 (HIGHEST precision).

  Args:
    q_rot, k_rot, v_rot, lengths: see the module docstring.
    k_widths, v_widths: static per-KV-head kept widths.
    scale: score scale (1/sqrt(original head dim)).
    out_dtype: output dtype, default q_rot.dtype.
  Returns:
    (out [B, G, sum v] out_dtype, lse [B, K, G] float32, natural log).
  """
  check_inputs(q_rot, k_rot, v_rot, lengths, k_widths, v_widths)
  s = k_rot.shape[1]
  valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]          # [B, 1, S]
  hi = jax.lax.Precision.HIGHEST
  outs, lses = [], []
  for ko, kw, vo, vw in zip(offsets(k_widths), k_widths, offsets(v_widths), v_widths):
    qh = q_rot[..., ko:ko + kw].astype(jnp.float32)
    kh = k_rot[..., ko:ko + kw].astype(jnp.float32)
    vh = v_rot[..., vo:vo + vw].astype(jnp.float32)
    scores = jnp.einsum("bgd,bsd->bgs", qh, kh, precision=hi) * scale
    p, lse = masked_softmax(scores, valid)
    outs.append(jnp.einsum("bgs,bsd->bgd", p, vh, precision=hi))
    lses.append(lse[..., 0])
  out = jnp.concatenate(outs, axis=-1).astype(out_dtype or q_rot.dtype)
  return out, jnp.stack(lses, axis=1)
