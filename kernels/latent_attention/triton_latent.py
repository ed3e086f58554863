"""Palu fused latent decode attention (G-LRD + RoPE) as one Triton kernel (via jax-triton).

Why Triton: the kernel is a stream over the latent cache with two tensor-core
products per tile (key reconstruction, probability x value latent) and a lot of
elementwise work between them (RoPE, online softmax, dequantization); Triton
pipelines the tile loads (`num_stages`) and places the loop-invariant
reconstruction matrices in shared memory by itself, and its interpreter checks
the same source on a CPU. Pallas Mosaic GPU would need hand-written warpgroup
and barrier code (which is what the measured gap below calls for; see
BENCHMARKS.md).

Grid: (B * Gr, num_splits). Program (b, group gr, split) holds the NQG = g * QPK
query heads of the group (padded to NQP >= 16 rows) and streams its chunk of
slots in tiles of BLOCK_S tokens, reading the group's key latent [T, rk] and
value latent [T, rv] once per tile. Per KV head j of the group (two RoPE halves,
B1 = B_k[gr][:, jH : jH + H/2], B2 = the next H/2 columns):
  ABSORB (one query head per KV head, MHA): the query is folded into B_k once per
    program, P = q1 B1 + q2 B2, Q = q2 B1 - q1 B2 (per rotation pair i), and
    score_t = sum_i cos(t w_i) (h_t P)_i + sin(t w_i) (h_t Q)_i
    (the same FLOPs as reconstructing K, no rotated key ever formed);
  otherwise (GQA): k1, k2 = h B1, h B2 (+ bias), RoPE, fp16 product with the
    QPK query heads of KV head j.
Then an online softmax over the tile and acc^T += hv^T @ p. Output per head is
the value-latent mixture [rv] (B_v lives in W_o, Palu Eq. 6) plus its LSE;
splits merge in `splitk.combine_partials`. TRANS (default) lays token tiles
along the MMA N dimension ([H/2, T] tiles, Hopper warpgroup MMA at T = 32);
TRANS=False along M ([T, H/2], register MMA at T = 32).

Measured limits (H200, BENCHMARKS.md): the reconstruction matrices of a group
(rk x g*H bf16 = 128 KiB at Palu's 50% setting) live in shared memory, so one
CTA of 4 warps runs per SM and the per-tile chain (8 small MMAs with waits,
cross-warp score reductions, softmax) is latency bound: the key path runs at
~17% of the measured bf16 matmul rate and the kernel is slower than dense
attention. A faster design needs warp specialisation (TMA producer, MMA
consumers) that Triton 3.6 does not give here.

RoPE at position t = t0 + tau (t0 the tile start, a multiple of BLOCK_S) uses
fl(t0 w) and fl(tau w) from two small XLA-made tables ([S / BLOCK_S, H/2] and
[BLOCK_S, H/2]): ABSORB forms cos/sin(t0 w + tau w) by the angle-sum formulas,
the GQA path rotates the queries by -fl(t0 w) per tile and the keys by
fl(tau w). No sin/cos code sits in the kernel (precise sin/cos inline a large
range-reduction path that cost the kernel its registers). The angle differs
from the reference's fl(t * w) by at most the fp32 rounding of the angle
(<= 2**-24 * |t * w| rad), the same order as the reference's own rounding.

Ranks need not be powers of two: each rank is split into a power-of-two piece
A and a remainder B padded to a power of two (384 = 256 + 128 exactly).

Quantized latents (`PackedLatent`, `bitpack` layout): key latents are
dequantized to fp16 in registers (x = c * s + z) before the reconstruction
product; for value latents the per-token scale is folded into the probabilities
and the zero into a per-row sum, so the codes enter the product as exact fp16
values (`triton_unpack.codes_to_f16`):
  sum_t p_t (s_t c_t + z_t) = 2**b (sum_t (p_t s_t)(1 + c_t/2**b) - sum_t p_t s_t) + sum_t p_t z_t.
Packed latents need block_s >= 32 (see `plan`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..decode_attention import splitk
from ..decode_attention import triton_backend
from ..decode_attention.triton_decode import split_range, store_partial
from . import triton_unpack as tu
from .packing import PackedLatent


@triton.jit
def _key_piece(hk_ptr, hks_ptr, hkz_ptr, tok, t_ok, C0: tl.constexpr, CP: tl.constexpr,
               CN: tl.constexpr, RK: tl.constexpr, T: tl.constexpr, KBITS: tl.constexpr):
  """Key latent channels [C0, C0 + CP) of the tile [T, CP] (zeros past CN): bf16 as stored,
  or dequantized to fp16 (finer than bf16; B_k is converted to match)."""
  cols = tl.arange(0, CP)[None, :]
  if KBITS == 16:
    return tl.load(hk_ptr + tok[:, None] * RK + C0 + cols,
                   mask=t_ok[:, None] & (cols < CN), other=0.0).to(tl.bfloat16)
  else:
    KW: tl.constexpr = RK * KBITS // 8
    c = tu.load_codes(hk_ptr + tok[:, None] * KW, t_ok, C0, CP, CN, RK, T, KBITS)
    mag = tu.codes_to_f16(c, KBITS).to(tl.float32)
    s = tl.load(hks_ptr + tok, mask=t_ok, other=0.0).to(tl.float32) * (1 << KBITS)
    z = tl.load(hkz_ptr + tok, mask=t_ok, other=0.0).to(tl.float32)
    # c * s + z with mag = 1 + c / 2**b.
    x = mag * s[:, None] + (z - s)[:, None]
    return tl.where(cols < CN, x, 0.0).to(tl.float16)


@triton.jit
def _value_piece(hv_ptr, tok, t_ok, C0: tl.constexpr, CP: tl.constexpr, CN: tl.constexpr,
                 RV: tl.constexpr, T: tl.constexpr, VBITS: tl.constexpr):
  """Value latent channels [C0, C0 + CP) [T, CP]: bf16 values, or fp16 1 + c / 2**b."""
  cols = tl.arange(0, CP)[None, :]
  if VBITS == 16:
    return tl.load(hv_ptr + tok[:, None] * RV + C0 + cols,
                   mask=t_ok[:, None] & (cols < CN), other=0.0).to(tl.bfloat16)
  else:
    VW: tl.constexpr = RV * VBITS // 8
    c = tu.load_codes(hv_ptr + tok[:, None] * VW, t_ok, C0, CP, CN, RV, T, VBITS)
    return tu.codes_to_f16(c, VBITS)


@triton.jit
def _latent_body(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr, bias_ptr,
                 tau_ptr, base_ptr, len_ptr, S, NSPLIT, sm_scale, o_ptr, lse_ptr,
                 GR: tl.constexpr, G: tl.constexpr, QPK: tl.constexpr, NQP: tl.constexpr,
                 H: tl.constexpr, RK: tl.constexpr, RKA: tl.constexpr, RKB: tl.constexpr,
                 RKBP: tl.constexpr, RV: tl.constexpr, RVA: tl.constexpr, RVB: tl.constexpr,
                 RVBP: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                 ABSORB: tl.constexpr, TRANS: tl.constexpr, SKIP: tl.constexpr):
  HH: tl.constexpr = H // 2
  NQG: tl.constexpr = G * QPK
  N: tl.constexpr = GR * NQG
  GH: tl.constexpr = G * H
  KDT: tl.constexpr = tl.bfloat16 if KBITS == 16 else tl.float16
  pid = tl.program_id(0)
  sid = tl.program_id(1)
  b = pid // GR
  gr = pid % GR
  start, end = split_range(len_ptr, b, sid, NSPLIT, BLOCK_S)
  b64 = b.to(tl.int64)
  rows = tl.arange(0, NQP)
  row_ok = rows < NQG
  hh = tl.arange(0, HH)
  tcol = tl.arange(0, BLOCK_S)
  qscale = sm_scale * 1.4426950408889634
  # tau table [2, BLOCK_S, HH]: cos, sin of fl(tau * w); read as [HH, T] (TRANS) or [T, HH].
  if TRANS:
    tt = tcol[None, :] * HH + hh[:, None]
  else:
    tt = tcol[:, None] * HH + hh[None, :]
  ct = tl.load(tau_ptr + tt)
  st = tl.load(tau_ptr + BLOCK_S * HH + tt)
  n_tiles = tl.cdiv(S, BLOCK_S)
  if not ABSORB:
    qrows = q_ptr + (b64 * N + gr * NQG + rows)[:, None] * H
    q1 = tl.load(qrows + hh[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qscale
    q2 = tl.load(qrows + HH + hh[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qscale
  m_i = tl.full([NQP], float("-inf"), tl.float32)
  l_i = tl.zeros([NQP], tl.float32)
  # Transposed accumulators [rv piece, NQP]: the value product runs as
  # hv^T [rv, T] @ p^T [T, NQP], whose M = rv >= 64 suits Hopper's warpgroup MMA.
  acc_a = tl.zeros([RVA, NQP], tl.float32)
  acc_b = tl.zeros([RVBP, NQP], tl.float32)
  psum = tl.zeros([NQP], tl.float32)
  pz = tl.zeros([NQP], tl.float32)
  bk_base = bk_ptr + gr * (RK * GH)
  q_base = q_ptr + (b64 * N + gr * NQG) * H
  rka = tl.arange(0, RKA)
  rkb = RKA + tl.arange(0, RKBP)
  rkb_ok = tl.arange(0, RKBP) < RKB
  for t0 in range(start, end, BLOCK_S):
    offs = t0 + tcol
    t_ok = offs < end
    tok = (b64 * S + offs) * GR + gr
    # cos/sin of fl(t0 w) for this tile.
    c0 = tl.load(base_ptr + (t0 // BLOCK_S) * HH + hh)
    s0 = tl.load(base_ptr + (n_tiles + t0 // BLOCK_S) * HH + hh)
    if TRANS:
      c0b = c0[:, None]
      s0b = s0[:, None]
    else:
      c0b = c0[None, :]
      s0b = s0[None, :]
    if ABSORB:
      # Full angles fl(t0 w) + fl(tau w): cos/sin tiles by the angle-sum formulas.
      cos_t = c0b * ct - s0b * st
      sin_t = s0b * ct + c0b * st
    else:
      # Rotate the queries by -fl(t0 w) (cheap: [NQP, HH]); keys get fl(tau w) below.
      qr1 = q1 * c0[None, :] + q2 * s0[None, :]
      qr2 = q2 * c0[None, :] - q1 * s0[None, :]
    if SKIP == 2:
      # Ablation (timing only): no key latent load or reconstruction.
      if TRANS:
        scores = tl.zeros([NQP, BLOCK_S], tl.float32)
      else:
        scores = tl.zeros([BLOCK_S, NQP], tl.float32)
    else:
      hka = _key_piece(hk_ptr, hks_ptr, hkz_ptr, tok, t_ok, 0, RKA, RKA, RK, BLOCK_S, KBITS)
      if RKB > 0:
        hkb = _key_piece(hk_ptr, hks_ptr, hkz_ptr, tok, t_ok, RKA, RKBP, RKB, RK, BLOCK_S, KBITS)
      if TRANS:
        hka = tl.trans(hka)
        if RKB > 0:
          hkb = tl.trans(hkb)
        scores = tl.zeros([NQP, BLOCK_S], tl.float32)
      else:
        scores = tl.zeros([BLOCK_S, NQP], tl.float32)
      for j in tl.static_range(G):
        # B_k[gr][:, jH : jH + H] halves: [HH, RK] (TRANS) or [RK, HH].
        if TRANS:
          b1 = tl.load(bk_base + rka[None, :] * GH + j * H + hh[:, None])
          b2 = tl.load(bk_base + rka[None, :] * GH + j * H + HH + hh[:, None])
          if RKB > 0:
            b1b = tl.load(bk_base + rkb[None, :] * GH + j * H + hh[:, None],
                          mask=rkb_ok[None, :], other=0.0)
            b2b = tl.load(bk_base + rkb[None, :] * GH + j * H + HH + hh[:, None],
                          mask=rkb_ok[None, :], other=0.0)
        else:
          b1 = tl.load(bk_base + rka[:, None] * GH + j * H + hh[None, :])
          b2 = tl.load(bk_base + rka[:, None] * GH + j * H + HH + hh[None, :])
          if RKB > 0:
            b1b = tl.load(bk_base + rkb[:, None] * GH + j * H + hh[None, :],
                          mask=rkb_ok[:, None], other=0.0)
            b2b = tl.load(bk_base + rkb[:, None] * GH + j * H + HH + hh[None, :],
                          mask=rkb_ok[:, None], other=0.0)
        if HAS_BIAS:
          bias1 = tl.load(bias_ptr + gr * GH + j * H + hh).to(tl.float32)
          bias2 = tl.load(bias_ptr + gr * GH + j * H + HH + hh).to(tl.float32)
          if TRANS:
            bias1 = bias1[:, None]
            bias2 = bias2[:, None]
          else:
            bias1 = bias1[None, :]
            bias2 = bias2[None, :]
        if ABSORB:
          # One query head per KV head: fold it into B_k (loop invariant, built once):
          #   q . RoPE_t(k) = sum_i cos_i (h P)_i + sin_i (h Q)_i,
          #   P = q1 B1 + q2 B2, Q = q2 B1 - q1 B2 (per rotation pair i).
          q1 = tl.load(q_base + j * H + hh).to(tl.float32) * qscale
          q2 = tl.load(q_base + j * H + HH + hh).to(tl.float32) * qscale
          if TRANS:
            q1 = q1[:, None]
            q2 = q2[:, None]
          else:
            q1 = q1[None, :]
            q2 = q2[None, :]
          b1f = b1.to(tl.float32)
          b2f = b2.to(tl.float32)
          pm = (q1 * b1f + q2 * b2f).to(KDT)
          qm = (q2 * b1f - q1 * b2f).to(KDT)
          if TRANS:
            x1 = tl.dot(pm, hka)
            x2 = tl.dot(qm, hka)
          else:
            x1 = tl.dot(hka, pm)
            x2 = tl.dot(hka, qm)
          if RKB > 0:
            b1bf = b1b.to(tl.float32)
            b2bf = b2b.to(tl.float32)
            pmb = (q1 * b1bf + q2 * b2bf).to(KDT)
            qmb = (q2 * b1bf - q1 * b2bf).to(KDT)
            if TRANS:
              x1 = tl.dot(pmb, hkb, x1)
              x2 = tl.dot(qmb, hkb, x2)
            else:
              x1 = tl.dot(hkb, pmb, x1)
              x2 = tl.dot(hkb, qmb, x2)
          if HAS_BIAS:
            x1 += q1 * bias1 + q2 * bias2
            x2 += q2 * bias1 - q1 * bias2
          if TRANS:
            sj = tl.sum(cos_t * x1 + sin_t * x2, 0)
            scores = tl.where((rows == j)[:, None], sj[None, :], scores)
          else:
            sj = tl.sum(cos_t * x1 + sin_t * x2, 1)
            scores = tl.where((rows == j)[None, :], sj[:, None], scores)
        else:
          # Reconstruct the KV head's keys (two halves), RoPE, then score its QPK heads.
          if TRANS:
            k1 = tl.dot(b1.to(KDT), hka)
            k2 = tl.dot(b2.to(KDT), hka)
            if RKB > 0:
              k1 = tl.dot(b1b.to(KDT), hkb, k1)
              k2 = tl.dot(b2b.to(KDT), hkb, k2)
          else:
            k1 = tl.dot(hka, b1.to(KDT))
            k2 = tl.dot(hka, b2.to(KDT))
            if RKB > 0:
              k1 = tl.dot(hkb, b1b.to(KDT), k1)
              k2 = tl.dot(hkb, b2b.to(KDT), k2)
          if HAS_BIAS:
            k1 += bias1
            k2 += bias2
          r1 = k1 * ct - k2 * st
          r2 = k2 * ct + k1 * st
          sel = ((rows // QPK == j) & row_ok)[:, None]
          # fp16 operands (8x finer than bf16; rotated keys and scaled queries are far
          # inside fp16's range).
          qj1 = tl.where(sel, qr1, 0.0).to(tl.float16)
          qj2 = tl.where(sel, qr2, 0.0).to(tl.float16)
          if TRANS:
            scores = tl.dot(qj1, r1.to(tl.float16), scores)
            scores = tl.dot(qj2, r2.to(tl.float16), scores)
          else:
            scores = tl.dot(r1.to(tl.float16), tl.trans(qj1), scores)
            scores = tl.dot(r2.to(tl.float16), tl.trans(qj2), scores)
    if not TRANS:
      scores = tl.trans(scores)
    scores = tl.where(t_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if VBITS == 16:
      pw = p.to(tl.bfloat16)
    else:
      vs = tl.load(hvs_ptr + tok, mask=t_ok, other=0.0).to(tl.float32)
      vz = tl.load(hvz_ptr + tok, mask=t_ok, other=0.0).to(tl.float32)
      pw = (p * vs[None, :]).to(tl.float16)
      psum = psum * alpha + tl.sum(pw.to(tl.float32), 1)
      pz = pz * alpha + tl.sum(p * vz[None, :], 1)
    pwt = tl.trans(pw)
    if SKIP != 1:  # SKIP == 1: ablation (timing only), no value latent load or product.
      va = _value_piece(hv_ptr, tok, t_ok, 0, RVA, RVA, RV, BLOCK_S, VBITS)
      acc_a = tl.dot(tl.trans(va), pwt, acc_a * alpha[None, :])
      if RVB > 0:
        vb = _value_piece(hv_ptr, tok, t_ok, RVA, RVBP, RVB, RV, BLOCK_S, VBITS)
        acc_b = tl.dot(tl.trans(vb), pwt, acc_b * alpha[None, :])
    m_i = m_new
  if VBITS != 16:
    acc_a = (acc_a - psum[None, :]) * (1 << VBITS) + pz[None, :]
    acc_b = (acc_b - psum[None, :]) * (1 << VBITS) + pz[None, :]
  # Partial rows [B, N, NSPLIT] x RV: piece A at column 0, piece B at column RVA.
  prow = (b64 * N + gr * NQG + rows) * NSPLIT + sid
  has = l_i > 0
  l_safe = tl.where(has, l_i, 1.0)
  ca = tl.arange(0, RVA)[:, None]
  tl.store(o_ptr + prow[None, :] * RV + ca, acc_a / l_safe[None, :], mask=row_ok[None, :])
  if RVB > 0:
    cb = tl.arange(0, RVBP)[:, None]
    tl.store(o_ptr + prow[None, :] * RV + RVA + cb, acc_b / l_safe[None, :],
             mask=row_ok[None, :] & (cb < RVB))
  lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
  tl.store(lse_ptr + prow, lse, mask=row_ok)


@triton.jit
def latent_kernel(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr, bias_ptr,
                  tau_ptr, base_ptr, len_ptr, S, NSPLIT, sm_scale, o_ptr, lse_ptr,
                  GR: tl.constexpr, G: tl.constexpr, QPK: tl.constexpr, NQP: tl.constexpr,
                  H: tl.constexpr, RK: tl.constexpr, RKA: tl.constexpr, RKB: tl.constexpr,
                  RKBP: tl.constexpr, RV: tl.constexpr, RVA: tl.constexpr, RVB: tl.constexpr,
                  RVBP: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                  ABSORB: tl.constexpr, TRANS: tl.constexpr, SKIP: tl.constexpr):
  _latent_body(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr, bias_ptr,
               tau_ptr, base_ptr, len_ptr, S, NSPLIT, sm_scale, o_ptr, lse_ptr, GR, G, QPK, NQP,
               H, RK, RKA, RKB, RKBP, RV, RVA, RVB, RVBP, KBITS, VBITS, HAS_BIAS, BLOCK_S, ABSORB,
               TRANS, SKIP)


@triton.jit
def latent_kernel_poisoned(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr,
                           bias_ptr, tau_ptr, base_ptr, len_ptr, S, NSPLIT, sm_scale, o_init,
                           lse_init, o_ptr, lse_ptr, GR: tl.constexpr, G: tl.constexpr,
                           QPK: tl.constexpr, NQP: tl.constexpr, H: tl.constexpr, RK: tl.constexpr,
                           RKA: tl.constexpr, RKB: tl.constexpr, RKBP: tl.constexpr,
                           RV: tl.constexpr, RVA: tl.constexpr, RVB: tl.constexpr,
                           RVBP: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                           ABSORB: tl.constexpr, TRANS: tl.constexpr, SKIP: tl.constexpr):
  _latent_body(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr, bias_ptr,
               tau_ptr, base_ptr, len_ptr, S, NSPLIT, sm_scale, o_ptr, lse_ptr, GR, G, QPK, NQP,
               H, RK, RKA, RKB, RKBP, RV, RVA, RVB, RVBP, KBITS, VBITS, HAS_BIAS, BLOCK_S, ABSORB,
               TRANS, SKIP)


def _split_rank(r: int):
  """r = A + B with A the largest power of two <= r; B padded to a power of two (0 if none)."""
  a = 1 << (r.bit_length() - 1)
  rb = r - a
  rbp = 0 if rb == 0 else max(16, 1 << (rb - 1).bit_length())
  return a, rb, max(rbp, 16)


def plan(q_shape, hk_shape, hv_shape, bk_shape, *, kbits=16, vbits=16, has_bias=False,
         block_s=32, num_splits=None, absorb=None, target_programs=None, trans=True,
         skip=0):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check.

  skip: 0, or an ablation for timing only (1: no value path, 2: no key path; wrong output).
  """
  b, n, h = q_shape
  s, gr, rk = hk_shape[1], hk_shape[2], hk_shape[3]
  rv = hv_shape[3]
  g = bk_shape[2] // h
  qpk = n // (gr * g)
  nqg = g * qpk
  for name, val in (("rk", rk), ("rv", rv)):
    if val % 16 or val < 16:
      raise ValueError(f"triton latent attention: {name} must be a multiple of 16, got {val}")
  if h < 32 or h & (h - 1):
    raise ValueError(f"triton latent attention: head dim must be a power of 2 >= 32, got {h}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"triton latent attention: block_s must be a power of 2 >= 16, got {block_s}")
  # The GPU tests caught wrong results for tiny packed tiles (block_s = 16 with 2-bit
  # keys; 3-bit latents with a 16-wide rank piece) where the CPU interpreter agrees
  # with the reference; not root-caused, so those shapes are refused.
  if block_s < 32 and (kbits != 16 or vbits != 16):
    raise ValueError("triton latent attention: packed latents need block_s >= 32")
  if s * gr * max(rk, rv) >= 2 ** 31:
    raise ValueError("triton latent attention: one sequence's latent cache exceeds int32 indexing")
  rka, rkb, rkbp = _split_rank(rk)
  rva, rvb, rvbp = _split_rank(rv)
  for name, bits, pieces in (("rk", kbits, (rka, rkb)), ("rv", vbits, (rva, rvb))):
    if bits != 16 and min(p for p in pieces if p) < 32:
      raise ValueError(f"triton latent attention: packed {name} must split into power-of-two "
                       f"pieces >= 32 (got {pieces})")
  if absorb is None:
    absorb = qpk == 1
  if absorb and qpk != 1:
    raise ValueError("triton latent attention: absorb=True needs one query head per KV head")
  ns = splitk.choose_num_splits(b * gr, s, block_s, requested=num_splits,
                                  target=target_programs or splitk.TARGET_PROGRAMS)
  return dict(
      grid=(b * gr, ns),
      constexprs=dict(GR=gr, G=g, QPK=qpk, NQP=max(16, 1 << (nqg - 1).bit_length()), H=h,
                      RK=rk, RKA=rka, RKB=rkb, RKBP=rkbp, RV=rv, RVA=rva, RVB=rvb, RVBP=rvbp,
                      KBITS=kbits, VBITS=vbits, HAS_BIAS=bool(has_bias),
                      BLOCK_S=block_s, ABSORB=bool(absorb), TRANS=bool(trans),
                      SKIP=int(skip)), num_splits=ns,
      out_shapes=[jax.ShapeDtypeStruct((b, n, ns, rv), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, ns), jnp.float32)])


