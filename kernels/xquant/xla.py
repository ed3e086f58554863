"""XLA ("best library") baseline of XQuant rematerialisation: the fused kernel's yardstick.

dequant_matmul: X̂ = dequant(codes) in one XLA elementwise fusion, written as bf16
  (the operand dtype), then one `jnp.dot` with bf16 inputs and fp32 accumulation
  (`preferred_element_type`; cuBLAS on a GPU).
remat_decode_attention: the same GEMM for K and V of every cached token (K|V written
  to HBM), bias, RoPE at the key positions (fp32, XLA), K/V cast to bf16, then XLA
  decode attention (bf16 einsums with fp32 accumulation, fp32 softmax), i.e. the bf16
  KV path run on freshly rematerialised K/V.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .reference import check_layout, dequantize_rows, rope_half

OPERAND = jnp.bfloat16


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str = "token", group: int,
                   out_dtype=jnp.float32, operand_dtype=OPERAND):
  """out [M, N] = dequant(codes) @ w with operand_dtype inputs and fp32 accumulation.

  Args: as reference.dequant_matmul; operand_dtype: the GEMM's input dtype.
  Returns:
    [M, N] array of out_dtype.
  """
  check_layout(codes, scale, zero, w, bits=bits, axis=axis, group=group)
  x = dequantize_rows(codes, scale, zero, bits=bits, width=w.shape[0], axis=axis, group=group,
                      dtype=operand_dtype)
  out = jnp.dot(x, w.astype(operand_dtype), preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _softmax_bf16(q, k, lens, dtype):
  """Decode softmax weights over post-RoPE keys k [B,S,K,H] for q [B,N,H].

  Operands in `dtype`, fp32 accumulation and softmax; keys at slots >= lens masked.
  Returns (p [B,K,G,S] fp32 (rows with no valid key: 0), lse [B,K,G], has [B,K,G]).
  """
  b, n, h = q.shape
  kh = k.shape[2]
  qg = q.astype(dtype).reshape(b, kh, n // kh, h)
  sc = jnp.einsum("bkgh,bskh->bkgs", qg, k.astype(dtype),
                  preferred_element_type=jnp.float32) / math.sqrt(h)
  valid = (jnp.arange(k.shape[1])[None, :] < lens[:, None])[:, None, None]
  sc = jnp.where(valid, sc, -jnp.inf)
  has = jnp.any(valid, axis=-1)
  m = jnp.where(has, jnp.max(sc, axis=-1), 0.0)
  e = jnp.exp(sc - m[..., None])
  den = jnp.sum(e, axis=-1)
  p = e / jnp.where(has, den, 1.0)[..., None]
  lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
  return p, lse, has


def decode_attention_bf16(q, k, v, lens, dtype=OPERAND):
  """Decode attention in XLA: q [B,N,H], k/v [B,S,K,H] (post-RoPE) -> (out fp32, lse).

  Operands in `dtype`, fp32 accumulation and softmax; keys at slots >= lens masked.
  """
  b, n, h = q.shape
  p, lse, _ = _softmax_bf16(q, k, lens, dtype)
  out = jnp.einsum("bkgs,bskh->bkgh", p.astype(dtype), v.astype(dtype),
                   preferred_element_type=jnp.float32)
  return out.reshape(b, n, h), lse.reshape(b, n)


def _remat_keys(k_rows, v_rows, wk, wv, bk, cos, sin, n_kv_heads, operand_dtype):
  """Post-RoPE K [B, s, K, H] (operand_dtype) rematerialised from k_rows, and the dequantized
  value rows X̂_v [B, s, C_v] (X̂ itself when K and V share rows); s = the smallest slot count."""
  xk = k_rows.dequantize(wk.shape[0], dtype=operand_dtype)
  xv = xk if v_rows is None else v_rows.dequantize(wv.shape[0], dtype=operand_dtype)
  s = min(xk.shape[1], xv.shape[1], cos.shape[0])   # slot counts may differ (whole groups)
  xk, xv, cos, sin = xk[:, :s], xv[:, :s], cos[:s], sin[:s]
  k = (jnp.dot(xk, wk.astype(operand_dtype), preferred_element_type=jnp.float32)
       + bk.astype(jnp.float32)).reshape(xk.shape[0], s, n_kv_heads, -1)
  k = rope_half(k, cos.astype(jnp.float32), sin.astype(jnp.float32)).astype(operand_dtype)
  return k, xv


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, return_lse: bool = False, operand_dtype=OPERAND):
  """XLA rematerialise-then-attend (args as reference.remat_decode_attention).

  Returns:
    out [B, N, H] fp32 (and lse [B, N] when return_lse).
  """
  k, xv = _remat_keys(k_rows, v_rows, wk, wv, bk, cos, sin, n_kv_heads, operand_dtype)
  v = (jnp.dot(xv, wv.astype(operand_dtype), preferred_element_type=jnp.float32)
       + bv.astype(jnp.float32)).astype(operand_dtype).reshape(k.shape)
  out, lse = decode_attention_bf16(q, k, v, lens, operand_dtype)
  return (out, lse) if return_lse else out


def remat_decode_attention_vlate(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                                 n_kv_heads: int, return_lse: bool = False,
                                 operand_dtype=OPERAND):
  """XLA rematerialisation with the value projection applied after attention.

  Exact algebra (not in the XQuant paper): with softmax weights p_t (sum 1),
    sum_t p_t (X̂_t W_v + b_v) = (sum_t p_t X̂_t) W_v + b_v,
  so V is never rematerialised: each query head mixes the stored rows it attends
  (p @ X̂: 2·B·N·S·C FLOPs instead of the 2·B·S·C·K·H of X̂ @ W_v) and only the
  mixed row meets its head's W_v columns. Keys still need X̂ @ W_k (RoPE sits
  between the projection and the score, so W_k cannot be folded into q). On the
  MHA X path this halves the rematerialisation FLOPs; on the GQA latent path the
  value half costs N·C instead of K·H·C per token.
  Args/Returns: as `remat_decode_attention`.
  """
  b, n, h = q.shape
  kh = n_kv_heads
  k, xv = _remat_keys(k_rows, v_rows, wk, wv, bk, cos, sin, kh, operand_dtype)
  p, lse, has = _softmax_bf16(q, k, lens, operand_dtype)      # p: [B, K, G, S]
  mixed = jnp.einsum("bkgs,bsc->bkgc", p.astype(operand_dtype), xv,
                     preferred_element_type=jnp.float32)            # [B, K, G, C_v]
  wv_h = wv.astype(operand_dtype).reshape(wv.shape[0], kh, h)         # [C_v, K, H]
  out = jnp.einsum("bkgc,ckh->bkgh", mixed.astype(operand_dtype), wv_h,
                   preferred_element_type=jnp.float32)
  out = out + jnp.where(has[..., None], bv.astype(jnp.float32).reshape(kh, h)[None, :, None], 0.0)
  out = out.reshape(b, n, h)
  return (out, lse.reshape(b, n)) if return_lse else out


__all__ = ["dequant_matmul", "decode_attention_bf16", "remat_decode_attention",
           "remat_decode_attention_vlate"]
