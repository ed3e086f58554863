"""KIVI decode attention (2/4-bit K per channel, V per token, + exact window) in Triton.

Grid: (B * K, num_splits + 1). Programs with split < num_splits stream their
chunk of the quantized prefix of one (batch, kv head); the last split attends
the full-precision window (plain flash-decoding tile loop). All partials merge
in one LSE combine (`splitk.combine_partials`).

Quantized loop step: BLOCK_S tokens as NSUB sub-tiles of T tokens (T divides
the value code block and, for power-of-2 key groups >= 16, lies in one key
group), one online-softmax step (fp32) per loop step. QP = query heads of the
kv head rounded up to a power of 2 (>= min_rows), CW = plane width (`planar`):
  * codes are the A (left) operand of every `tl.dot`:
      keys:   scores^T [T, QP] += dot(K_j [T, CW], q_j^T [CW, QP])   per key plane j,
      values: acc_j [CW, QP]   += dot(V_j^T [CW, T], p^T [T, QP])    per value plane j,
    so a sub-tile takes H / CW dots of each kind (4 + 4 for H = 128, 2-bit),
    with one fp32 accumulator per value plane (a tuple) and q^T loaded once.
    Why A: Triton keeps a dot's A operand in registers and hoists its layout
    conversion above the elementwise ops that produce it, so each packed byte
    tile is read from shared memory straight into the MMA operand layout and
    unpacked there; an operand computed elementwise as B is re-laid out through
    shared memory every tile. The one per-tile operand shuffle left is p^T.
    (The value tile's K dimension is tokens, hence token-blocked value codes.)
  * planar layout: plane k of a segment's [T, CW] byte tile is
    `(bytes >> k * bits) & mask`, a contiguous channel chunk: no joins or
    reshapes (the interleaved "adjacent channels" layout needed a
    `tl.join`/reshape shuffle per tile).
  * dequantization in the A operand, exact codes and one rounding: the byte
    goes to the low byte of a 16-bit lane, lop3 keeps plane k's field at bit P
    and ORs in the exponent of M = 2**mantissa_bits (M + c * 2**P is exact),
    one packed FMA (x 2**-P, - M 2**-P) gives c exactly and a second one
    c * s + z with the raw 16-bit scale/zero pair of the element's group
    (keys: per channel of the sub-tile's token group; values: per token of the
    plane's channel group, read as int32 words holding two groups). Why not
    fold s into the other operand (q * s, p * s) with offset sums: that
    operand is rebuilt per tile and plane, replicated over the threads that
    share it, plus per-tile correction reductions; why exact c: folding the
    zero as z - 2**b s rounds a group-wide offset once per group, a correlated
    error that shifts whole score rows.
  * MMA operands in the scales' dtype (bf16 or fp16; other scale dtypes are
    cast to bf16 by the wrapper), fp32 accumulation; q enters unscaled and the
    scores are scaled by sm_scale * log2(e) in fp32 (like the dense kernel).
  * `FAST` (GPU): the dequantization is one `tl.inline_asm_elementwise` over 4
    codes (one 32-bit register of bytes); the plain Triton version (`FAST` off,
    used by the CPU interpreter, which cannot run PTX) computes the same values.
  * value code loads are unmasked (a per-token mask would split the vector
    loads; tiles never pass the capacity and past-the-end tokens get zero
    scale/zero); the softmax denominator is kept per token slot and summed once
    at the end (a per-tile sum over tokens crosses warps).
Key groups that are not powers of 2 >= 16 fall back to gathering the key scale
pair per (token, channel), which is correct but slow.
GEAR (`kvlowrank_kernels.gear.triton_gear`) runs this same source with constexpr flags on
(`_quant_part`: factored low-rank terms, each plane's outliers a second MMA operand); with
them off (the KIVI entries below) the code compiles to the same PTX as without them. The
launch plan and its checks (2/4-bit codes only) live in `triton_plan` (importable without Triton), re-exported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import splitk
from ..common import triton_backend
from ..dense.triton_decode import split_lse, split_range, store_partial
from .planar import KiviKeys, KiviValues
from .triton_dequant import dequant as _dequant
from .triton_dequant import to_dtype as _to_dt
from .triton_plan import plan


# GEAR's flags and sizes (HAS_LR, HAS_SK, HAS_SV, NB, RP, RG, RA, NK, NV) off: plain KIVI.
NO_GEAR = tl.constexpr((0, 0, 0, 0, 0, 0, 0, 0, 0))


@triton.jit
def _window_part(q, qk_scale, kw_ptr, vw_ptr, wlen_ptr, W, b64, kh, o_ptr, lse_ptr, prow, row_ok,
                 KH: tl.constexpr, QP: tl.constexpr, H: tl.constexpr, BLOCK_W: tl.constexpr):
  """Flash-decoding over the exact window [0, w_len[b]) of one (batch, kv head).

  q: [QP, H] bf16, unscaled (scores are scaled in fp32 after the product, like the dense
  kernel: rounding a pre-scaled q to bf16 would perturb every score by 2**-9 of itself).
  """
  end = tl.load(wlen_ptr + b64)
  cols = tl.arange(0, H)
  m_i = tl.full([QP], float("-inf"), tl.float32)
  l_i = tl.zeros([QP], tl.float32)
  acc = tl.zeros([QP, H], tl.float32)
  base = (b64 * W) * (KH * H) + kh * H
  # Not software-pipelined: its staging buffers would be allocated for every program (the
  # quantized ones too) and cut how many programs fit on a multiprocessor; the window is short.
  for s0 in tl.range(0, end, BLOCK_W, num_stages=1):
    offs = s0 + tl.arange(0, BLOCK_W)
    ok = offs < end
    ptr = base + offs[:, None] * (KH * H) + cols[None, :]
    k = tl.load(kw_ptr + ptr, mask=ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(vw_ptr + ptr, mask=ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(_to_dt(p, tl.bfloat16, False), v)
    m_i = m_new
  store_partial(o_ptr, lse_ptr, acc, m_i, l_i, prow, row_ok, H)


@triton.jit
def _key_outlier_tile(idx_base, val_base, ch, tloc, tile_ok, H: tl.constexpr, NK: tl.constexpr,
                      DT: tl.constexpr):
  """GEAR: the chunk's key outliers of channels ch [CW] at the tokens whose slots in the chunk
  are tloc [T], as a [T, CW] MMA operand in DT (slot o of channel c: token idx_base[o * H + c],
  value val_base[o * H + c]). A channel's slots are distinct tokens (`gear.operands`), so at
  most one slot matches an element: one compare and one 16-bit select per element and slot,
  and the tensor cores add the tile's product to the scores."""
  T: tl.constexpr = tloc.shape[0]
  CW: tl.constexpr = ch.shape[0]
  s = tl.zeros([T, CW], DT)
  for o in tl.static_range(NK):
    idx = tl.load(idx_base + o * H + ch, mask=tile_ok, other=0).to(tl.int32)
    val = tl.load(val_base + o * H + ch, mask=tile_ok, other=0.0).to(DT)
    s = tl.where(tloc[:, None] == idx[None, :], val[None, :], s)
  return s