def rope_tables(inv_freq, capacity: int, block_s: int):
  """(tau [2, block_s, H/2], base [2, ceil(S / block_s), H/2]) float32 cos/sin tables."""
  inv = jnp.asarray(inv_freq, jnp.float32)
  tau = jnp.arange(block_s, dtype=jnp.int32).astype(jnp.float32)[:, None] * inv[None, :]
  n_tiles = -(-capacity // block_s)
  base = (jnp.arange(n_tiles, dtype=jnp.int32) * block_s).astype(jnp.float32)[:, None] * inv
  return (jnp.stack([jnp.cos(tau), jnp.sin(tau)]), jnp.stack([jnp.cos(base), jnp.sin(base)]))


def _latent_args(x, dummy):
  """(data, scale, zero, bits) for an array or PackedLatent."""
  if isinstance(x, PackedLatent):
    if x.bits not in (2, 3, 4):
      raise ValueError(f"triton latent attention supports 2/3/4-bit latents, got {x.bits}")
    return x.codes, x.scale, x.zero, x.bits
  return x.astype(jnp.bfloat16), dummy, dummy, 16


def latent_attention_triton(q, hk, hv, b_k, lengths, inv_freq, *, k_bias=None, scale=None,
                            out_dtype=None, block_s=32, num_splits=None, absorb=None,
                            target_programs=None, trans=True, skip=0, num_warps=4,
                            num_stages=2, poison=False, return_partials=False):
  """Fused Palu decode attention; same contract as `latent_attention_reference`.

  Args (beyond the reference's): inv_freq [H/2] float32 (already resolved);
    block_s, num_splits, absorb, target_programs, trans, num_warps, num_stages: kernel knobs
      (trans: token tiles as the MMA N dim, [H/2, T]; else as M, [T, H/2]);
    poison: NaN-fill partial outputs first (tests); return_partials: also return them.
  """
  h = q.shape[-1]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  scale = np.float32(h ** -0.5 if scale is None else scale)
  lengths = lengths.astype(jnp.int32)
  hk_d, hks, hkz, kbits = _latent_args(hk, lengths)
  hv_d, hvs, hvz, vbits = _latent_args(hv, lengths)
  p = plan(q.shape, hk.shape, hv.shape, b_k.shape, kbits=kbits, vbits=vbits,
           has_bias=k_bias is not None, block_s=block_s, num_splits=num_splits,
           absorb=absorb, target_programs=target_programs, trans=trans, skip=skip)
  bias = k_bias.astype(jnp.float32) if k_bias is not None else lengths
  tau, base = rope_tables(inv_freq, int(hk.shape[1]), block_s)
  o, lse = triton_backend.launch(
      latent_kernel, latent_kernel_poisoned,
      q.astype(jnp.bfloat16), hk_d, hks, hkz, hv_d, hvs, hvz, b_k.astype(jnp.bfloat16), bias,
      tau, base, lengths, int(hk.shape[1]), p["num_splits"], scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, **p["constexprs"])
  out, total = splitk.combine_partials(o, lse, out_dtype or q.dtype)
  if return_partials:
    return out, total, (o, lse)
  return out, total
