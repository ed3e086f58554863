"""Ragged-head split-K decode attention over a rotated (FDC / ZACK) cache (Triton via jax-triton).

Program i of the 1-D grid runs the chunk of record i (`records`): the static chunks of
`triton_plan` (one (request, KV head group) task cut along the sequence) in the LPT launch order of
`lpt.order`, computed under jit from the lengths and the static widths; the GPU's block
scheduler hands them out in that order to the first SM slot that frees up, which is LPT's
greedy step (see `lpt`). A chunk of (b, group) loads the group's block-diagonal query (G rows
per head, `triton_plan`), streams its slots' key and value slices of the packed cache rows
(the group's heads side by side) with an online softmax in float32 per row, and writes its
normalised partial output and LSE per row; `combine_heads` merges the chunks of each task
(`splitk.combine_partials`' arithmetic). Inside a decode step the records and the combine
run as one Triton launch each (`triton_records`, `triton_combine`; `records` and
`combine_heads` are their jnp references, `epilogue="xla"`).

Compact partials: the block-diagonal product gives G rows per head, each over every column of
the group, but row j * G + g is meaningful only in head j's value columns. So a chunk writes
o [G, VW]: row g holds query g of every head of the group, each in its own columns (a 0/1
selection of the G-strided rows, exact in fp32), 1 / (heads in the group) of the block-diagonal
rows' bytes (Llama-3, 4 heads per group: a quarter; Llama-2, G = 1: one row of 16); the
kernel writes the partials and the combine reads them on every call.

Ragged widths: one compiled kernel serves every group. Tiles are KW = next power of two of the
widest group's key columns (VW for values); the group's offset and width come from the record,
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
from ..dense.triton_decode import split_lse
from . import lpt, triton_combine, triton_records
from .triton_plan import DEFAULT_BLOCK_S, DEFAULT_GROUP_WIDTH, check_epilogue, plan


@triton.jit
def load_record(rec_ptr):
  """This program's record (`records`), independent loads of one row: (chunk id, batch row,
  first slot, end slot, k offset, v offset (multiples of 16), k width / 16, v width / 16,
  head group)."""
  rec = rec_ptr + tl.program_id(0) * 9
  return (tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3),
          tl.multiple_of(tl.load(rec + 4), 16), tl.multiple_of(tl.load(rec + 5), 16),
          tl.load(rec + 6), tl.load(rec + 7), tl.load(rec + 8))


@triton.jit
def ragged_kernel(q_ptr, k_ptr, v_ptr, rec_ptr, row_ptr, S, sm_scale, o_init, lse_init, o_ptr,
                  lse_ptr, G: tl.constexpr, GP: tl.constexpr, GC: tl.constexpr, SK: tl.constexpr,
                  SV: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr, BLOCK_S: tl.constexpr):
  t, b, start, end, koff, voff, kw16, vw16, grp = load_record(rec_ptr)
  b64 = b.to(tl.int64)
  rows = tl.arange(0, GP)
  kcols = tl.arange(0, KW)
  vcols = tl.arange(0, VW)
  # Block-diagonal query: row j * G + g holds query g of the group's head j in that head's
  # columns [lo, hi) (in 16-column groups, `RaggedPlan.row_table`), zeros elsewhere.
  row = row_ptr + (grp * GP + rows) * 4
  lo = tl.load(row)
  hi = tl.load(row + 1)
  c16 = kcols // 16
  q = tl.load(q_ptr + (b64 * G + rows % G)[:, None] * SK + koff + kcols[None, :],
              mask=(c16[None, :] >= lo[:, None]) & (c16[None, :] < hi[:, None]), other=0.0)
  # Column masks in whole 16-column groups (constant over each group: vectorised loads).
  kmask = c16 < kw16
  vmask = (vcols // 16) < vw16
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
  # Compact partial: row g of chunk t holds query g of every head of the group, each head in
  # its own value columns (row j * G + g of the block-diagonal product keeps head j's columns
  # [vlo, vhi) only; a 0/1 [GC, GP] selection sums the G-strided rows exactly, in fp32).
  l_safe, lse = split_lse(m_i, l_i)
  vc16 = vcols // 16
  own = (vc16[None, :] >= tl.load(row + 2)[:, None]) & (vc16[None, :] < tl.load(row + 3)[:, None])
  o = tl.where(own, acc / l_safe[:, None], 0.0)
  qsel = tl.arange(0, GC)
  sel = tl.where((rows[None, :] % G) == qsel[:, None], 1.0, 0.0)
  oc = tl.dot(sel, o, input_precision="ieee")
  t64 = t.to(tl.int64)
  tl.store(o_ptr + (t64 * G + qsel)[:, None] * VW + vcols[None, :], oc, mask=(qsel < G)[:, None])
  tl.store(lse_ptr + t64 * GP + rows, lse)


def records(p, lengths, schedule):
  """int32 [T, 9]: program i's (chunk id, batch row, first slot, end slot (clipped to the
  row's length), k offset, v offset, k width / 16, v width / 16, head group) in the
  `lpt.order(schedule)` launch order. Built under jit in one small XLA fusion so the
  kernel's prologue is one round trip to memory."""
  # Lengths past the capacity attend every slot (as the reference): never read past a row.
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, p.capacity)
  ids = lpt.order(schedule, lengths, p.n_chunks, p.chunk_tokens, p.widths())
  bc = ids // p.n_groups
  b = bc // p.n_chunks
  g = ids % p.n_groups
  ct = jnp.asarray(np.asarray(p.chunk_tokens, np.int32))[g]
  start = (bc % p.n_chunks) * ct
  end = jnp.clip(lengths[b], start, start + ct)
  grp = jnp.asarray(p.group_table())[g]                                  # [T, 5]
  return jnp.concatenate([jnp.stack([ids, b, start, end], axis=1), grp], axis=1)