@triton.jit
def _value_outlier_tile(svi, svv, ch, DT: tl.constexpr):
  """GEAR: the tokens' value outliers (slot o: channel svi[o] [T], value svv[o] [T], distinct
  channels per token) at channels ch [CW], as a [CW, T] MMA operand in DT (selects only)."""
  T: tl.constexpr = svi[0].shape[0]
  CW: tl.constexpr = ch.shape[0]
  s = tl.zeros([CW, T], DT)
  for o in tl.static_range(len(svi)):
    s = tl.where(ch[:, None] == svi[o][None, :], svv[o][None, :], s)
  return s


@triton.jit
def _key_scores(q_t, kc_base, ks_base, kz_base, t0, tile_ok, offs, t_ok, sk, tloc,
                H: tl.constexpr, QP: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr,
                G: tl.constexpr, T: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr,
                HAS_SK: tl.constexpr, NK: tl.constexpr):
  """Raw scores^T [T, QP] of tokens t0 + [0, T): sum over key planes j of K_j @ q_j^T.

  tile_ok: t0 < end (a sub-tile past the end must not read its group's scales).
  HAS_SK (GEAR): sk = (index, value) bases of the chunk's key outliers, tloc [T] the tokens'
  slots in the chunk; each plane's outliers are a second A operand (`_key_outlier_tile`).
  """
  PPB: tl.constexpr = 8 // BITS
  NSEG: tl.constexpr = H // (PPB * CW)
  ROW: tl.constexpr = H * BITS // 8
  cw = tl.arange(0, CW)
  sc_t = tl.zeros([T, QP], tl.float32)
  for seg in tl.static_range(NSEG):
    kb = tl.load(kc_base + offs[:, None] * ROW + (seg * CW + cw)[None, :], mask=t_ok[:, None],
                 other=0)
    for j in tl.static_range(seg * PPB, (seg + 1) * PPB):  # j: plane, j - seg * PPB: bit field
      if G % T == 0:  # the tile lies in token group t0 // G: one scale row per plane
        sp = (t0 // G) * H + j * CW + cw[None, :]
        s = tl.load(ks_base + sp, mask=tile_ok, other=0.0)
        z = tl.load(kz_base + sp, mask=tile_ok, other=0.0)
      else:  # general tiling: gather each token's group (slow path)
        sp = (offs // G)[:, None] * H + j * CW + cw[None, :]
        s = tl.load(ks_base + sp, mask=t_ok[:, None], other=0.0)
        z = tl.load(kz_base + sp, mask=t_ok[:, None], other=0.0)
      k_j = _dequant(kb, s, z, j - seg * PPB, BITS, DT, False, 0, FAST)
      sc_t = tl.dot(k_j, q_t[j], sc_t)
      if HAS_SK:
        sc_t = tl.dot(_key_outlier_tile(sk[0], sk[1], j * CW + cw, tloc, tile_ok, H, NK, DT),
                      q_t[j], sc_t)
  return sc_t


@triton.jit
def _value_update(accs, p, vc_base, vs_base, vz_base, t0, end, sv, H: tl.constexpr,
                  BITS: tl.constexpr, CW: tl.constexpr, GV: tl.constexpr, VB: tl.constexpr,
                  T: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr, HAS_SV: tl.constexpr,
                  NV: tl.constexpr):
  """accs[j] [CW, QP] += V_j^T @ p^T for every value plane j (tokens t0 + [0, T), < end).

  HAS_SV (GEAR): sv = (index, value) bases of the head's per-token value outliers, each
  plane's a second A operand (`_value_outlier_tile`).
  """
  PPB: tl.constexpr = 8 // BITS
  NSEG: tl.constexpr = H // (PPB * CW)
  ROW: tl.constexpr = H * BITS // 8
  NJ: tl.constexpr = H // GV
  WORDS: tl.constexpr = NJ > 1
  NW: tl.constexpr = NJ // 2 if WORDS else 1
  cw = tl.arange(0, CW)
  # Per-token scale/zero of every group: [T] int32 words of two 16-bit groups (NJ even) or
  # [T] DT (NJ = 1); contiguous tiles, so they pipeline like the codes.
  toks = t0 + tl.arange(0, T)
  if NW <= 2:  # one [T, 2] tile per array (coalesced, not re-loaded per thread), split in
    # registers; NW = 1 (two groups per token) loads each token's word twice and keeps one.
    wp = (toks * NW)[:, None] + (tl.arange(0, 2) % NW)[None, :]
    s0, s1 = tl.split(tl.load(vs_base + wp, mask=(toks < end)[:, None], other=0))
    z0, z1 = tl.split(tl.load(vz_base + wp, mask=(toks < end)[:, None], other=0))
    sw = (s0, s1) if NW == 2 else (s0,)
    zw = (z0, z1) if NW == 2 else (z0,)
  else:
    sw = ()
    zw = ()
    for w in tl.static_range(NW):
      sw = sw + (tl.load(vs_base + toks * NW + w, mask=toks < end, other=0),)
      zw = zw + (tl.load(vz_base + toks * NW + w, mask=toks < end, other=0),)
  if HAS_SV:  # NV (channel, value) slots per token, loaded once per sub-tile
    svi = ()
    svv = ()
    for o in tl.static_range(NV):
      svi = svi + (tl.load(sv[0] + toks * NV + o, mask=toks < end, other=0).to(tl.int32),)
      svv = svv + (tl.load(sv[1] + toks * NV + o, mask=toks < end, other=0.0).to(DT),)
  p_t = _to_dt(p, DT, FAST)
  # Token-blocked codes (`planar`): byte r of token t at (t // VB) * VB * ROW + r * VB + t % VB;
  # the tile [t0, t0 + T) lies in one block (T divides VB).
  tok = (t0 // VB) * (VB * ROW) + tl.multiple_of(t0 % VB, T) + tl.arange(0, T)
  for seg in tl.static_range(NSEG):
    # [CW, T]: channels as the MMA's M, tokens as K (contiguous in memory). Unmasked (a per-token
    # mask would split the vector loads): the tile never passes the capacity (T | VB | S), codes
    # past `end` decode to finite values, and their scale/zero are masked to 0.
    vb = tl.load(vc_base + tok[None, :] + ((seg * CW + cw) * VB)[:, None])
    for j in tl.static_range(seg * PPB, (seg + 1) * PPB):
      # plane j lies in channel group (j * CW) // GV: word // 2, half % 2 of that word.
      v_j = _dequant(vb, sw[(j * CW) // GV // 2][None, :], zw[(j * CW) // GV // 2][None, :],
                     j - seg * PPB, BITS, DT, WORDS, (j * CW) // GV % 2, FAST)
      acc = tl.dot(v_j, p_t, accs[j])
      if HAS_SV:
        acc = tl.dot(_value_outlier_tile(svi, svv, j * CW + cw, DT), p_t, acc)
      accs = accs[:j] + (acc,) + accs[j + 1:]
  return accs


@triton.jit
def _quant_part(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qlen_ptr, S, NSPLIT, b,
                b64, kh, sid, qk_scale, o_ptr, lse_ptr, prow, heads, row_ok, KH: tl.constexpr,
                QP: tl.constexpr, H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                KCW: tl.constexpr, VCW: tl.constexpr, G: tl.constexpr, GV: tl.constexpr,
                VB: tl.constexpr, BLOCK_S: tl.constexpr, KF16: tl.constexpr,
                VF16: tl.constexpr, FAST: tl.constexpr, gx, GEAR: tl.constexpr):
  """One chunk of the quantized prefix of one (batch, kv head).

  GEAR = (HAS_LR, HAS_SK, HAS_SV, NB, RP, RG, RA, NK, NV) (all 0 for KIVI, whose code is then
  unchanged) adds GEAR's residual terms (`kvlowrank_kernels.gear`), gx = their pointers
  (a_k, a_v, b_k, b_v, bp_k, bp_v, n_pchunks, sk_idx, sk_val, sv_idx, sv_val, q_k: q in the
  key MMA dtype, read instead of q when HAS_LR). A loop step
  lies in one chunk of NB tokens (BLOCK_S | NB):
    HAS_LR: low rank, factored, ranks padded to 16 (one MMA dim) with zero columns:
      scores^T += a_k [T, 16] @ qB^T per sub-tile, qB^T [16, QP] = B^T q^T (B: the prefill
      factor bp_k for chunks < n_pchunks, computed once per program; else the chunk's b_k[c],
      once per step); pa [16, QP] = sum of a_v^T [16, T] @ p^T over the step's sub-tiles,
      then for a streaming chunk acc_j += b_v[c]_j [CW, 16] @ pa at once (the step's p share
      its running max), for a prefill chunk pa joins pa_p (rescaled like the accumulators),
      applied once at the end: acc_j += bp_v_j @ pa_p;
    HAS_SK / HAS_SV: per plane, the outliers as a second [T, CW] / [CW, T] A operand built by
      one compare and one 16-bit select per element and slot (a slot's tokens / channels are
      distinct), multiplied by the tensor cores. Until 2026-11-29 they were added into the
      dequantized tile in fp32 (compare, select, add per slot, and a fp32 round trip).
  """
  HAS_LR: tl.constexpr = GEAR[0]
  HAS_SK: tl.constexpr = GEAR[1]
  HAS_SV: tl.constexpr = GEAR[2]
  NB: tl.constexpr = GEAR[3]
  RP: tl.constexpr = GEAR[4]
  RG: tl.constexpr = GEAR[5]
  RA: tl.constexpr = GEAR[6]
  NK: tl.constexpr = GEAR[7]
  NV: tl.constexpr = GEAR[8]
  R16: tl.constexpr = 16  # the low-rank MMA dim (ranks padded)
  KDT: tl.constexpr = tl.float16 if KF16 else tl.bfloat16  # key MMA operands
  VDT: tl.constexpr = tl.float16 if VF16 else tl.bfloat16  # value MMA operands
  NPK: tl.constexpr = H // KCW
  NPV: tl.constexpr = H // VCW
  NJ: tl.constexpr = H // GV
  NW: tl.constexpr = NJ // 2 if NJ > 1 else 1
  # Sub-tiles of T tokens (NSUB per loop step, one online-softmax step for all): T divides the
  # value code block VB, and lies in one key group when G is a power of 2 >= 16.
  T0: tl.constexpr = BLOCK_S if BLOCK_S < VB else VB
  T: tl.constexpr = G if (G < T0 and G >= 16 and T0 % G == 0) else T0
  NSUB: tl.constexpr = BLOCK_S // T
  start, end = split_range(qlen_ptr, b, sid, NSPLIT, BLOCK_S)
  head = b64 * KH + kh
  kc_base = kc_ptr + head * S * (H * KBITS // 8)
  vc_base = vc_ptr + head * S * (H * VBITS // 8)
  ks_base = ks_ptr + head * (S // G) * H
  kz_base = kz_ptr + head * (S // G) * H
  vs_base = vs_ptr + head * S * NW
  vz_base = vz_ptr + head * S * NW
  # q^T per key plane (unscaled, the key scale's dtype): the B operand of the key dots.
  kcw = tl.arange(0, KCW)
  # GEAR-L reads q from gx[11], cast to the key dtype by the wrapper (same values): with the
  # cast here (bf16 -> KDT, elementwise) Triton converts the raw planes to the MMA operand
  # layout before the loop and keeps them (and the low-rank products' second copy) in
  # registers across it (+32 live registers per thread); loaded in KDT, each plane stays in
  # shared memory and is read at its dot, as the KIVI kernel does.
  if HAS_LR:
    q_src = gx[11]
  else:
    q_src = q_ptr
  q_t = ()
  for j in tl.static_range(NPK):
    qj = tl.load(q_src + heads[None, :] * H + (j * KCW + kcw)[:, None], mask=row_ok[None, :],
                 other=0.0)
    q_t = q_t + (_to_dt(qj.to(tl.float32), KDT, FAST),)
  accs = ()
  for j in tl.static_range(NPV):
    accs = accs + (tl.zeros([VCW, QP], tl.float32),)
  m_i = tl.full([QP], float("-inf"), tl.float32)
  # Softmax denominator kept per (token slot, row) and summed once at the end: a per-tile sum
  # over tokens would be a cross-warp reduction (tokens are the MMA's M, split over warps).
  l_t = tl.zeros([T, QP], tl.float32)
  tcol = tl.arange(0, T)
  if HAS_LR or HAS_SK:
    n_chunks = S // NB
  if HAS_LR:
    npc = tl.load(gx[6] + b)
    rr = tl.arange(0, R16)
    ak_base = gx[0] + head * S * RA
    av_base = gx[1] + head * S * RA
    bpk_base = gx[4] + head * H * RP
    bpv_base = gx[5] + head * H * RP
    vcw_lr = tl.arange(0, VCW)
    # One prefill factor for every prefill chunk: its qB^T once per program; its p-weighted
    # a_v sum pa_p carried over the steps (rescaled like the accumulators), applied at the end.
    qbt_p = tl.zeros([R16, QP], tl.float32)
    for j in tl.static_range(NPK):
      bt = tl.load(bpk_base + (j * KCW + kcw)[None, :] * RP + rr[:, None],
                   mask=(rr < RP)[:, None], other=0.0)
      qbt_p = tl.dot(_to_dt(bt.to(tl.float32), KDT, FAST), q_t[j], qbt_p)
    qbt_p = _to_dt(qbt_p, KDT, FAST)
    pa_p = tl.zeros([R16, QP], tl.float32)
  if HAS_SV:
    sv = (gx[9] + head * S * NV, gx[10] + head * S * NV)
  else:
    sv = ()
  for t0 in range(start, end, BLOCK_S):
    t0 = tl.multiple_of(t0, BLOCK_S)
    if HAS_LR or HAS_SK:
      c = t0 // NB
    if HAS_LR:
      pre = c < npc
      if pre:
        qbt = qbt_p
      else:  # a streaming chunk: its own factor
        bk_base = gx[2] + (head * n_chunks + c) * (H * RG)
        qbt_c = tl.zeros([R16, QP], tl.float32)
        for j in tl.static_range(NPK):
          bt = tl.load(bk_base + (j * KCW + kcw)[None, :] * RG + rr[:, None],
                       mask=(rr < RG)[:, None], other=0.0)
          qbt_c = tl.dot(_to_dt(bt.to(tl.float32), KDT, FAST), q_t[j], qbt_c)
        qbt = _to_dt(qbt_c, KDT, FAST)
      pa = tl.zeros([R16, QP], tl.float32)
    if HAS_SK:
      sk = (gx[7] + (head * n_chunks + c) * (NK * H), gx[8] + (head * n_chunks + c) * (NK * H))
    else:
      sk = ()
    scs = ()
    m_new = m_i
    for u in tl.static_range(NSUB):
      offs = t0 + u * T + tcol
      t_ok = offs < end
      if HAS_SK:
        tloc = offs - c * NB
      else:
        tloc = offs
      sc_t = _key_scores(q_t, kc_base, ks_base, kz_base, t0 + u * T, t0 + u * T < end, offs,
                         t_ok, sk, tloc, H, QP, KBITS, KCW, G, T, KDT, FAST, HAS_SK, NK)
      if HAS_LR:
        ak = tl.load(ak_base + offs[:, None] * RA + rr[None, :],
                     mask=t_ok[:, None] & (rr < RA)[None, :], other=0.0)
        sc_t = tl.dot(_to_dt(ak.to(tl.float32), KDT, FAST), qbt, sc_t)
      sc_t = sc_t * qk_scale
      sc_t = tl.where(t_ok[:, None], sc_t, float("-inf"))
      m_new = tl.maximum(m_new, tl.max(sc_t, 0))
      scs = scs + (sc_t,)
    alpha = tl.exp2(m_i - m_new)
    l_t = l_t * alpha[None, :]
    for j in tl.static_range(NPV):
      accs = accs[:j] + (accs[j] * alpha[None, :],) + accs[j + 1:]
    for u in tl.static_range(NSUB):
      p = tl.exp2(scs[u] - m_new[None, :])
      l_t = l_t + p
      accs = _value_update(accs, p, vc_base, vs_base, vz_base, t0 + u * T, end, sv, H, VBITS,
                           VCW, GV, VB, T, VDT, FAST, HAS_SV, NV)
      if HAS_LR:
        offs = t0 + u * T + tcol
        avt = tl.load(av_base + offs[None, :] * RA + rr[:, None],
                      mask=(offs < end)[None, :] & (rr < RA)[:, None], other=0.0)
        pa = tl.dot(_to_dt(avt.to(tl.float32), VDT, FAST), _to_dt(p, VDT, FAST), pa)
    if HAS_LR:
      pa_p = pa_p * alpha[None, :]
      if pre:
        pa_p = pa_p + pa
      else:  # a streaming chunk: acc_j += B_v,j @ pa now
        bv_base = gx[3] + (head * n_chunks + c) * (H * RG)
        pa_t = _to_dt(pa, VDT, FAST)
        for j in tl.static_range(NPV):
          bv = tl.load(bv_base + (j * VCW + vcw_lr)[:, None] * RG + rr[None, :],
                       mask=(rr < RG)[None, :], other=0.0)
          accs = accs[:j] + (tl.dot(_to_dt(bv.to(tl.float32), VDT, FAST), pa_t, accs[j]),) + \
              accs[j + 1:]
    m_i = m_new
  if HAS_LR:  # the prefill tokens' low-rank values: acc_j += B_p,j @ pa_p
    pa_t = _to_dt(pa_p, VDT, FAST)
    for j in tl.static_range(NPV):
      bv = tl.load(bpv_base + (j * VCW + vcw_lr)[:, None] * RP + rr[None, :],
                   mask=(rr < RP)[None, :], other=0.0)
      accs = accs[:j] + (tl.dot(_to_dt(bv.to(tl.float32), VDT, FAST), pa_t, accs[j]),) + \
          accs[j + 1:]
  l_i = tl.sum(l_t, 0)
  l_safe, lse = split_lse(m_i, l_i)
  vcw = tl.arange(0, VCW)
  for j in tl.static_range(NPV):
    tl.store(o_ptr + prow[None, :] * H + (j * VCW + vcw)[:, None], accs[j] / l_safe[None, :],
             mask=row_ok[None, :])
  tl.store(lse_ptr + prow, lse, mask=row_ok)


@triton.jit
def _kivi_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
               wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH: tl.constexpr,
               QPK: tl.constexpr, QP: tl.constexpr, H: tl.constexpr, KBITS: tl.constexpr,
               VBITS: tl.constexpr, KCW: tl.constexpr, VCW: tl.constexpr, G: tl.constexpr,
               GV: tl.constexpr, VB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
               KF16: tl.constexpr, VF16: tl.constexpr, FAST: tl.constexpr, gx,
               GEAR: tl.constexpr):
  """KIVI decode attention (GEAR's residual terms when GEAR / gx say so; `_quant_part`)."""
  pid = tl.program_id(0)
  sid = tl.program_id(1)
  b = pid // KH
  kh = pid % KH
  N: tl.constexpr = KH * QPK
  b64 = b.to(tl.int64)
  rows = tl.arange(0, QP)
  row_ok = rows < QPK
  heads = b64 * N + kh * QPK + rows
  qk_scale = sm_scale * 1.4426950408889634
  prow = heads * (NSPLIT + 1) + sid
  if sid == NSPLIT:
    cols = tl.arange(0, H)
    q = tl.load(q_ptr + heads[:, None] * H + cols[None, :], mask=row_ok[:, None], other=0.0)
    q = _to_dt(q.to(tl.float32), tl.bfloat16, False)
    _window_part(q, qk_scale, kw_ptr, vw_ptr, wlen_ptr, W, b64, kh, o_ptr, lse_ptr, prow, row_ok,
                 KH, QP, H, BLOCK_W)
  else:
    part = sid
    if GEAR[0]:
      # GEAR-L with streaming chunks (each of their steps loads and applies its own factors)
      # after the prefill segment: the last split's programs run longest, and the grid
      # launches them last, as the tail. Such rows take their splits in reverse, so those
      # programs start in the first wave (partial slot sid holds split NSPLIT - 1 - sid; the
      # combine sums every slot). Rows with none keep the order, which measured faster for
      # them (results/gear_kernel.md, "Split order").
      streams = tl.load(gx[6] + b) * GEAR[3] < tl.load(qlen_ptr + b)
      part = tl.where(streams, NSPLIT - 1 - sid, sid)
    _quant_part(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qlen_ptr, S, NSPLIT, b,
                b64, kh, part, qk_scale, o_ptr, lse_ptr, prow, heads, row_ok, KH, QP, H, KBITS,
                VBITS, KCW, VCW, G, GV, VB, BLOCK_S, KF16, VF16, FAST, gx, GEAR)


@triton.jit
def kivi_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
                wlen_ptr, S, W, NSPLIT, sm_scale, o_init, lse_init, o_ptr, lse_ptr,
                KH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr, H: tl.constexpr,
                KBITS: tl.constexpr, VBITS: tl.constexpr, KCW: tl.constexpr, VCW: tl.constexpr,
                G: tl.constexpr, GV: tl.constexpr, VB: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_W: tl.constexpr, KF16: tl.constexpr, VF16: tl.constexpr,
                FAST: tl.constexpr):
  _kivi_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
             wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH, QPK, QP, H, KBITS, VBITS, KCW,
             VCW, G, GV, VB, BLOCK_S, BLOCK_W, KF16, VF16, FAST, (), NO_GEAR)


def _scale_dtype(x, name):
  """16-bit scales are used raw (the kernel computes in their dtype); others are cast to bf16."""
  if x.dtype in (jnp.float16, jnp.bfloat16):
    return x
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"triton kivi attention: {name} must be floating, got {x.dtype}")
  return x.astype(jnp.bfloat16)


def _value_words(x):
  """[B, K, S, NJ] 16-bit value scales -> [B, K, S, NJ / 2] int32 words (NJ even), else as is."""
  b, kh, s, nj = x.shape
  if nj == 1:
    return x
  return jax.lax.bitcast_convert_type(x.reshape(b, kh, s, nj // 2, 2), jnp.int32)


def kivi_attention_triton(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len, *,
                          scale=None, out_dtype=None, block_s=None, block_w=32, num_splits=None,
                          target_programs=None, num_warps=2, num_stages=4,
                          poison=False, return_partials=False, fast=None, min_rows=1):
  """Fused KIVI decode attention; same contract as `kivi_attention_reference`.

  Extra Args:
    block_s, block_w, num_splits, target_programs, num_warps, num_stages, min_rows: knobs.
      Defaults: 32-token steps, 2 warps (the MMAs split their 32 rows over the warps; more
      warps would duplicate the dequantization), 4 stages, and 3x the dense kernel's
      program target (each program's loop is a long dependent chain per tile, so more
      programs per multiprocessor hide more latency). Sweep them on the target GPU.
    poison: NaN-fill the partial buffers first (tests: every element must be written).
    return_partials: also return the raw (o, lse) partials.
    fast: inline-PTX dequantization (None: on unless running in the Triton interpreter).
  """
  h = q.shape[-1]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  scale = np.float32(h ** -0.5 if scale is None else scale)
  ks = _scale_dtype(keys.scale, "keys.scale")
  vs = _scale_dtype(values.scale, "values.scale")
  keys = KiviKeys(codes=keys.codes, scale=ks, zero=_scale_dtype(keys.zero, "keys.zero").astype(
      ks.dtype), bits=keys.bits, group=keys.group)
  values = KiviValues(codes=values.codes, scale=vs, zero=_scale_dtype(
      values.zero, "values.zero").astype(vs.dtype), bits=values.bits, group=values.group)
  p = plan(q.shape, keys, values, k_win.shape[1], block_s=block_s, block_w=block_w,
           num_splits=num_splits, target_programs=target_programs or 3 * splitk.TARGET_PROGRAMS,
           fast=fast, min_rows=min_rows)
  return triton_backend.launch_split_k(
      kivi_kernel,
      q, keys.codes, keys.scale, keys.zero, values.codes, _value_words(values.scale),
      _value_words(values.zero),
      k_win.astype(jnp.bfloat16), v_win.astype(jnp.bfloat16), q_len.astype(jnp.int32),
      w_len.astype(jnp.int32), int(keys.codes.shape[2]), int(k_win.shape[1]), p["num_splits"],
      scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, out_dtype=out_dtype or q.dtype, return_partials=return_partials,
      **p["constexprs"])
