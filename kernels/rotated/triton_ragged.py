"""Ragged-head split-K decode attention over a rotated (FDC / ZACK) cache (Triton via jax-triton).

Program i of the 1-D grid runs the chunk of record i (`records`): the static chunks of
`triton_plan` (one (request, KV head) task cut along the sequence) in the LPT launch order of
`lpt.order`, computed under jit from the lengths and the static widths; the GPU's block
scheduler hands them out in that order to the first SM slot that frees up, which is LPT's
greedy step (see `lpt`). A chunk of (b, h) loads its G query rows (padded to 16 rows for the
MMA), streams its slots' k_h-wide key slices and v_h-wide value slices of the packed cache
rows with an online softmax in float32, and writes its normalised partial output and LSE;
`splitk.combine_partials` merges the chunks of each task.

Ragged widths: one compiled kernel serves every head. Tiles are KW = next power of two of
max(k_widths) (VW for values) columns wide; the head's offset and width come from the record,
and the loads mask columns in whole 16-element (32-byte) groups, so masked-off columns cost no
memory traffic (16-byte cp.async with zero fill) and nothing is padded in memory; the MMAs
run over the padded width (decode is memory-bound: the extra FLOPs are free).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import splitk
from ..common import triton_backend
from ..dense.triton_decode import store_partial
from . import lpt
from .triton_plan import DEFAULT_BLOCK_S, plan


@triton.jit
def _ragged_body(q_ptr, k_ptr, v_ptr, rec_ptr, S, sm_scale, o_ptr, lse_ptr, G: tl.constexpr,
                 GP: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr, KW: tl.constexpr,
                 VW: tl.constexpr, BLOCK_S: tl.constexpr):
  # This program's record (`records`): 8 independent loads of one 32-byte row.
  rec = rec_ptr + tl.program_id(0) * 8
  t = tl.load(rec)
  b = tl.load(rec + 1)
  start = tl.load(rec + 2)
  end = tl.load(rec + 3)
  koff = tl.multiple_of(tl.load(rec + 4), 16)
  voff = tl.multiple_of(tl.load(rec + 5), 16)
  kw16 = tl.load(rec + 6)
  vw16 = tl.load(rec + 7)
  b64 = b.to(tl.int64)
  rows = tl.arange(0, GP)
  row_ok = rows < G
  kcols = tl.arange(0, KW)
  vcols = tl.arange(0, VW)
  # Column masks in whole 16-column groups (constant over each group: vectorised loads).
  kmask = (kcols // 16) < kw16
  vmask = (vcols // 16) < vw16
  q = tl.load(q_ptr + (b64 * G + rows)[:, None] * SK + koff + kcols[None, :],
              mask=row_ok[:, None] & kmask[None, :], other=0.0)
  qk_scale = sm_scale * 1.4426950408889634
  m_i = tl.full([GP], float("-inf"), tl.float32)
  l_i = tl.zeros([GP], tl.float32)
  acc = tl.zeros([GP, VW], tl.float32)
  k_base = k_ptr + b64 * S * SK + koff
  v_base = v_ptr + b64 * S * SV + voff
  for s0 in range(start, end, BLOCK_S):
    offs = s0 + tl.arange(0, BLOCK_S)
    ok = offs < end
    k = tl.load(k_base + offs[:, None] * SK + kcols[None, :], mask=ok[:, None] & kmask[None, :],
                other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs[:, None] * SV + vcols[None, :], mask=ok[:, None] & vmask[None, :],
                other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    m_i = m_new
  store_partial(o_ptr, lse_ptr, acc, m_i, l_i, t.to(tl.int64) * G + rows, row_ok, VW)


@triton.jit
def ragged_kernel(q_ptr, k_ptr, v_ptr, rec_ptr, S, sm_scale, o_ptr, lse_ptr, G: tl.constexpr,
                  GP: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr, KW: tl.constexpr,
                  VW: tl.constexpr, BLOCK_S: tl.constexpr):
  _ragged_body(q_ptr, k_ptr, v_ptr, rec_ptr, S, sm_scale, o_ptr, lse_ptr, G, GP, SK, SV, KW, VW,
               BLOCK_S)


@triton.jit
def ragged_kernel_poisoned(q_ptr, k_ptr, v_ptr, rec_ptr, S, sm_scale, o_init, lse_init, o_ptr,
                           lse_ptr, G: tl.constexpr, GP: tl.constexpr, SK: tl.constexpr,
                           SV: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
                           BLOCK_S: tl.constexpr):
  _ragged_body(q_ptr, k_ptr, v_ptr, rec_ptr, S, sm_scale, o_ptr, lse_ptr, G, GP, SK, SV, KW, VW,
               BLOCK_S)


def records(p, lengths, schedule):
  """int32 [T, 8]: program i's (chunk id, batch row, first slot, end slot (clipped to the
  row's length), k offset, v offset, k width / 16, v width / 16), programs in the
  `lpt.order(schedule)` order. Built under jit in one small XLA fusion so the kernel's
  prologue is one round trip to memory."""
  ids = lpt.order(schedule, lengths, p.n_chunks, p.chunk_tokens, p.widths())
  k = p.heads
  h = ids % k
  bc = ids // k
  b = bc // p.n_chunks
  start = (bc % p.n_chunks) * p.chunk_tokens
  end = jnp.clip(lengths.astype(jnp.int32)[b], start, start + p.chunk_tokens)
  head = jnp.asarray(p.head_table())[h]                                # [T, 4]
  return jnp.concatenate([jnp.stack([ids, b, start, end], axis=1), head], axis=1)


def combine_heads(o, lse, p, out_dtype):
  """Merges the chunk partials (o [T, G, VW], lse [T, G] float32, chunk ids (b, c, h)) into
  (out [B, G, sum v] out_dtype, lse [B, K, G] float32): one split-K combine over the chunks,
  then one static gather of each head's v_h columns."""
  bsz, nc, k, g = p.batch, p.n_chunks, p.heads, p.groups
  o = o.reshape(bsz, nc, k, g, -1).transpose(0, 3, 2, 1, 4)              # [B, G, K, NC, VW]
  lse = lse.reshape(bsz, nc, k, g).transpose(0, 2, 3, 1)                 # [B, K, G, NC]
  out, total = splitk.combine_partials(o, lse.transpose(0, 2, 1, 3), jnp.float32)
  out = out.reshape(bsz, g, -1)[..., jnp.asarray(p.value_columns())]
  return out.astype(out_dtype), total.transpose(0, 2, 1)


