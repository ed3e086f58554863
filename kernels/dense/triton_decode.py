"""Split-K flash-decoding kernel for dense bf16 GQA decode attention (Triton via jax-triton).

Why Triton (jax-triton) rather than Pallas Mosaic GPU: decode attention is a
streaming kernel whose speed comes from deep software pipelining of the K/V
tiles and from many programs in flight; Triton's pipeliner (cp.async/TMA with
`num_stages`) does this with no hand-written barriers, it compiles on the
device's Triton 3.6 with no extra toolchain, and the same kernel can be checked
on a CPU with Triton's interpreter. Mosaic GPU would need explicit
warpgroup/barrier code for the same result.

Grid: (B * K, num_splits). Program (b, kv head, split) loads the QPK query heads
that share the KV head (padded to 16 rows so `tl.dot` can use tensor cores),
streams its chunk of K/V tiles once with an online softmax in float32, and
writes a normalised partial output and its LSE; `splitk.combine_partials`
merges the chunks. Each sequence's chunk size is computed in-kernel from its
own length, so ragged batches split their own work evenly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import splitk
from ..common import triton_backend
from .limits import check_triton_shapes

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def split_lse(m_i, l_i):
  """(l_safe, lse) of one split's online softmax (running max m_i in log2 units, sum l_i):
  the divisor with empty rows set to 1, and the natural-log LSE (-inf for empty rows)."""
  has = l_i > 0
  l_safe = tl.where(has, l_i, 1.0)
  lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
  return l_safe, lse


@triton.jit
def store_partial(o_ptr, lse_ptr, acc, m_i, l_i, row_idx, row_ok, HV: tl.constexpr):
  """Normalises one split's accumulator and writes o [rows, HV] and lse [rows] (natural log)."""
  l_safe, lse = split_lse(m_i, l_i)
  o = acc / l_safe[:, None]
  cols = tl.arange(0, HV)
  tl.store(o_ptr + row_idx[:, None] * HV + cols[None, :], o, mask=row_ok[:, None])
  tl.store(lse_ptr + row_idx, lse, mask=row_ok)


@triton.jit
def split_range(len_ptr, b, sid, NSPLIT, BLOCK_S: tl.constexpr):
  """[start, end) of split `sid` of sequence b: equal chunks of its own length, tile aligned."""
  length = tl.load(len_ptr + b)
  chunk = tl.cdiv(tl.cdiv(length, NSPLIT), BLOCK_S) * BLOCK_S
  start = sid * chunk
  end = tl.minimum(start + chunk, length)
  return start, end


@triton.jit
def flash_decode_kernel(q_ptr, k_ptr, v_ptr, len_ptr, S, NSPLIT, sm_scale, o_init, lse_init,
                        o_ptr, lse_ptr, KH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr,
                        H: tl.constexpr, HV: tl.constexpr, BLOCK_S: tl.constexpr):
  pid = tl.program_id(0)
  sid = tl.program_id(1)
  b = pid // KH
  kh = pid % KH
  start, end = split_range(len_ptr, b, sid, NSPLIT, BLOCK_S)
  N: tl.constexpr = KH * QPK
  b64 = b.to(tl.int64)
  rows = tl.arange(0, QP)
  row_ok = rows < QPK
  heads = kh * QPK + rows
  cols = tl.arange(0, H)
  vcols = tl.arange(0, HV)
  q = tl.load(q_ptr + (b64 * N + heads)[:, None] * H + cols[None, :], mask=row_ok[:, None],
              other=0.0)
  qk_scale = sm_scale * 1.4426950408889634
  m_i = tl.full([QP], float("-inf"), tl.float32)
  l_i = tl.zeros([QP], tl.float32)
  acc = tl.zeros([QP, HV], tl.float32)
  k_base = k_ptr + b64 * S * (KH * H) + kh * H
  v_base = v_ptr + b64 * S * (KH * HV) + kh * HV
  for s0 in range(start, end, BLOCK_S):
    offs = s0 + tl.arange(0, BLOCK_S)
    ok = offs < end
    k = tl.load(k_base + offs[:, None] * (KH * H) + cols[None, :], mask=ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs[:, None] * (KH * HV) + vcols[None, :], mask=ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    m_i = m_new
  store_partial(o_ptr, lse_ptr, acc, m_i, l_i, (b64 * N + heads) * NSPLIT + sid, row_ok, HV)


def plan(q_shape, k_shape, v_shape, *, block_s=64, num_splits=None, target_programs=None):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check; ValueError
  (`limits.check_triton_shapes`) for shapes the kernel does not take.

  Returns:
    dict(grid, constexprs, out_shapes).
  """
  b, n, h = q_shape
  s, kh = k_shape[1], k_shape[2]
  hv = v_shape[-1]
  check_triton_shapes(q_shape, k_shape, v_shape, block_s)
  qpk = n // kh
  qp = max(16, 1 << (qpk - 1).bit_length())
  ns = splitk.choose_num_splits(b * kh, s, block_s, requested=num_splits,
                                  target=target_programs or splitk.TARGET_PROGRAMS)
  return dict(
      grid=(b * kh, ns),
      constexprs=dict(KH=kh, QPK=qpk, QP=qp, H=h, HV=hv, BLOCK_S=block_s), num_splits=ns,
      out_shapes=[jax.ShapeDtypeStruct((b, n, ns, hv), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, ns), jnp.float32)])


def decode_attention_triton(q, k, v, lengths, *, scale=None, out_dtype=None, block_s=64,
                            num_splits=None, target_programs=None, num_warps=4, num_stages=3,
                            poison=False, return_partials=False):
  """Split-K flash decode; same contract as `decode_attention_reference`.

  Extra Args:
    block_s, num_splits, target_programs, num_warps, num_stages: kernel tuning knobs.
    poison: NaN-fill the partial buffers first (tests: every element must be written).
    return_partials: also return the raw (o, lse) partials.
  """
  h = q.shape[-1]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  scale = np.float32(h ** -0.5 if scale is None else scale)
  p = plan(q.shape, k.shape, v.shape, block_s=block_s, num_splits=num_splits,
           target_programs=target_programs)
  return triton_backend.launch_split_k(
      flash_decode_kernel,
      q.astype(k.dtype), k, v, lengths.astype(jnp.int32), int(k.shape[1]), p["num_splits"], scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, out_dtype=out_dtype or q.dtype, return_partials=return_partials,
      **p["constexprs"])
