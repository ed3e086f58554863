"""GEMM-shaped fused XQuant decode kernel: rematerialise K|V and attend, K/V never in HBM.

One program = (KV head kh, split sid, batch row b); it walks its split's cached tokens
in tiles of BLOCK_M rows. Per tile:

  mainloop (a real GEMM, tensor cores): for c0 in 0 .. C step BLOCK_K
      A  = dequant(X codes [BLOCK_M, BLOCK_K])        in registers, cast to W's dtype
      acc_k += A @ W_k[c0 : c0 + BLOCK_K, kh·H : kh·H + H]      (B operand via smem,
      acc_v += A @ W_v[ ... same columns ... ]                  num_stages-pipelined)
    The dequantized tile is the LHS (A) operand of `tl.dot`: Triton keeps it in
    registers (Hopper wgmma takes A from registers) and moves its layout conversion
    up to the code loads; the weight slices stream through shared memory. N = H per
    accumulator, 2·H (= 256 for H = 128) columns per A tile on the X path. On the GQA
    latent path K and V read their own latent stores: two mainloops (X·U_k then X·U_v).
  epilogue (per head): k = acc_k + b_k; RoPE is applied to the *query* side: with
    half-rotation pairs (j, j + H/2) and the key's angle θ_t,
        q·RoPE_t(k) = Σ_j (k_j cos θ_tj) qa_j + (k_j sin θ_tj) qb_j,
        qa = q, qb = (q[H/2:], −q[:H/2]),
    so scores [GP, BLOCK_M] = qa·(k∘cos)ᵀ + qb·(k∘sin)ᵀ (two small MMAs, the G query
    heads sharing kh padded to GP >= 16 rows, scale·log2 e folded into q), no register
    half-swap of k. Online softmax in base 2, acc [GP, H] += P·acc_v; b_v is added once
    after the split merge (the weights sum to 1).
  Each split writes its normalised partial and LSE (`dense.triton_decode.store_partial`);
  `splitk.combine_partials` merges them (flash-decoding).

Program order and L2 (grid (KH, NSPLIT, B), axis 0 fastest): consecutive programs are
the KH heads of one token range, so a tile's codes are read from HBM once and served
from L2 to the other heads, while the weights are re-read from L2 by every tile. Per
tile of 64 tokens (the default BLOCK_M), by arithmetic: X path (Llama-2-7B, 2-bit) codes
64 KB + scales 8 KB, W slices 2 MB, 134 MFLOP; latent path (Llama-3.1-8B) 32 KB + 0.5 MB,
34 MFLOP. A wave of one program per SM covers a few token ranges × all 32 heads on the X
path, i.e. all of [W_k|W_v] (64 MB, streamed in k-order in lockstep, so only a
BLOCK_K-row band of it is live in L2 at a time) plus well under a MB of codes; on the
latent path more ranges × 8 heads: all Σ·Bᵀ (4 MB, L2-resident) plus the codes. HBM
traffic is therefore far below what the wave's MMA time allows; the cost that stays is
the L2 -> SM traffic of the weights, 2 MB per 64 tokens and head, which a larger BLOCK_M
would halve, but BLOCK_M = 128 does not fit the registers (it spills with 8 warps:
`experiments/probes/ptx_stats.py`).

Defaults (tuned with `experiments/bench_xquant.py --quick` at 2 bits; measurements in
BENCHMARKS.md): BLOCK_M 64, BLOCK_K 64, 8 warps (two warpgroups: the wgmma accumulators
are 2 x 32 registers per thread), 3 stages (the W slices two K steps ahead). The code
words and scales are loaded in compact tiles one K step ahead in registers (`_mainloop`):
with per-element loads, Triton's pipeliner left the dequant loads stalling every K step.

Numerics: MMA operands in W's dtype (bf16 in use), fp32 accumulation; the rotated keys,
query, P and V enter their MMAs in the same dtype. fp32 weights (CPU-sized test models)
keep fp32 products throughout (`triton_dequant.mma`, EXACT) instead of TF32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import splitk, triton_backend
from ..dense.triton_decode import split_range, store_partial
from .triton_dequant import (as_int32, bits_meta, check_pow2, dequant_tile, expand_codes, fast_path,
                             load_codes, load_scales, mma, pick_block_k)

# Programs to aim for: several waves of 132 SMs (each tile is a long GEMM, so waves
# are coarse: more programs keep the last wave's idle share small).
TARGET_PROGRAMS = 1056


@triton.jit
def _mainloop(codes_ptr, scale_ptr, zero_ptr, rows, ok, row0, wa_cols, wb_cols, C: tl.constexpr,
              NW: tl.constexpr, BITS: tl.constexpr, TOK: tl.constexpr, GRP: tl.constexpr,
              NCOL: tl.constexpr, H: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
              FAST: tl.constexpr, EXACT: tl.constexpr):
  """acc_a (, acc_b) [BLOCK_M, H] fp32 = X̂_tile @ W[:, cols] over all C channels.

  FAST (`triton_dequant.fast_path`): compact code-word and scale loads, issued one K step
  ahead in registers (their latency hides behind the current step's MMAs), expanded
  with shifts in registers; otherwise the per-element `dequant_tile` (any layout).
  """
  DT = wa_cols.dtype.element_ty
  acc_a = tl.zeros([BLOCK_M, H], tl.float32)
  acc_b = tl.zeros([BLOCK_M, H], tl.float32)
  if FAST:
    w0, w1 = load_codes(codes_ptr, rows, ok, 0, NW, BITS, BLOCK_K)
    s, z = load_scales(scale_ptr, zero_ptr, rows, ok, row0, 0, C, TOK, GRP, BLOCK_K)
    for c0 in range(0, C, BLOCK_K):
      nk = (c0 + BLOCK_K) % C           # the last step prefetches step 0 again (unused)
      n0, n1 = load_codes(codes_ptr, rows, ok, nk, NW, BITS, BLOCK_K)
      ns, nz = load_scales(scale_ptr, zero_ptr, rows, ok, row0, nk, C, TOK, GRP, BLOCK_K)
      a = (expand_codes(w0, w1, BITS, BLOCK_M, BLOCK_K) * s + z).to(DT)
      rk = (c0 + tl.arange(0, BLOCK_K))[:, None] * NCOL
      acc_a = mma(a, tl.load(wa_cols + rk), acc_a, EXACT)
      if TWO:
        acc_b = mma(a, tl.load(wb_cols + rk), acc_b, EXACT)
      w0 = n0
      w1 = n1
      s = ns
      z = nz
  else:
    for c0 in range(0, C, BLOCK_K):
      a = dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, ok, row0, c0, C, NW, BITS, TOK,
                       GRP, BLOCK_M, BLOCK_K).to(DT)
      rk = (c0 + tl.arange(0, BLOCK_K))[:, None] * NCOL
      acc_a = mma(a, tl.load(wa_cols + rk), acc_a, EXACT)
      if TWO:
        acc_b = mma(a, tl.load(wb_cols + rk), acc_b, EXACT)
  return acc_a, acc_b


@triton.jit
def remat_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr, wv_ptr, bk_ptr,
                 cos_ptr, sin_ptr, len_ptr, S, SV, NSPLIT, o_init, lse_init, o_ptr, lse_ptr,
                 KH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, H: tl.constexpr,
                 QSCALE: tl.constexpr, SHARED: tl.constexpr, CK: tl.constexpr, NWK: tl.constexpr,
                 BITSK: tl.constexpr, TOKK: tl.constexpr, GRPK: tl.constexpr, CV: tl.constexpr,
                 NWV: tl.constexpr, BITSV: tl.constexpr, TOKV: tl.constexpr, GRPV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr,
                 FASTK: tl.constexpr, FASTV: tl.constexpr):
  kh = tl.program_id(0)
  sid = tl.program_id(1)
  b = tl.program_id(2)
  start, end = split_range(len_ptr, b, sid, NSPLIT, BLOCK_M)
  N: tl.constexpr = KH * G
  H2: tl.constexpr = H // 2
  NCOL: tl.constexpr = KH * H
  DT = wk_ptr.dtype.element_ty          # MMA operand dtype = the weights'
  b64 = b.to(tl.int64)
  g = tl.arange(0, GP)
  g_ok = g < G
  hh = tl.arange(0, H)
  heads = kh * G + g
  qrow = q_ptr + (b64 * N + heads)[:, None] * H
  qa = tl.load(qrow + hh[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32) * QSCALE
  sign = tl.where(hh < H2, 1.0, -1.0)
  qb = tl.load(qrow + ((hh + H2) % H)[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
  qb = qb * (QSCALE * sign)[None, :]
  qa = qa.to(DT)
  qb = qb.to(DT)
  hmod = hh % H2
  wk_cols = wk_ptr + kh * H + hh[None, :]
  wv_cols = wv_ptr + kh * H + hh[None, :]
  m_i = tl.full([GP], float("-inf"), tl.float32)
  l_i = tl.zeros([GP], tl.float32)
  acc = tl.zeros([GP, H], tl.float32)
  for s0 in range(start, end, BLOCK_M):
    rs = s0 + tl.arange(0, BLOCK_M)
    ok = rs < end
    row0 = b64 * S + s0
    rows = row0 + tl.arange(0, BLOCK_M)
    acc_k, acc_v = _mainloop(kc_ptr, ks_ptr, kz_ptr, rows, ok, row0, wk_cols, wv_cols, CK, NWK,
                             BITSK, TOKK, GRPK, NCOL, H, BLOCK_M, BLOCK_K, SHARED, FASTK, EXACT)
    # Scores with RoPE on the query side (module doc).
    # (Bias loaded per tile, not held across the loop: a [H] vector in the accumulator
    # layout costs H/4 registers per thread.)
    k = acc_k + tl.load(bk_ptr + kh * H + hh).to(tl.float32)[None, :]
    tab = rs[:, None] * H2 + hmod[None, :]
    kc = (k * tl.load(cos_ptr + tab, mask=ok[:, None], other=0.0).to(tl.float32)).to(DT)
    sc = mma(qa, tl.trans(kc), tl.zeros([GP, BLOCK_M], tl.float32), EXACT)
    ksn = (k * tl.load(sin_ptr + tab, mask=ok[:, None], other=0.0).to(tl.float32)).to(DT)
    sc = mma(qb, tl.trans(ksn), sc, EXACT)
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not SHARED:
      vrow0 = b64 * SV + s0
      vrows = vrow0 + tl.arange(0, BLOCK_M)
      acc_v, _ = _mainloop(vc_ptr, vs_ptr, vz_ptr, vrows, ok, vrow0, wv_cols, wv_cols, CV, NWV,
                           BITSV, TOKV, GRPV, NCOL, H, BLOCK_M, BLOCK_K, False, FASTV, EXACT)
    v = acc_v.to(DT)   # b_v is added after the split merge (Σ p = 1)
    acc = mma(p.to(DT), v, acc * alpha[:, None], EXACT)
    m_i = m_new
  store_partial(o_ptr, lse_ptr, acc, m_i, l_i, (b64 * N + heads) * NSPLIT + sid, g_ok, H)


def plan(q_shape, k_rows, v_rows, wk_shape, wv_shape, *, n_kv_heads: int, block_m: int = 64,
         block_k: int = 64, num_splits=None, target_programs=None, exact: bool = False):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check.

  Args:
    q_shape: (B, N, H).
    k_rows, v_rows: PackedRows (v_rows None: X path, K and V share k_rows); their slot
      counts may differ (a per-channel store allocates whole token groups), every valid
      position (< lens) must be a slot of both and of the cos/sin tables.
    wk_shape, wv_shape: (C_k, K·H), (C_v, K·H).
    n_kv_heads: K.
    block_m: tokens per tile (power of 2 >= 16).
    block_k: channels per mainloop step (falls back to 64/32/16 if it does not divide C).
    num_splits: explicit split count per (batch, head); None = aim for target_programs.
    exact: fp32 operands with fp32 products (fp32 weights).
  Returns:
    dict(grid, num_splits, constexprs, out_shapes).
  """
  b, n, h = q_shape
  kh = n_kv_heads
  s = k_rows.codes.shape[1]
  check_pow2("fused XQuant kernel: head dim", h)
  check_pow2("fused XQuant kernel: block_m", block_m)
  if n % kh:
    raise ValueError(f"fused XQuant kernel: n_heads ({n}) must be a multiple of n_kv_heads ({kh})")
  if wk_shape[1] != kh * h or wv_shape[1] != kh * h:
    raise ValueError(f"fused XQuant kernel: wk/wv must have {kh * h} columns, got "
                     f"{wk_shape} / {wv_shape}")
  shared = v_rows is None
  vr = k_rows if shared else v_rows
  ck, cv = wk_shape[0], wv_shape[0]
  if shared and ck != cv:
    raise ValueError(f"fused XQuant kernel: shared rows need wk and wv of equal depth, got "
                     f"{ck} / {cv}")
  bk = pick_block_k(math.gcd(ck, cv), block_k)
  for name, r in (("k_rows", k_rows), ("v_rows", vr)):
    if r.axis == "channel" and r.codes.shape[1] % r.group:
      raise ValueError(f"fused XQuant kernel: {name} slots ({r.codes.shape[1]}) must be whole "
                       f"token groups of {r.group}")
  g = n // kh
  ns = splitk.choose_num_splits(b * kh, s, block_m, requested=num_splits, min_tiles=1,
                                target=target_programs or TARGET_PROGRAMS)
  consts = dict(KH=kh, G=g, GP=max(16, 1 << (g - 1).bit_length()), H=h,
                QSCALE=float(np.float32(1.4426950408889634 / math.sqrt(h))), SHARED=shared,
                CK=ck, TOKK=k_rows.axis == "token", GRPK=k_rows.group, CV=cv,
                TOKV=vr.axis == "token", GRPV=vr.group, BLOCK_M=block_m, BLOCK_K=bk,
                EXACT=bool(exact),
                FASTK=fast_path(k_rows.bits, k_rows.axis, k_rows.group, block_m, bk),
                FASTV=fast_path(vr.bits, vr.axis, vr.group, block_m, bk),
                **bits_meta(k_rows.bits, ck, "K"), **bits_meta(vr.bits, cv, "V"))
  return dict(grid=(kh, ns, b), num_splits=ns, constexprs=consts,
              out_shapes=[jax.ShapeDtypeStruct((b, n, ns, h), jnp.float32),
                          jax.ShapeDtypeStruct((b, n, ns), jnp.float32)])


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, return_lse: bool = False, block_m: int = 64,
                           block_k: int = 64, num_splits=None, target_programs=None,
                           num_warps: int = 8, num_stages: int = 3, poison: bool = False):
  """Fused rematerialise-and-attend decode (one query token per row), GEMM-shaped.

  Args mirror reference.remat_decode_attention; tuning: block_m, block_k, num_splits,
  target_programs, num_warps, num_stages; poison NaN-fills the partials first (tests).
  Returns:
    out [B, N, H] fp32 (and lse [B, N] when return_lse).
  """
  p = plan(q.shape, k_rows, v_rows, wk.shape, wv.shape, n_kv_heads=n_kv_heads,
           block_m=block_m, block_k=block_k, num_splits=num_splits,
           target_programs=target_programs, exact=wk.dtype == jnp.float32)
  shared = v_rows is None
  vr = k_rows if shared else v_rows
  flat = lambda a: a.reshape(-1, a.shape[-1])
  # RoPE tables in the operand dtype (k∘cos is rounded to it anyway; halves the tile's
  # registers); fp32 for fp32 weights.
  tab_dt = jnp.float32 if wk.dtype == jnp.float32 else wk.dtype
  o, lse = triton_backend.launch(
      remat_kernel, q, as_int32(flat(k_rows.codes)), flat(k_rows.scale),
      flat(k_rows.zero), as_int32(flat(vr.codes)), flat(vr.scale), flat(vr.zero), wk,
      wv.astype(wk.dtype), bk.astype(jnp.float32), cos.astype(tab_dt), sin.astype(tab_dt),
      lens.astype(jnp.int32), int(k_rows.codes.shape[1]), int(vr.codes.shape[1]), p["num_splits"],
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, **p["constexprs"])
  out, total = splitk.combine_partials(o, lse, jnp.float32)
  # + b_v once per output row (the softmax weights sum to 1); rows with no key stay 0.
  b, n, h = q.shape
  bias = jnp.repeat(bv.astype(jnp.float32).reshape(n_kv_heads, h), n // n_kv_heads, axis=0)
  out = jnp.where(jnp.isfinite(total)[..., None], out + bias[None], out)
  return (out, total) if return_lse else out
