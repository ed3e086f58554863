"""The ragged-head decode kernel over planar KIVI codes: the quantized rotated (FDC / ZACK)
cache's store read as it is stored, dequantized tile by tile inside the kernel.

Operands (`kivi.planar`, one pseudo-head of Σk key and Σv value channels: the rotated cache's
inner KIVI store): key codes [B, 1, S, Σk bits / 8] per channel over groups of 16 tokens
(scale / zero [B, 1, S / 16, Σk]); value codes, token-blocked, [B, 1, S, Σv bits / 8] per token
over groups of 16 channels (scale / zero [B, 1, S, Σv / 16]); 2- or 4-bit codes, 16-bit scales.
Programs, records (LPT launch order), compact partials and the combine are `triton_ragged`'s:
only the loop that reads the operands differs.

Loop step: BLOCK_S tokens as sub-tiles of T = 16 tokens (one key group; T divides the value
code block), one online-softmax step per loop step. A program's head group occupies the
16-aligned channels [koff, koff + 16 kw16) of the packed rows (widths are multiples of 16),
read as one whole-width tile per sub-tile and operand, with the query rows on the MMA's M:
  keys:   scores [GP, T] = q [GP, KW] @ K^T [KW, T]   (q: the block-diagonal query, zero
          outside each row's head; the A operand, held in registers for the whole loop),
  values: acc [GP, VW]  += p [GP, T] @ V [T, VW],
the dequantized code tiles as the B operands. Why this way round: with the tokens on M
(scores^T = K q^T) every warp needed the whole key tile, since a [T, GP] = [16, 16] product
splits over the warps only along GP; here each warp reads its own token columns of K^T and
its own channel columns of V.
Codes are dequantized by the KIVI kernels' device function (`kivi.triton_dequant.dequant`:
c * s + z, exact code, one rounding to the scales' dtype, which is the MMA dtype; inline PTX on
the GPU). Where a channel sits in a row depends on the store's plane width CW and on the group's
run-time offset (`_row_bytes`): for CW >= 16, runs of 16 contiguous bytes from multiples of 16,
told to the compiler so that the key tile loads as 16-byte vectors; for a smaller CW, a gather
(correct, slower). A channel's bit field is a run-time shift, constant over runs of CW >= 4
channels (widths and groups are multiples of 16, so CW >= 4 at 2 and 4 bits): the device
function shifts each 32-bit word of 4 codes once (`dequant(..., sh=)`), which needs the 4
codes it packs to share their field, as 4 consecutive channels (or tokens) of an aligned run
do. Key scales: one [KW] row per sub-tile (cp.async through the pipeliner). Value scales and
zeros [T, VW / 16] per sub-tile, repeated over each group's 16 channels: 2-byte loads at a
run-time column offset, which the pipeliner's cp.async does not take, so the loop loads the
next step's [BLOCK_S, VW / 16] one step ahead by hand (their latency was the loop's critical
path). Channels past the group's width load nothing (masked) and meet zero query columns.
Measurements: `results/rotated_kernel.md`, "Reading the codes".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import triton_backend
from ..dense.triton_decode import split_lse
from ..kivi.planar import VALUE_BLOCK
from ..kivi.triton_dequant import dequant as _dequant
from ..kivi.triton_dequant import to_dtype as _to_dt
from .triton_plan import DEFAULT_GROUP_WIDTH, check_store, plan
from .triton_ragged import launch_combine, launch_records, load_record

# Tokens per loop step: two 16-token sub-tiles (one whole-width key and value tile each).
QUANT_BLOCK_S = 32


@triton.jit
def _row_bytes(c0, N: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr):
  """Byte columns and bit shifts [N] of channels c0 + [0, N) (c0 a multiple of 16) in a
  planar row: channel c sits in byte (c // (ppb CW)) CW + c % CW at bits ((c // CW) % ppb)
  BITS (`kivi.planar`). CW >= 16: runs of 16 contiguous bytes from multiples of 16 (told to the
  compiler, so the loads are 16-byte vectors)."""
  PPB: tl.constexpr = 8 // BITS
  c = c0 + tl.arange(0, N)
  by = (c // (PPB * CW)) * CW + c % CW
  if CW >= 16:
    by = tl.max_contiguous(tl.multiple_of(by, 16), 16)
  return by, ((c // CW) % PPB) * BITS


@triton.jit
def _value_scales(vs_base, vz_base, toks, end, jv, gmask, NJV: tl.constexpr):
  """Value scale and zero [len(toks), NV] of tokens toks: group jv of token t at t NJV + jv
  (masked: tokens >= end, groups outside gmask)."""
  gp = toks[:, None] * NJV + jv[None, :]
  mask = (toks < end)[:, None] & gmask
  return (tl.load(vs_base + gp, mask=mask, other=0.0),
          tl.load(vz_base + gp, mask=mask, other=0.0))


@triton.jit
def ragged_quant_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rec_ptr, row_ptr,
                        S, sm_scale, o_init, lse_init, o_ptr, lse_ptr, G: tl.constexpr,
                        GP: tl.constexpr, GC: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
                        KW: tl.constexpr, VW: tl.constexpr, BLOCK_S: tl.constexpr,
                        BITS: tl.constexpr, KCW: tl.constexpr, VCW: tl.constexpr,
                        VB: tl.constexpr, KF16: tl.constexpr, VF16: tl.constexpr,
                        FAST: tl.constexpr):
  KDT: tl.constexpr = tl.float16 if KF16 else tl.bfloat16   # key MMA operands
  VDT: tl.constexpr = tl.float16 if VF16 else tl.bfloat16   # value MMA operands
  T: tl.constexpr = 16
  NSUB: tl.constexpr = BLOCK_S // T
  NV: tl.constexpr = VW // 16            # value groups in a tile
  RK: tl.constexpr = SK * BITS // 8      # bytes per key row
  RV: tl.constexpr = SV * BITS // 8      # bytes per value row
  NJV: tl.constexpr = SV // 16           # value groups per token
  t, b, start, end, koff, voff, kw16, vw16, grp = load_record(rec_ptr)
  b64 = b.to(tl.int64)
  rows = tl.arange(0, GP)
  row = row_ptr + (grp * GP + rows) * 4
  lo = tl.load(row)
  hi = tl.load(row + 1)
  kcols = tl.arange(0, KW)
  vcols = tl.arange(0, VW)
  tcol = tl.arange(0, T)
  kmask = (kcols // 16) < kw16
  vmask = (vcols // 16) < vw16
  # q [GP, KW] (block-diagonal: row r is zero outside its head's columns; the A operand of
  # the key dot, in the key scales' dtype).
  kc16 = kcols // 16
  q = tl.load(q_ptr + ((b64 * G + rows % G) * SK + koff)[:, None] + kcols[None, :],
              mask=(kc16[None, :] >= lo[:, None]) & (kc16[None, :] < hi[:, None]), other=0.0)
  q = _to_dt(q.to(tl.float32), KDT, FAST)
  kby, ksh = _row_bytes(koff, KW, BITS, KCW)
  vby, vsh = _row_bytes(voff, VW, BITS, VCW)
  kc_base = kc_ptr + b64 * S * RK
  ks_base = ks_ptr + b64 * (S // 16) * SK + koff
  kz_base = kz_ptr + b64 * (S // 16) * SK + koff
  vc_base = vc_ptr + b64 * S * RV
  vs_base = vs_ptr + b64 * S * NJV + voff // 16
  vz_base = vz_ptr + b64 * S * NJV + voff // 16
  jv = tl.arange(0, NV)
  qk_scale = sm_scale * 1.4426950408889634
  m_i = tl.full([GP], float("-inf"), tl.float32)
  # Softmax denominator per (row, token slot), summed once at the end (as `triton_kivi`).
  l_t = tl.zeros([GP, T], tl.float32)
  acc = tl.zeros([GP, VW], tl.float32)
  # Value scale / zero [BLOCK_S, NV] of the next step, loaded one step ahead (module docstring).
  bs = tl.arange(0, BLOCK_S)
  gmask = (jv < vw16)[None, :]
  sv_n, zv_n = _value_scales(vs_base, vz_base, start + bs, end, jv, gmask, NJV)
  for t0 in range(start, end, BLOCK_S):
    t0 = tl.multiple_of(t0, BLOCK_S)
    sv_c = sv_n
    zv_c = zv_n
    sv_n, zv_n = _value_scales(vs_base, vz_base, t0 + BLOCK_S + bs, end, jv, gmask, NJV)
    sv3 = tl.reshape(sv_c, (NSUB, T, NV))
    zv3 = tl.reshape(zv_c, (NSUB, T, NV))
    scs = ()
    m_new = m_i
    for u in tl.static_range(NSUB):
      tu = t0 + u * T
      offs = tu + tcol
      t_ok = offs < end
      kb = tl.load(kc_base + offs[None, :] * RK + kby[:, None],
                   mask=t_ok[None, :] & kmask[:, None], other=0)              # [KW, T]
      # The sub-tile's key group: one [KW] scale / zero row.
      sp = (tu // 16) * SK + kcols[:, None]
      smask = (tu < end) & kmask[:, None]
      sk = tl.load(ks_base + sp, mask=smask, other=0.0)
      zk = tl.load(kz_base + sp, mask=smask, other=0.0)
      k_t = _dequant(kb, sk, zk, 0, BITS, KDT, False, 0, FAST,
                     tl.broadcast_to(ksh[:, None], kb.shape))
      sc = tl.dot(q, k_t)                                                 # [GP, T]
      sc = tl.where(t_ok[None, :], sc * qk_scale, float("-inf"))
      m_new = tl.maximum(m_new, tl.max(sc, 1))
      scs = scs + (sc,)
    alpha = tl.exp2(m_i - m_new)
    l_t = l_t * alpha[:, None]
    acc = acc * alpha[:, None]
    for u in tl.static_range(NSUB):
      tu = t0 + u * T
      p = tl.exp2(scs[u] - m_new[:, None])
      l_t = l_t + p
      # Token-blocked value codes: byte r of token t at ((t // VB) RV + r) VB + t % VB; the
      # sub-tile lies in one block (T | VB), its T bytes per column contiguous.
      tok = (tu // VB) * (VB * RV) + tl.multiple_of(tu % VB, T) + tcol
      vb = tl.load(vc_base + tok[:, None] + (vby * VB)[None, :], mask=vmask[None, :],
                   other=0)                                                # [T, VW]
      # Sub-tile u's [T, NV] of the step's [NSUB, T, NV] (a 0/1 select summed over NSUB, in
      # registers), each group's scale / zero then repeated over its 16 channels: [T, VW].
      pick = (tl.arange(0, NSUB) == u)[:, None, None]
      su = tl.sum(tl.where(pick, sv3.to(tl.float32), 0.0), 0).to(sv3.dtype)
      zu = tl.sum(tl.where(pick, zv3.to(tl.float32), 0.0), 0).to(zv3.dtype)
      sv = tl.reshape(tl.broadcast_to(su[:, :, None], (T, NV, 16)), (T, VW))
      zv = tl.reshape(tl.broadcast_to(zu[:, :, None], (T, NV, 16)), (T, VW))
      v = _dequant(vb, sv, zv, 0, BITS, VDT, False, 0, FAST,
                   tl.broadcast_to(vsh[None, :], vb.shape))
      acc = tl.dot(_to_dt(p, VDT, FAST), v, acc)                          # [GP, VW]
    m_i = m_new
  # Compact partial (as `triton_ragged`): row g of chunk t holds query g of every head of the
  # group in its own value columns; a 0/1 [GC, GP] selection sums the G-strided rows in fp32.
  l_safe, lse = split_lse(m_i, tl.sum(l_t, 1))
  vc16 = vcols // 16
  own = (vc16[None, :] >= tl.load(row + 2)[:, None]) & (vc16[None, :] < tl.load(row + 3)[:, None])
  o = tl.where(own, acc / l_safe[:, None], 0.0)                             # [GP, VW]
  qsel = tl.arange(0, GC)
  sel = tl.where((rows[None, :] % G) == qsel[:, None], 1.0, 0.0)
  oc = tl.dot(sel, o, input_precision="ieee")                               # [GC, VW]
  t64 = t.to(tl.int64)
  tl.store(o_ptr + (t64 * G + qsel)[:, None] * VW + vcols[None, :], oc, mask=(qsel < G)[:, None])
  tl.store(lse_ptr + t64 * GP + rows, lse)


def ragged_attention_quantized_triton(q_rot, keys, values, lengths, *, k_widths, v_widths,
                                      scale, out_dtype=None, block_s=QUANT_BLOCK_S,
                                      target_chunks=None, chunk_tokens=None,
                                      group_width=DEFAULT_GROUP_WIDTH, schedule="rows",
                                      num_warps=2, num_stages=2, poison=False,
                                      return_partials=False, heads_width=None, fast=None,
                                      epilogue="triton"):
  """`triton_ragged.ragged_attention_triton` over K'/V' held as planar KIVI codes
  (`kivi.planar.KiviKeys` / `KiviValues` of one pseudo-head; module docstring), attending
  slots [0, lengths[b]) of row b. Same outputs as the reference on the store dequantized to
  the scales' dtype (the values `kivi.planar.dequantize_*` give) with q_rot in that dtype.

  Extra Args: as `ragged_attention_triton`'s (epilogue included); fast: inline-PTX
  dequantization (None: on unless TRITON_INTERPRET=1).
  """
  check_store(keys, values, k_widths, v_widths)
  b, _, s, _ = keys.codes.shape
  p = plan(q_rot.shape, s, tuple(k_widths), tuple(v_widths), q_rot.dtype, block_s=block_s,
           target_chunks=target_chunks, chunk_tokens=chunk_tokens, group_width=group_width)
  rec = launch_records(p, lengths, schedule, epilogue)
  c = p.constexprs
  t = p.total_chunks
  if fast is None:
    fast = os.environ.get("TRITON_INTERPRET") != "1"
  out_shapes = [jax.ShapeDtypeStruct((t, c["G"], c["VW"]), jnp.float32),
                jax.ShapeDtypeStruct((t, c["GP"]), jnp.float32)]
  flat = lambda x: x.reshape(b, *x.shape[2:])
  f16 = lambda x: jnp.dtype(x.dtype) == jnp.float16
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  o, lse = triton_backend.launch(
      ragged_quant_kernel, q_rot, flat(keys.codes),
      flat(keys.scale), flat(keys.zero).astype(keys.scale.dtype), flat(values.codes),
      flat(values.scale), flat(values.zero).astype(values.scale.dtype), rec,
      jnp.asarray(p.row_table()), int(s), np.float32(scale), out_shapes=out_shapes, grid=(t,),
      num_warps=num_warps, num_stages=num_stages, poison=poison, BITS=keys.bits,
      KCW=keys.plane_width, VCW=values.plane_width, VB=VALUE_BLOCK, KF16=f16(keys.scale),
      VF16=f16(values.scale), FAST=bool(fast), **c)
  out, total = launch_combine(o, lse, p, out_dtype or q_rot.dtype, heads_width, epilogue)
  if return_partials:
    return out, total, (o, lse)
  return out, total
