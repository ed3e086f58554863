"""Palu fused latent decode attention (G-LRD + RoPE) as one Triton kernel (via jax-triton).

Why Triton: the kernel is a stream over the latent cache with two tensor-core
products per tile (key reconstruction, probability x value latent) and a lot of
elementwise work between them (RoPE, online softmax, dequantization); Triton
pipelines the tile loads (`num_stages`) and places the loop-invariant
reconstruction matrices in shared memory by itself, and its interpreter checks
the same source on a CPU. Overlapping the two products needs hand-written warpgroup
and barrier code: that is the Pallas Mosaic GPU kernel `mosaic_palu` (why, below).

Grid: (B * Gr * g / HPP, num_splits). Program (b, group gr, part, split) holds
the HPP * QPK query heads of HPP KV heads of the group (padded to NQP >= 16 rows;
HPP = g by default) and streams its chunk of
slots in tiles of BLOCK_S tokens, reading the group's key latent [T, rk] and
value latent [T, rv] once per tile. Per KV head j of the group (two RoPE halves,
B1 = B_k[gr][:, jH : jH + H/2], B2 = the next H/2 columns):
  ABSORB (one query head per KV head, MHA): the query is folded into B_k once per
    call, P = q1 B1 + q2 B2, Q = q2 B1 - q1 B2 (per rotation pair i), interleaved
    into one [rk, H] operand, and score_t = sum_i cos(t w_i) (h_t P)_i + sin(t w_i) (h_t Q)_i
    is one product and one row reduction against the interleaved cos/sin table
    (the same FLOPs as reconstructing K, no rotated key ever formed);
  otherwise (GQA): k1, k2 = h B1, h B2 (+ bias), RoPE, fp16 product with the
    QPK query heads of KV head j.
Then an online softmax over the tile and acc^T += hv^T @ p. Output per head is
the value-latent mixture [rv] (B_v lives in W_o, Palu Eq. 6) plus its LSE;
splits merge in `splitk.combine_partials`. TRANS=False (default) lays token
tiles along the MMA M dimension ([T, H/2]; B_k slices / absorbed queries are the
B operand, kept in shared memory); TRANS along N ([H/2, T]; they become the A
operand, which Triton holds in registers: more spills, and on GQA shapes more
shared memory than an H200 block may use at block_s = 32, 2 stages).

Limits (measurements: BENCHMARKS.md): the reconstruction operands of a group
(rk x g*H bf16 = 128 KiB at Palu's 50% setting) live in shared memory, so one
CTA runs per SM. With 128-token tiles on 8 warps (the default) the key product
is a warpgroup MMA, but two stages of latent tiles no longer fit beside the
operands, so the key and value stages of a tile run back to back instead of
overlapping, which keeps the kernel slower than dense attention. Overlapping them
needs warp specialisation, TMA multicast over a CTA cluster or register-direct
latent loads, none of which Triton 3.6 generates here.

RoPE angles come from an XLA-made [S, H] float32 table of fl(t w), cos and sin
interleaved (exactly the reference's angles), read per tile at the key positions (L2
resident, shared by all programs). No sin/cos code sits in the kernel (precise
sin/cos inline a large range-reduction path that cost the kernel its registers),
and no loop-invariant tables are held in registers: register pressure (spills at the
register limit in early versions; the `ptx_stats.py` probe in experiments/ reports
them) is what this kernel is designed around. The GQA path rotates the reconstructed keys by the
full angle and scores them against the unrotated (already RoPE'd) queries.

16-bit latents enter the products in their stored type: bf16, or fp16 (B_k then travels
as fp16 and the probabilities are rounded to fp16 for the value product), so fp16 latents
are never rounded to bf16.

Ranks need not be powers of two: each rank is split into a power-of-two piece
A and a remainder B padded to a power of two (384 = 256 + 128 exactly).

Quantized latents (`PackedLatent`, `quant.packing` rows without padding): key latents are
dequantized to fp16 in registers (x = c * s + z) before the reconstruction
product; for value latents the per-token scale is folded into the probabilities
and the zero into a per-row sum, so the codes enter the product as exact fp16
values (`triton_unpack.codes_to_f16`):
  sum_t p_t (s_t c_t + z_t) = 2**b (sum_t (p_t s_t)(1 + c_t/2**b) - sum_t p_t s_t) + sum_t p_t z_t.
Packed latents need block_s >= 32 (see `plan`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..dense.triton_decode import split_lse, split_range
from . import triton_unpack as tu


@triton.jit
def _key_piece(hk_ptr, hks_ptr, hkz_ptr, tok, t_ok, C0: tl.constexpr, CP: tl.constexpr,
               CN: tl.constexpr, RK: tl.constexpr, T: tl.constexpr, KBITS: tl.constexpr):
  """Key latent channels [C0, C0 + CP) of the tile [T, CP] (zeros past CN): bf16 or fp16 as
  stored, or dequantized to fp16 (finer than bf16; B_k is converted to match)."""
  cols = tl.arange(0, CP)[None, :]
  if KBITS == 16:
    return tl.load(hk_ptr + tok[:, None] * RK + C0 + cols,
                   mask=t_ok[:, None] & (cols < CN), other=0.0)
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
  """Value latent channels [C0, C0 + CP) [T, CP]: bf16 or fp16 values as stored, or fp16
  1 + c / 2**b."""
  cols = tl.arange(0, CP)[None, :]
  if VBITS == 16:
    return tl.load(hv_ptr + tok[:, None] * RV + C0 + cols,
                   mask=t_ok[:, None] & (cols < CN), other=0.0)
  else:
    VW: tl.constexpr = RV * VBITS // 8
    c = tu.load_codes(hv_ptr + tok[:, None] * VW, t_ok, C0, CP, CN, RV, T, VBITS)
    return tu.codes_to_f16(c, VBITS)


@triton.jit
def latent_kernel(q_ptr, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvs_ptr, hvz_ptr, bk_ptr, bias_ptr,
                  pq_ptr, pqb_ptr, rope_ptr, len_ptr, S, NSPLIT, sm_scale, o_init, lse_init,
                  o_ptr, lse_ptr, GR: tl.constexpr, G: tl.constexpr, QPK: tl.constexpr,
                  NQP: tl.constexpr, H: tl.constexpr, RK: tl.constexpr, RKA: tl.constexpr,
                  RKB: tl.constexpr, RKBP: tl.constexpr, RV: tl.constexpr, RVA: tl.constexpr,
                  RVB: tl.constexpr, RVBP: tl.constexpr, KBITS: tl.constexpr,
                  VBITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                  ABSORB: tl.constexpr, TRANS: tl.constexpr, HPP: tl.constexpr):
  HH: tl.constexpr = H // 2
  NPART: tl.constexpr = G // HPP
  NQH: tl.constexpr = HPP * QPK
  NQG: tl.constexpr = G * QPK
  N: tl.constexpr = GR * NQG
  GH: tl.constexpr = G * H
  # MMA operand types: 16-bit latents as stored (bf16 or fp16; B_k and p are converted to
  # match), dequantized latents as fp16.
  KDT: tl.constexpr = hk_ptr.dtype.element_ty if KBITS == 16 else tl.float16
  VDT: tl.constexpr = hv_ptr.dtype.element_ty if VBITS == 16 else tl.float16
  pid = tl.program_id(0)
  sid = tl.program_id(1)
  b = pid // (GR * NPART)
  gr = (pid // NPART) % GR
  j0 = (pid % NPART) * HPP        # first KV head of the group handled by this program
  hbase = gr * NQG + j0 * QPK      # its first query head
  start, end = split_range(len_ptr, b, sid, NSPLIT, BLOCK_S)
  b64 = b.to(tl.int64)
  rows = tl.arange(0, NQP)
  row_ok = rows < NQH
  hh = tl.arange(0, HH)
  hcol = tl.arange(0, H)
  tcol = tl.arange(0, BLOCK_S)
  qscale = sm_scale * 1.4426950408889634
  if not ABSORB:
    qrows = q_ptr + (b64 * N + hbase + rows)[:, None] * H
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
  rka = tl.arange(0, RKA)
  rkb = RKA + tl.arange(0, RKBP)
  rkb_ok = tl.arange(0, RKBP) < RKB
  for t0 in range(start, end, BLOCK_S):
    offs = t0 + tcol
    t_ok = offs < end
    tok = (b64 * S + offs) * GR + gr
    # cos/sin of fl(t w) at this tile's key positions, from the interleaved [S, H] table
    # (cs[t, 2i] = cos(t w_i), cs[t, 2i + 1] = sin(t w_i); L2-resident, shared by every
    # program): no loop-invariant tables held in registers.
    if TRANS:
      cs = tl.load(rope_ptr + offs[None, :] * H + hcol[:, None], mask=t_ok[None, :], other=0.0)
    else:
      cs = tl.load(rope_ptr + offs[:, None] * H + hcol[None, :], mask=t_ok[:, None], other=0.0)
    cs = cs.to(tl.float32)  # the table may be fp16 (`rope_dtype`)
    if not ABSORB:
      if TRANS:
        cos_t, sin_t = tl.split(tl.permute(tl.reshape(cs, [HH, 2, BLOCK_S]), [0, 2, 1]))
      else:
        cos_t, sin_t = tl.split(tl.reshape(cs, [BLOCK_S, HH, 2]))
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
    for jj in tl.static_range(HPP):
      j = j0 + jj
      if ABSORB:
        # One query head per KV head, folded into B_k outside the kernel (`absorbed_queries`):
        #   q . RoPE_t(k) = sum_i cos_i (h P)_i + sin_i (h Q)_i,
        #   P = q1 B1 + q2 B2, Q = q2 B1 - q1 B2 (per rotation pair i),
        # as one MMA-ready operand [RK, H] per head with P_i in column 2i and Q_i in 2i + 1,
        # so a single product gives x [T, H] and the score is sum_c x[:, c] * cs[:, c].
        pq_base = pq_ptr + (b64 * N + gr * NQG + j) * (RK * H)
        if TRANS:
          pqm = tl.load(pq_base + rka[None, :] * H + hcol[:, None])
          x = tl.dot(pqm, hka)
          if RKB > 0:
            pqb_ = tl.load(pq_base + rkb[None, :] * H + hcol[:, None], mask=rkb_ok[None, :],
                           other=0.0)
            x = tl.dot(pqb_, hkb, x)
        else:
          pqm = tl.load(pq_base + rka[:, None] * H + hcol[None, :])
          x = tl.dot(hka, pqm)
          if RKB > 0:
            pqb_ = tl.load(pq_base + rkb[:, None] * H + hcol[None, :], mask=rkb_ok[:, None],
                           other=0.0)
            x = tl.dot(hkb, pqb_, x)
        if HAS_BIAS:
          # (q1 b1 + q2 b2, q2 b1 - q1 b2) of the key bias, also folded outside (interleaved).
          qb = tl.load(pqb_ptr + (b64 * N + gr * NQG + j) * H + hcol)
          if TRANS:
            x += qb[:, None]
          else:
            x += qb[None, :]
        if TRANS:
          sj = tl.sum(x * cs, 0)
          scores = tl.where((rows == jj)[:, None], sj[None, :], scores)
        else:
          sj = tl.sum(x * cs, 1)
          scores = tl.where((rows == jj)[None, :], sj[:, None], scores)
      else:
        # Reconstruct the KV head's keys (two halves: B_k[gr][:, jH : jH + H] as
        # [HH, RK] (TRANS) or [RK, HH]), RoPE, then score its QPK query heads.
        if TRANS:
          b1 = tl.load(bk_base + rka[None, :] * GH + j * H + hh[:, None])
          b2 = tl.load(bk_base + rka[None, :] * GH + j * H + HH + hh[:, None])
          k1 = tl.dot(b1.to(KDT), hka)
          k2 = tl.dot(b2.to(KDT), hka)
          if RKB > 0:
            b1b = tl.load(bk_base + rkb[None, :] * GH + j * H + hh[:, None],
                          mask=rkb_ok[None, :], other=0.0)
            b2b = tl.load(bk_base + rkb[None, :] * GH + j * H + HH + hh[:, None],
                          mask=rkb_ok[None, :], other=0.0)
            k1 = tl.dot(b1b.to(KDT), hkb, k1)
            k2 = tl.dot(b2b.to(KDT), hkb, k2)
        else:
          b1 = tl.load(bk_base + rka[:, None] * GH + j * H + hh[None, :])
          b2 = tl.load(bk_base + rka[:, None] * GH + j * H + HH + hh[None, :])
          k1 = tl.dot(hka, b1.to(KDT))
          k2 = tl.dot(hka, b2.to(KDT))
          if RKB > 0:
            b1b = tl.load(bk_base + rkb[:, None] * GH + j * H + hh[None, :],
                          mask=rkb_ok[:, None], other=0.0)
            b2b = tl.load(bk_base + rkb[:, None] * GH + j * H + HH + hh[None, :],
                          mask=rkb_ok[:, None], other=0.0)
            k1 = tl.dot(hkb, b1b.to(KDT), k1)
            k2 = tl.dot(hkb, b2b.to(KDT), k2)
        if HAS_BIAS:
          bias1 = tl.load(bias_ptr + gr * GH + j * H + hh).to(tl.float32)
          bias2 = tl.load(bias_ptr + gr * GH + j * H + HH + hh).to(tl.float32)
          if TRANS:
            k1 += bias1[:, None]
            k2 += bias2[:, None]
          else:
            k1 += bias1[None, :]
            k2 += bias2[None, :]
        r1 = k1 * cos_t - k2 * sin_t
        r2 = k2 * cos_t + k1 * sin_t
        sel = ((rows // QPK == jj) & row_ok)[:, None]
        # fp16 operands (8x finer than bf16; rotated keys and scaled queries are far
        # inside fp16's range).
        qj1 = tl.where(sel, q1, 0.0).to(tl.float16)
        qj2 = tl.where(sel, q2, 0.0).to(tl.float16)
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
      pw = p.to(VDT)
    else:
      vs = tl.load(hvs_ptr + tok, mask=t_ok, other=0.0).to(tl.float32)
      vz = tl.load(hvz_ptr + tok, mask=t_ok, other=0.0).to(tl.float32)
      pw = (p * vs[None, :]).to(tl.float16)
      psum = psum * alpha + tl.sum(pw.to(tl.float32), 1)
      pz = pz * alpha + tl.sum(p * vz[None, :], 1)
    pwt = tl.trans(pw)
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
  prow = (b64 * N + hbase + rows) * NSPLIT + sid
  l_safe, lse = split_lse(m_i, l_i)
  ca = tl.arange(0, RVA)[:, None]
  tl.store(o_ptr + prow[None, :] * RV + ca, acc_a / l_safe[None, :], mask=row_ok[None, :])
  if RVB > 0:
    cb = tl.arange(0, RVBP)[:, None]
    tl.store(o_ptr + prow[None, :] * RV + RVA + cb, acc_b / l_safe[None, :],
             mask=row_ok[None, :] & (cb < RVB))
  tl.store(lse_ptr + prow, lse, mask=row_ok)