def launch_records(p, lengths, schedule, epilogue="triton"):
  """`records`, in one Triton program where it builds them (`triton_records.fits`: the "rows"
  order) and `epilogue` is "triton"."""
  check_epilogue(epilogue)
  if epilogue == "triton" and triton_records.fits(p, schedule):
    return triton_records.rows_records(p, lengths)
  return records(p, lengths, schedule)


def launch_combine(o, lse, p, out_dtype, heads_width=None, epilogue="triton"):
  """`combine_heads`, in one Triton launch (`triton_combine`) when `epilogue` is "triton"."""
  check_epilogue(epilogue)
  if epilogue == "triton":
    return triton_combine.combine_heads_triton(o, lse, p, out_dtype, heads_width)
  return combine_heads(o, lse, p, out_dtype, heads_width)


def combine_heads(o, lse, p, out_dtype, heads_width=None):
  """Merges the chunk partials (o [T, G, VW] compact, lse [T, GP] float32, chunk ids
  (b, c, group)) into (out [B, G, sum v] out_dtype, lse [B, K, G] float32), or with
  `heads_width` out [B, K, G, heads_width]: head h's v_h columns, then zeros. The split-K
  weights per (chunk, row) (`splitk.split_weights`), each compact column taking its row's
  weight, summed over the chunks in one reduction over contiguous rows; then one static
  gather of the outputs."""
  bsz, nc, ng, g = p.batch, p.n_chunks, p.n_groups, p.groups
  gp, vw = lse.shape[1], o.shape[2]
  weight_row, packed, lse_idx = p.output_index()
  w, denom, total = splitk.split_weights(lse.reshape(bsz, nc, ng, gp), axis=1)
  w = w / denom[:, None]                                                 # [B, NC, NG, GP]
  w_cols = w[:, :, np.arange(ng)[:, None, None], jnp.asarray(weight_row)]   # [B, NC, NG, G, VW]
  # Elementwise product + sum, not einsum: an f32 dot may run as TF32 on GPU.
  out = jnp.sum(w_cols * o.reshape(bsz, nc, ng, g, vw), axis=1).reshape(bsz, -1)
  if heads_width is None:
    out = out[:, jnp.asarray(packed)]                                     # [B, G, Σv]
  else:
    out = jnp.take(out, jnp.asarray(p.heads_index(heads_width)), axis=1, mode="fill",
                   fill_value=0)                                          # [B, K, G, width]
  return out.astype(out_dtype), total.reshape(bsz, -1)[:, jnp.asarray(lse_idx)]


def ragged_attention_triton(q_rot, k_rot, v_rot, lengths, *, k_widths, v_widths, scale,
                            out_dtype=None, block_s=DEFAULT_BLOCK_S, target_chunks=None,
                            chunk_tokens=None, group_width=DEFAULT_GROUP_WIDTH,
                            schedule="rows", num_warps=4, num_stages=2,
                            poison=False, return_partials=False, heads_width=None,
                            epilogue="triton"):
  """Same contract as `reference.ragged_attention_reference` (bf16/fp16 caches; the query is
  cast to the cache dtype); `heads_width`: as `ragged_attention`'s.

  Extra Args:
    block_s, target_chunks, chunk_tokens, group_width: chunking and head groups
      (`triton_plan.plan`).
    schedule: launch order of the chunks, one of `lpt.SCHEDULES` ("rows": LPT over row
      tasks, the default; "lpt": chunks longest first; "static": no sort).
    num_warps, num_stages: Triton compile options.
    poison: NaN-fill the partial buffers first (tests: every element must be written).
    return_partials: also return the raw (o, lse) partials.
    epilogue: where the records and the combine run, one of `triton_plan.EPILOGUES`.
  """
  p = plan(q_rot.shape, k_rot.shape[1], k_widths, v_widths, k_rot.dtype, block_s=block_s,
           target_chunks=target_chunks, chunk_tokens=chunk_tokens, group_width=group_width)
  rec = launch_records(p, lengths, schedule, epilogue)
  o, lse = launch_kernel(q_rot.astype(k_rot.dtype), k_rot, v_rot.astype(k_rot.dtype), rec, p,
                         scale, num_warps=num_warps, num_stages=num_stages, poison=poison)
  out, total = launch_combine(o, lse, p, out_dtype or q_rot.dtype, heads_width, epilogue)
  if return_partials:
    return out, total, (o, lse)
  return out, total


def launch_kernel(q_rot, k_rot, v_rot, rec, p, scale, *, num_warps, num_stages, poison=False):
  """The kernel alone on prepared records: the (o [T, G, VW], lse [T, GP]) partials."""
  c = p.constexprs
  t = p.total_chunks
  out_shapes = [jax.ShapeDtypeStruct((t, c["G"], c["VW"]), jnp.float32),
                jax.ShapeDtypeStruct((t, c["GP"]), jnp.float32)]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  return triton_backend.launch(
      ragged_kernel, q_rot, k_rot, v_rot, rec,
      jnp.asarray(p.row_table()), int(k_rot.shape[1]),
      np.float32(scale), out_shapes=out_shapes, grid=(t,), num_warps=num_warps,
      num_stages=num_stages, poison=poison, **c)
