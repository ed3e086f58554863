"""KIVI decode attention (2/4-bit K per channel, V per token, + exact window) in Triton.

Why Triton (jax-triton): the kernel is memory-streaming with integer unpacking
between the loads and the tensor-core products; Triton's pipeliner overlaps the
packed-tile loads with that work, and the interpreter checks the same source on
a CPU. Pallas Mosaic GPU offers no unpacking or layout advantage here and needs
manual pipelining.

Grid: (B * K, num_splits + 1). Programs with split < num_splits stream chunks
of the quantized prefix; the last split attends the full-precision window
(plain flash-decoding tile loop). All partials merge in one LSE combine.

Dequantization is folded into the two products so codes enter the tensor cores
as exact fp16 values v = 1 + c / 2**b (`triton_unpack.codes_to_f16`), with no
per-element scale arithmetic:
  keys (scale s_{n,c}, zero z_{n,c} per channel c and token group n):
    q . k_t = sum_c (q_c s_{n,c}) c_{t,c} + q . z_n
            = 2**b (sum_c (q_c s_{n,c}) v_{t,c} - sum_c q_c s_{n,c}) + q . z_n;
    a tile of BLOCK_S = NG * G tokens stacks the NG scaled query copies as the
    M dimension of one product and keeps each token's own group (block diagonal);
  values (scale s_{t,j}, zero z_{t,j} per token t and channel group j):
    sum_t p_t v'_{t,c} = 2**b (sum_t (p_t s_{t,j}) v_{t,c} - sum_t p_t s_{t,j}) + sum_t p_t z_{t,j},
    the NJ = H / Gv scaled probability copies stacked as M = NJ * QP rows, each
    output channel c keeping row block j = c // Gv.
The stacked products do NJ (or NG) times the tensor work of a plain product;
tensor cores are idle in this memory-bound kernel, integer ALUs are not.

Measured limits (H200, BENCHMARKS.md): this kernel is ~3.5x slower than dense
bf16 attention, far from its memory roofline. With either path skipped it is
still slow (keys alone ~0.4x of the time, values alone ~0.7x), i.e. the
per-tile chain of byte unpacking (`tl.join`/reshape layout shuffles), 3-D
stacked products and reductions is latency/ALU bound, not the HBM reads. A
planar packing (codes of one byte spread over H / ppb-apart channels, so a
shift gives a contiguous channel chunk with no shuffle) is the next step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..decode_attention import splitk
from ..decode_attention import triton_backend
from ..decode_attention.triton_decode import split_range
from ..latent_attention import triton_unpack as tu
from .packing import KiviKeys, KiviValues


@triton.jit
def _store(o_ptr, lse_ptr, acc, m_i, l_i, prow, row_ok, H: tl.constexpr):
  has = l_i > 0
  l_safe = tl.where(has, l_i, 1.0)
  cols = tl.arange(0, H)
  tl.store(o_ptr + prow[:, None] * H + cols[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
  lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
  tl.store(lse_ptr + prow, lse, mask=row_ok)


@triton.jit
def _window_part(q, kw_ptr, vw_ptr, wlen_ptr, W, b64, kh, o_ptr, lse_ptr, prow, row_ok,
                 KH: tl.constexpr, QP: tl.constexpr, H: tl.constexpr, BLOCK_W: tl.constexpr):
  """Flash-decoding over the exact window [0, w_len[b]) of one (batch, kv head)."""
  end = tl.load(wlen_ptr + b64)
  cols = tl.arange(0, H)
  m_i = tl.full([QP], float("-inf"), tl.float32)
  l_i = tl.zeros([QP], tl.float32)
  acc = tl.zeros([QP, H], tl.float32)
  base = (b64 * W) * (KH * H) + kh * H
  qb = q.to(tl.bfloat16)
  for s0 in range(0, end, BLOCK_W):
    offs = s0 + tl.arange(0, BLOCK_W)
    ok = offs < end
    ptr = base + offs[:, None] * (KH * H) + cols[None, :]
    k = tl.load(kw_ptr + ptr, mask=ok[:, None], other=0.0).to(tl.bfloat16)
    s = tl.dot(qb, tl.trans(k))
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(vw_ptr + ptr, mask=ok[:, None], other=0.0).to(tl.bfloat16)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
    m_i = m_new
  _store(o_ptr, lse_ptr, acc, m_i, l_i, prow, row_ok, H)


@triton.jit
def _quant_part(q, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qlen_ptr, S, NSPLIT, b, b64,
                kh, sid, o_ptr, lse_ptr, prow, row_ok, KH: tl.constexpr, QP: tl.constexpr,
                H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, G: tl.constexpr,
                GV: tl.constexpr, BLOCK_S: tl.constexpr, SKIP: tl.constexpr):
  """One chunk of the quantized prefix of one (batch, kv head)."""
  NG: tl.constexpr = BLOCK_S // G
  NJ: tl.constexpr = H // GV
  KW: tl.constexpr = H * KBITS // 8
  VW: tl.constexpr = H * VBITS // 8
  start, end = split_range(qlen_ptr, b, sid, NSPLIT, BLOCK_S)
  head = b64 * KH + kh
  cols = tl.arange(0, H)
  tcol = tl.arange(0, BLOCK_S)
  ng = tl.arange(0, NG)
  nj = tl.arange(0, NJ)
  m_i = tl.full([QP], float("-inf"), tl.float32)
  l_i = tl.zeros([QP], tl.float32)
  acc = tl.zeros([NJ * QP, H], tl.float32)
  psum = tl.zeros([NJ, QP], tl.float32)
  pz = tl.zeros([NJ, QP], tl.float32)
  kc_base = kc_ptr + head * S * KW
  vc_base = vc_ptr + head * S * VW
  sel_k = (tcol // G)[None, None, :] == ng[:, None, None]
  for t0 in range(start, end, BLOCK_S):
    offs = t0 + tcol
    t_ok = offs < end
    if SKIP == 2:  # ablation (timing only): no key path
      scores = tl.zeros([QP, BLOCK_S], tl.float32)
    else:
      # ---- scores: stacked per-group scaled queries x key codes.
      kcode = tu.load_codes(kc_base + offs[:, None] * KW, t_ok, 0, H, H, H, BLOCK_S, KBITS)
      kv16 = tu.codes_to_f16(kcode, KBITS)
      grp = head * (S // G) + t0 // G + ng
      ksc = tl.load(ks_ptr + grp[:, None] * H + cols[None, :]).to(tl.float32)
      kze = tl.load(kz_ptr + grp[:, None] * H + cols[None, :]).to(tl.float32)
      qs3 = (q[None, :, :] * ksc[:, None, :]).to(tl.float16)
      qsum = tl.sum(qs3.to(tl.float32), 2)
      qz = tl.sum(q[None, :, :] * kze[:, None, :], 2)
      sall = tl.dot(tl.reshape(qs3, [NG * QP, H]), tl.trans(kv16))
      s3 = (tl.reshape(sall, [NG, QP, BLOCK_S]) - qsum[:, :, None]) * (1 << KBITS) + qz[:, :, None]
      scores = tl.sum(tl.where(sel_k, s3, 0.0), 0)
    scores = tl.where(t_ok[None, :], scores, float("-inf"))
    # ---- online softmax.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SKIP != 1:  # SKIP == 1: ablation (timing only), no value path
      # ---- values: stacked per-channel-group scaled probabilities x value codes.
      vcode = tu.load_codes(vc_base + offs[:, None] * VW, t_ok, 0, H, H, H, BLOCK_S, VBITS)
      vv16 = tu.codes_to_f16(vcode, VBITS)
      vrow = (head * S + offs)[None, :] * NJ + nj[:, None]
      vsc = tl.load(vs_ptr + vrow, mask=t_ok[None, :], other=0.0).to(tl.float32)
      vze = tl.load(vz_ptr + vrow, mask=t_ok[None, :], other=0.0).to(tl.float32)
      pw3 = (p[None, :, :] * vsc[:, None, :]).to(tl.float16)
      psum = psum * alpha[None, :] + tl.sum(pw3.to(tl.float32), 2)
      pz = pz * alpha[None, :] + tl.sum(p[None, :, :] * vze[:, None, :], 2)
      alpha_s = tl.reshape(tl.broadcast_to(alpha[None, :], [NJ, QP]), [NJ * QP])
      acc = tl.dot(tl.reshape(pw3, [NJ * QP, BLOCK_S]), vv16, acc * alpha_s[:, None])
    m_i = m_new
  a3 = (tl.reshape(acc, [NJ, QP, H]) - psum[:, :, None]) * (1 << VBITS) + pz[:, :, None]
  sel_v = (cols // GV)[None, None, :] == nj[:, None, None]
  out = tl.sum(tl.where(sel_v, a3, 0.0), 0)
  _store(o_ptr, lse_ptr, out, m_i, l_i, prow, row_ok, H)


@triton.jit
def _kivi_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
               wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH: tl.constexpr,
               QPK: tl.constexpr,
               QP: tl.constexpr, H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
               G: tl.constexpr, GV: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_W: tl.constexpr, SKIP: tl.constexpr):
  pid = tl.program_id(0)
  sid = tl.program_id(1)
  b = pid // KH
  kh = pid % KH
  N: tl.constexpr = KH * QPK
  b64 = b.to(tl.int64)
  rows = tl.arange(0, QP)
  row_ok = rows < QPK
  heads = kh * QPK + rows
  cols = tl.arange(0, H)
  q = tl.load(q_ptr + (b64 * N + heads)[:, None] * H + cols[None, :], mask=row_ok[:, None],
              other=0.0).to(tl.float32) * (sm_scale * 1.4426950408889634)
  prow = (b64 * N + heads) * (NSPLIT + 1) + sid
  if sid == NSPLIT:
    _window_part(q, kw_ptr, vw_ptr, wlen_ptr, W, b64, kh, o_ptr, lse_ptr, prow, row_ok,
                 KH, QP, H, BLOCK_W)
  else:
    _quant_part(q, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qlen_ptr, S, NSPLIT, b, b64, kh,
                sid, o_ptr, lse_ptr, prow, row_ok, KH, QP, H, KBITS, VBITS, G, GV, BLOCK_S, SKIP)


@triton.jit
def kivi_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
                wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH: tl.constexpr,
                QPK: tl.constexpr,
                QP: tl.constexpr, H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                G: tl.constexpr, GV: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_W: tl.constexpr, SKIP: tl.constexpr):
  _kivi_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
             wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH, QPK, QP, H, KBITS, VBITS, G, GV,
             BLOCK_S, BLOCK_W, SKIP)


@triton.jit
def kivi_kernel_poisoned(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr,
                         qlen_ptr, wlen_ptr, S, W, NSPLIT, sm_scale, o_init, lse_init, o_ptr,
                         lse_ptr,
                         KH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr, H: tl.constexpr,
                         KBITS: tl.constexpr, VBITS: tl.constexpr, G: tl.constexpr,
                         GV: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_W: tl.constexpr, SKIP: tl.constexpr):
  _kivi_body(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
             wlen_ptr, S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH, QPK, QP, H, KBITS, VBITS, G, GV,
             BLOCK_S, BLOCK_W, SKIP)


def plan(q_shape, keys: KiviKeys, values: KiviValues, w_cap: int, *, block_s=None, block_w=32,
         num_splits=None, target_programs=None, skip=0):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check.

  skip: 0, or an ablation for timing only (1: no value path, 2: no key path; wrong output).
  """
  b, n, h = q_shape
  _, kh, s, _ = keys.codes.shape
  g, gv = keys.group, values.group
  if keys.bits not in (2, 4) or values.bits not in (2, 4):
    raise ValueError(f"triton kivi attention supports 2/4-bit codes, got {keys.bits}/{values.bits}")
  if h < 16 or h & (h - 1):
    raise ValueError(f"triton kivi attention: head dim must be a power of 2 >= 16, got {h}")
  if g < 16 or g & (g - 1) or gv & (gv - 1) or h % gv:
    raise ValueError(f"triton kivi attention: groups must be powers of 2 (key >= 16), got {g}/{gv}")
  block_s = max(g, 32) if block_s is None else block_s
  if block_s % g:
    raise ValueError(f"block_s ({block_s}) must be a multiple of the key group ({g})")
  if s * h >= 2 ** 31:
    raise ValueError("triton kivi attention: one head's cache exceeds int32 indexing")
  qpk = n // kh
  ns = splitk.choose_num_splits(b * kh, s, block_s, requested=num_splits,
                                  target=target_programs or splitk.TARGET_PROGRAMS)
  return dict(
      grid=(b * kh, ns + 1),
      constexprs=dict(KH=kh, QPK=qpk, QP=max(16, 1 << (qpk - 1).bit_length()), H=h,
                      KBITS=keys.bits, VBITS=values.bits, G=g, GV=gv, BLOCK_S=block_s,
                      BLOCK_W=block_w, SKIP=int(skip)), num_splits=ns,
      out_shapes=[jax.ShapeDtypeStruct((b, n, ns + 1, h), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, ns + 1), jnp.float32)])


def kivi_attention_triton(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len, *,
                          scale=None, out_dtype=None, block_s=None, block_w=32, num_splits=None,
                          target_programs=None, skip=0, num_warps=4, num_stages=5,
                          poison=False, return_partials=False):
  """Fused KIVI decode attention; same contract as `kivi_attention_reference`."""
  h = q.shape[-1]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  scale = np.float32(h ** -0.5 if scale is None else scale)
  p = plan(q.shape, keys, values, k_win.shape[1], block_s=block_s, block_w=block_w,
           num_splits=num_splits, target_programs=target_programs, skip=skip)
  o, lse = triton_backend.launch(
      kivi_kernel, kivi_kernel_poisoned,
      q, keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero,
      k_win.astype(jnp.bfloat16), v_win.astype(jnp.bfloat16), q_len.astype(jnp.int32),
      w_len.astype(jnp.int32), int(keys.codes.shape[2]), int(k_win.shape[1]), p["num_splits"],
      scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, **p["constexprs"])
  out, total = splitk.combine_partials(o, lse, out_dtype or q.dtype)
  if return_partials:
    return out, total, (o, lse)
  return out, total