def ragged_attention_triton(q_rot, k_rot, v_rot, lengths, *, k_widths, v_widths, scale,
                            out_dtype=None, block_s=DEFAULT_BLOCK_S, target_chunks=None,
                            chunk_tokens=None, schedule="rows", num_warps=4, num_stages=3,
                            poison=False, return_partials=False):
  """Same contract as `reference.ragged_attention_reference` (bf16/fp16 caches; the query is
  cast to the cache dtype).

  Extra Args:
    block_s, target_chunks, chunk_tokens: chunking (`triton_plan.plan`).
    schedule: launch order of the chunks, one of `lpt.SCHEDULES` ("rows": LPT over row
      tasks; "lpt": LPT over single chunks; "static": no sort).
    num_warps, num_stages: Triton compile options.
    poison: NaN-fill the partial buffers first (tests: every element must be written).
    return_partials: also return the raw (o, lse) partials.
  """
  p = plan(q_rot.shape, k_rot.shape[1], k_widths, v_widths, k_rot.dtype, block_s=block_s,
           target_chunks=target_chunks, chunk_tokens=chunk_tokens)
  rec = records(p, lengths, schedule)
  o, lse = launch_kernel(q_rot.astype(k_rot.dtype), k_rot, v_rot.astype(k_rot.dtype), rec, p,
                         scale, num_warps=num_warps, num_stages=num_stages, poison=poison)
  out, total = combine_heads(o, lse, p, out_dtype or q_rot.dtype)
  if return_partials:
    return out, total, (o, lse)
  return out, total


def launch_kernel(q_rot, k_rot, v_rot, rec, p, scale, *, num_warps, num_stages, poison=False):
  """The kernel alone on prepared records: the (o [T, G, VW], lse [T, G]) partials."""
  c = p.constexprs
  t = p.total_chunks
  out_shapes = [jax.ShapeDtypeStruct((t, p.groups, c["VW"]), jnp.float32),
                jax.ShapeDtypeStruct((t, p.groups), jnp.float32)]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  return triton_backend.launch(
      ragged_kernel, ragged_kernel_poisoned, q_rot, k_rot, v_rot, rec, int(k_rot.shape[1]),
      np.float32(scale), out_shapes=out_shapes, grid=(t,), num_warps=num_warps,
      num_stages=num_stages, poison=poison, **c)
