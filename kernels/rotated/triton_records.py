"""The ragged kernels' launch records in the "rows" order, built by one small Triton launch.

`triton_ragged.records` (jnp, the reference beside this kernel) builds the same int32 [T, 9]
table under jit; inside a decode step that was four small XLA fusions per layer (the row
tasks' costs, the two counting-rank reductions of `lpt.descending`, the gathers and the
concatenate), each a launch plus its gap. Here one launch does it, by the same
counting ranks, scattered instead of gathered:

  * with one chunk size ct for every head group (`fits`), row task r = b * n_chunks + c costs
    valid(r) * sum_g width_g, valid(r) = clip(len_b - c * ct, 0, ct) (`lpt.valid_tokens`,
    lengths clipped to the capacity as the reference does), so the stable descending order
    by cost is the one by valid tokens;
  * program i takes row tasks [i * RB, (i + 1) * RB) and counts each one's rank, #{r' :
    valid(r') > valid(r)} + #{r' < r : valid(r') = valid(r)}, over every row task in blocks
    of up to RC (at decode shapes one block: the loads of a program are two independent
    round trips to memory, its own lengths and everyone's);
  * it writes the task's NG records (its groups widest first, `lpt.order`) at rank * NG:
    every field comes from (b, c) and the static group table, so nothing is gathered.

Only the "rows" schedule (the default) with one chunk size and at most
`lpt.COUNT_SORT_MAX` row tasks runs here (`fits`); other plans keep the jnp records.
(A first version sorted the keys in one program with `tl.sort`: slower than the XLA
fusions it replaced; timings in `results/rotated_kernel.md`, "One-launch records and combine".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import triton_backend
from . import lpt
from .triton_plan import RECORD, pow2_at_least

RB = 32    # row tasks per program
RC = 512   # row tasks compared per step at most (decode shapes: all of them in one step)


def fits(p, schedule: str) -> bool:
  """Whether `rows_records` builds the records of plan `p` under `schedule`."""
  return p.records_fit(schedule, lpt.COUNT_SORT_MAX)


@triton.jit
def _valid(len_ptr, r, ok, capacity, NC: tl.constexpr, CT: tl.constexpr):
  """Valid tokens of row tasks r (0 where not ok), and their clipped row lengths."""
  length = tl.load(len_ptr + r // NC, mask=ok, other=0)
  length = tl.minimum(tl.maximum(length, 0), capacity)
  return tl.where(ok, tl.minimum(tl.maximum(length - (r % NC) * CT, 0), CT), 0), length


@triton.jit
def rows_records_kernel(len_ptr, slot_ptr, gtab_ptr, capacity, rec_ptr, N_ROWS: tl.constexpr,
                        NC: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                        CT: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr,
                        FIELDS: tl.constexpr):
  r = tl.program_id(0) * RB + tl.arange(0, RB)
  ok = r < N_ROWS
  valid, length = _valid(len_ptr, r, ok, capacity, NC, CT)
  rank = tl.zeros([RB], tl.int32)
  for r0 in range(0, N_ROWS, RC):
    other = r0 + tl.arange(0, RC)
    v2, _ = _valid(len_ptr, other, other < N_ROWS, capacity, NC, CT)
    before = (other < N_ROWS)[None, :] & ((v2[None, :] > valid[:, None])
                                          | ((v2[None, :] == valid[:, None])
                                             & (other[None, :] < r[:, None])))
    rank += tl.sum(before.to(tl.int32), 1)
  s = tl.arange(0, NGP)
  g = tl.load(slot_ptr + s, mask=s < NG, other=0)    # group of slot s (widest first)
  start = (r % NC) * CT
  end = tl.minimum(tl.maximum(length, start), start + CT)
  m = ok[:, None] & (s < NG)[None, :]
  base = rec_ptr + (rank[:, None] * NG + s[None, :]) * FIELDS
  zero = tl.zeros([RB, NGP], tl.int32)
  tl.store(base, r[:, None] * NG + g[None, :], mask=m)
  tl.store(base + 1, (r // NC)[:, None] + zero, mask=m)
  tl.store(base + 2, start[:, None] + zero, mask=m)
  tl.store(base + 3, end[:, None] + zero, mask=m)
  for f in tl.static_range(FIELDS - 4):
    field = tl.load(gtab_ptr + g * (FIELDS - 4) + f, mask=s < NG, other=0)
    tl.store(base + 4 + f, field[None, :] + zero, mask=m)


def rows_records(p, lengths):
  """int32 [T, 9]: `triton_ragged.records(p, lengths, "rows")`, built in one program (module
  docstring). Needs `fits(p, "rows")`."""
  if not fits(p, "rows"):
    raise ValueError(f"rows_records: {p.batch} x {p.n_chunks} row tasks exceed "
                     f"{lpt.COUNT_SORT_MAX}; use triton_ragged.records")
  n_rows, ng = p.batch * p.n_chunks, p.n_groups
  slots = np.argsort(-np.asarray(p.widths(), np.int32), kind="stable").astype(np.int32)
  (rec,) = triton_backend.launch(
      rows_records_kernel, lengths.astype(jnp.int32), jnp.asarray(slots),
      jnp.asarray(p.group_table().reshape(-1)), int(p.capacity),
      out_shapes=[jax.ShapeDtypeStruct((p.total_chunks, RECORD), jnp.int32)],
      grid=(-(-n_rows // RB),), num_warps=4, num_stages=1, inits=False, N_ROWS=n_rows,
      NC=p.n_chunks, NG=ng, NGP=pow2_at_least(ng, 2),
      CT=int(p.chunk_tokens[0]), RB=RB,
      RC=min(RC, pow2_at_least(n_rows, 2)), FIELDS=RECORD)
  return rec
