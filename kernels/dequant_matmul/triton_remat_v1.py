"""The first fused XQuant decode kernel (kept to benchmark the GEMM-shaped one against).

Program (split, kv head, batch row) walks its share of the cached tokens in BLOCK_S
tiles: K_tile = X̂_tile·W_k[:, head] as two halves (the half-rotation RoPE pairs channel
i with i + H/2), RoPE from a cos/sin table at the key positions, scores for the G query
heads (padded to 16 rows), online softmax, V_tile = X̂_tile·W_v[:, head], P·V; partial
(out, lse) per split merged in jnp. Measured on an H200 (BENCHMARKS.md): 44 TFLOP/s on
the MHA X path and 22 TFLOP/s on the GQA latent path, because each program re-dequantizes
the X tile per head with 64x64x64 MMA tiles and re-streams the head's W slice per tile.
Every shape is a constexpr (one compile per shape). Use `triton_remat` instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..decode_attention import triton_backend
from .triton_dequant import as_int32, bits_meta, dequant_tile, pick_block_k


@triton.jit
def _v1_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr, bk_ptr,
             bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_ptr, lse_ptr, S: tl.constexpr,
             N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
             GP: tl.constexpr, SPLITS: tl.constexpr, PER: tl.constexpr, SCALE: tl.constexpr,
             SHARED: tl.constexpr, CK: tl.constexpr, NWK: tl.constexpr, BITSK: tl.constexpr,
             CPBK: tl.constexpr, WPBK: tl.constexpr, TOKK: tl.constexpr, GRPK: tl.constexpr,
             CV: tl.constexpr, NWV: tl.constexpr, BITSV: tl.constexpr, CPBV: tl.constexpr,
             WPBV: tl.constexpr, TOKV: tl.constexpr, GRPV: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_K: tl.constexpr):
  sp = tl.program_id(0)
  kh = tl.program_id(1)
  b = tl.program_id(2)
  H2: tl.constexpr = H // 2
  length = tl.load(lens_ptr + b)
  g = tl.arange(0, GP)
  g_ok = g < G
  h2 = tl.arange(0, H2)
  hh = tl.arange(0, H)
  qrow = (b * N + kh * G + g).to(tl.int64)
  q1 = tl.load(q_ptr + qrow[:, None] * H + h2[None, :], mask=g_ok[:, None], other=0.0)
  q2 = tl.load(q_ptr + qrow[:, None] * H + H2 + h2[None, :], mask=g_ok[:, None], other=0.0)
  q1 = q1.to(tl.float32) * SCALE
  q2 = q2.to(tl.float32) * SCALE
  bk1 = tl.load(bk_ptr + kh * H + h2).to(tl.float32)
  bk2 = tl.load(bk_ptr + kh * H + H2 + h2).to(tl.float32)
  bvv = tl.load(bv_ptr + kh * H + hh).to(tl.float32)
  m_i = tl.full((GP,), float("-inf"), tl.float32)
  l_i = tl.zeros((GP,), tl.float32)
  acc = tl.zeros((GP, H), tl.float32)
  start = sp * PER
  stop = tl.minimum(start + PER, length)
  for s0 in range(start, stop, BLOCK_S):
    rs = s0 + tl.arange(0, BLOCK_S)
    ok = rs < stop
    grow = b * S + rs
    k1 = tl.zeros((BLOCK_S, H2), tl.float32)
    k2 = tl.zeros((BLOCK_S, H2), tl.float32)
    v = tl.zeros((BLOCK_S, H), tl.float32)
    for c0 in range(0, CK, BLOCK_K):
      x = dequant_tile(kc_ptr, ks_ptr, kz_ptr, grow, ok, b * S + s0, c0, CK, NWK, BITSK,
                        CPBK, WPBK, TOKK, GRPK, BLOCK_S, BLOCK_K)
      rk = c0 + tl.arange(0, BLOCK_K)
      wrow = wk_ptr + rk[:, None] * (KH * H) + kh * H
      w1 = tl.load(wrow + h2[None, :])
      w2 = tl.load(wrow + H2 + h2[None, :])
      xb = x.to(w1.dtype)
      k1 += tl.dot(xb, w1)
      k2 += tl.dot(xb, w2)
      if SHARED:
        wvt = tl.load(wv_ptr + rk[:, None] * (KH * H) + kh * H + hh[None, :])
        v += tl.dot(xb, wvt)
    if not SHARED:
      for c0 in range(0, CV, BLOCK_K):
        x = dequant_tile(vc_ptr, vs_ptr, vz_ptr, grow, ok, b * S + s0, c0, CV, NWV, BITSV,
                          CPBV, WPBV, TOKV, GRPV, BLOCK_S, BLOCK_K)
        rk = c0 + tl.arange(0, BLOCK_K)
        wvt = tl.load(wv_ptr + rk[:, None] * (KH * H) + kh * H + hh[None, :])
        v += tl.dot(x.to(wvt.dtype), wvt)
    k1 += bk1[None, :]
    k2 += bk2[None, :]
    v += bvv[None, :]
    cs = tl.load(cos_ptr + rs[:, None] * H2 + h2[None, :], mask=ok[:, None], other=0.0)
    sn = tl.load(sin_ptr + rs[:, None] * H2 + h2[None, :], mask=ok[:, None], other=0.0)
    r1 = k1 * cs - k2 * sn
    r2 = k2 * cs + k1 * sn
    sc = tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))   # [GP, BLOCK_S]
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    p = tl.exp(sc - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv_t = wv_ptr.dtype.element_ty   # MMA operand dtype = the weights' (bf16 in use)
    acc = acc * alpha[:, None] + tl.dot(p.to(pv_t), v.to(pv_t))
    m_i = m_new
  has = l_i > 0
  out = acc / tl.where(has, l_i, 1.0)[:, None]
  lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
  prow = ((b * KH + kh) * SPLITS + sp).to(tl.int64) * GP + g
  tl.store(o_ptr + prow[:, None] * H + hh[None, :], out)
  tl.store(lse_ptr + prow, lse)


@triton.jit
def remat_v1_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr,
                    bk_ptr, bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_ptr, lse_ptr, S: tl.constexpr,
                    N: tl.constexpr, KH: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                    GP: tl.constexpr, SPLITS: tl.constexpr, PER: tl.constexpr,
                    SCALE: tl.constexpr, SHARED: tl.constexpr, CK: tl.constexpr,
                    NWK: tl.constexpr, BITSK: tl.constexpr, CPBK: tl.constexpr,
                    WPBK: tl.constexpr, TOKK: tl.constexpr, GRPK: tl.constexpr,
                    CV: tl.constexpr, NWV: tl.constexpr, BITSV: tl.constexpr,
                    CPBV: tl.constexpr, WPBV: tl.constexpr, TOKV: tl.constexpr,
                    GRPV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
  _v1_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr, bk_ptr,
           bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_ptr, lse_ptr, S, N, KH, H, G, GP, SPLITS, PER,
           SCALE, SHARED, CK, NWK, BITSK, CPBK, WPBK, TOKK, GRPK, CV, NWV, BITSV, CPBV, WPBV,
           TOKV, GRPV, BLOCK_S, BLOCK_K)


@triton.jit
def remat_v1_kernel_poisoned(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr,
                             wv_ptr, bk_ptr, bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_init,
                             lse_init, o_ptr, lse_ptr, S: tl.constexpr, N: tl.constexpr,
                             KH: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                             GP: tl.constexpr, SPLITS: tl.constexpr, PER: tl.constexpr,
                             SCALE: tl.constexpr, SHARED: tl.constexpr, CK: tl.constexpr,
                             NWK: tl.constexpr, BITSK: tl.constexpr, CPBK: tl.constexpr,
                             WPBK: tl.constexpr, TOKK: tl.constexpr, GRPK: tl.constexpr,
                             CV: tl.constexpr, NWV: tl.constexpr, BITSV: tl.constexpr,
                             CPBV: tl.constexpr, WPBV: tl.constexpr, TOKV: tl.constexpr,
                             GRPV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
  _v1_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr, bk_ptr,
           bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_ptr, lse_ptr, S, N, KH, H, G, GP, SPLITS, PER,
           SCALE, SHARED, CK, NWK, BITSK, CPBK, WPBK, TOKK, GRPK, CV, NWV, BITSV, CPBV, WPBV,
           TOKV, GRPV, BLOCK_S, BLOCK_K)


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, return_lse: bool = False, splits: int = 0,
                           block_s: int = 64, block_k: int = 0, num_warps: int = 8,
                           num_stages: int = 2, poison: bool = False):
  """First-generation fused decode (args as reference.remat_decode_attention).

  Returns:
    out [B, N, H] fp32 (and lse [B, N] when return_lse).
  """
  b, n, h = q.shape
  s = k_rows.codes.shape[1]
  if v_rows is not None and v_rows.codes.shape[1] != s:
    raise ValueError("the v1 fused kernel needs equal K and V slot counts, got "
                     f"{s} and {v_rows.codes.shape[1]}")
  kh = n_kv_heads
  g = n // kh
  gp = max(16, 1 << (g - 1).bit_length())
  if splits <= 0:   # enough programs to fill ~132 SMs several times over
    splits = max(1, min(triton.cdiv(s, block_s), triton.cdiv(4 * 132, b * kh)))
  per = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s
  splits = triton.cdiv(s, per)
  shared = v_rows is None
  v_rows = k_rows if shared else v_rows
  ck, cv = wk.shape[0], wv.shape[0]
  mk, mv = bits_meta(k_rows.bits, ck, "K"), bits_meta(v_rows.bits, cv, "V")
  flat = lambda a: a.reshape(-1, a.shape[-1])
  o, lse = triton_backend.launch(
      remat_v1_kernel, remat_v1_kernel_poisoned, q, as_int32(flat(k_rows.codes)),
      flat(k_rows.scale), flat(k_rows.zero), as_int32(flat(v_rows.codes)), flat(v_rows.scale),
      flat(v_rows.zero), wk, wv, bk, bv, cos, sin, lens.astype(jnp.int32),
      out_shapes=[jax.ShapeDtypeStruct((b, kh, splits, gp, h), jnp.float32),
                  jax.ShapeDtypeStruct((b, kh, splits, gp), jnp.float32)],
      grid=(splits, kh, b), num_warps=num_warps, num_stages=num_stages, poison=poison,
      S=s, N=n, KH=kh, H=h, G=g, GP=gp, SPLITS=splits, PER=per, SCALE=1.0 / math.sqrt(h),
      SHARED=shared, CK=ck, TOKK=k_rows.axis == "token", GRPK=k_rows.group, CV=cv,
      TOKV=v_rows.axis == "token", GRPV=v_rows.group, BLOCK_S=block_s,
      BLOCK_K=pick_block_k(math.gcd(ck, cv), block_k), **mk, **mv)
  o, lse = o[:, :, :, :g], lse[:, :, :, :g]              # [B, K, P, G, H], [B, K, P, G]
  tot = jax.nn.logsumexp(lse, axis=2, keepdims=True)
  wgt = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(tot), tot, 0.0)), 0.0)
  out = jnp.sum(wgt[..., None] * o, axis=2).reshape(b, n, h)   # [B, K, G, H] -> [B, N, H]
  return (out, tot[:, :, 0].reshape(b, n)) if return_lse else out
