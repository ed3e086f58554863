"""Plain-jnp reference of the XQuant rematerialisation GEMM: dequant(X codes) · W.

Inputs use the cache layout of `kvlowrank.methods.xquant.store` (rows flattened):

  codes  [M, words(C)] uint32, codes packed along C (kvlowrank_kernels.quant.packing)
  scale, zero:
    axis="token"   -> [M, C/group]    one (scale, zero) per `group` channels of a row
    axis="channel" -> [M/group, C]    one (scale, zero) per `group` rows of a channel
  w      [C, N] (bf16 or fp32), e.g. [W_k | W_v] or a GQA latent's Σ·Bᵀ

  out[m, n] = Σ_c (code[m, c] · scale + zero) · w[c, n]      (fp32 accumulation)

This is XQuant's K = X̂·W_k, V = X̂·W_v (§3.1; §3.3 for the latent X·U) for every
cached row: the fused GPU kernels compute the same function without writing X̂.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import dequantize_codes

AXES = ("token", "channel")


def check_layout(codes, scale, zero, w, *, bits: int, axis: str, group: int):
  """Validates shapes; returns (M, C, N). Raises ValueError naming the bad argument."""
  packing.check_bits(bits)
  if axis not in AXES:
    raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
  if codes.ndim != 2 or w.ndim != 2:
    raise ValueError(f"codes and w must be 2-D, got {codes.shape} and {w.shape}")
  m, c, n = codes.shape[0], w.shape[0], w.shape[1]
  if codes.shape[1] != packing.packed_words(c, bits):
    raise ValueError(f"codes has {codes.shape[1]} words per row; {c} channels of {bits} bits "
                     f"need {packing.packed_words(c, bits)}")
  want = (m, c // group) if axis == "token" else (m // group, c)
  if (axis == "token" and c % group) or (axis == "channel" and m % group):
    raise ValueError(f"group ({group}) must divide {'C' if axis == 'token' else 'M'}")
  if scale.shape != want or zero.shape != want:
    raise ValueError(f"scale/zero must have shape {want} for axis={axis!r}, got "
                     f"{scale.shape} / {zero.shape}")
  return m, c, n


def dequantize_rows(codes, scale, zero, *, bits: int, width: int, axis: str, group: int,
                    dtype=jnp.float32):
  """X̂ [M, C] from packed codes (fp32 math, then cast to dtype)."""
  q = packing.unpack_words(codes, bits, width)
  return dequantize_codes(q, scale, zero, axis=1 if axis == "token" else 0, group_size=group,
                          dtype=dtype)


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str = "token", group: int,
                   out_dtype=jnp.float32):
  """out [M, N] = dequant(codes, scale, zero) @ w, fp32 accumulation (see module doc)."""
  check_layout(codes, scale, zero, w, bits=bits, axis=axis, group=group)
  x = dequantize_rows(codes, scale, zero, bits=bits, width=w.shape[0], axis=axis, group=group)
  out = jnp.matmul(x, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return out.astype(out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Per-batch-row packed store: codes [B, S, words(C)], scale/zero [B, S, C/group]
  (axis "token") or [B, S/group, C] (axis "channel")."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = dataclasses.field(metadata=dict(static=True), default=2)
  axis: str = dataclasses.field(metadata=dict(static=True), default="token")
  group: int = dataclasses.field(metadata=dict(static=True), default=128)

  def dequantize(self, width: int, dtype=jnp.float32):
    """X̂ [B, S, C] (fp32 math, cast to dtype)."""
    b, s, _ = self.codes.shape
    flat = lambda a: a.reshape(-1, a.shape[-1])
    x = dequantize_rows(flat(self.codes), flat(self.scale), flat(self.zero), bits=self.bits,
                        width=width, axis=self.axis, group=self.group, dtype=dtype)
    return x.reshape(b, s, width)


def rope_half(x, cos, sin):
  """Half-rotation RoPE of x [B, S, K, H] with tables cos/sin [S, H/2]."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def remat_decode_attention(q, k_rows: PackedRows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, return_lse: bool = False):
  """Decode attention over K/V rematerialised from packed rows (XQuant decode step).

  Args:
    q: [B, N, H] query of the one new token per row (RoPE applied).
    k_rows: PackedRows feeding K (X, or the GQA latent X·U_k).
    v_rows: PackedRows feeding V, or None when K and V share k_rows (XQuant's X path).
    wk, wv: [C_k, K·H], [C_v, K·H] rematerialisation weights (W_k, W_v or Σ·Bᵀ).
    bk, bv: [K·H] biases (zeros when the model has none).
    cos, sin: [S, H/2] fp32 RoPE tables at the key positions (half-rotation layout).
    lens: [B] valid cached tokens per row (keys at positions >= lens are masked).
    k_rows, v_rows and the tables may hold different slot counts S (a per-channel store
    allocates whole token groups); the first min(S) slots are used (lens <= min(S)).
    n_kv_heads: K.
    return_lse: also return the log-sum-exp of the scaled scores (for an LSE merge with
      other key segments, kvlowrank.model.attention.combine).
  Returns:
    out [B, N, H] fp32 (rows with no valid key: 0); with return_lse also lse [B, N]
    (natural log; -inf for rows with no valid key).
  """
  b, n, h = q.shape
  kh = n_kv_heads
  f32 = lambda a: a.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  xk = k_rows.dequantize(wk.shape[0])
  xv = xk if v_rows is None else v_rows.dequantize(wv.shape[0])
  s = min(xk.shape[1], xv.shape[1], cos.shape[0])   # slot counts may differ (whole groups)
  xk, xv, cos, sin = xk[:, :s], xv[:, :s], cos[:s], sin[:s]
  k = (jnp.matmul(xk, f32(wk), precision=hi) + f32(bk)).reshape(b, s, kh, h)
  v = (jnp.matmul(xv, f32(wv), precision=hi) + f32(bv)).reshape(b, s, kh, h)
  k = rope_half(k, f32(cos), f32(sin))
  qg = f32(q).reshape(b, kh, n // kh, h)
  sc = jnp.einsum("bkgh,bskh->bkgs", qg, k, precision=hi) / jnp.sqrt(jnp.float32(h))
  valid = jnp.arange(s)[None, :] < lens[:, None]
  sc = jnp.where(valid[:, None, None, :], sc, -jnp.inf)
  p = jax.nn.softmax(sc, axis=-1)
  has = jnp.any(valid, axis=-1)[:, None, None]
  p = jnp.where(has[..., None], p, 0.0)   # empty row -> 0
  out = jnp.einsum("bkgs,bskh->bkgh", p, v, precision=hi).reshape(b, n, h)
  if not return_lse:
    return out
  lse = jnp.where(has, jax.nn.logsumexp(jnp.where(has[..., None], sc, 0.0), axis=-1), -jnp.inf)
  return out, lse.reshape(b, n)
