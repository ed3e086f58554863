"""Launch plan of the ragged-head Triton decode kernel (`triton_ragged`), importable without
Triton: the shape rules `triton_fit` checks, the static chunk table and the launch geometry
that the JAX wrapper and the CPU interpreter check share.

Head groups. The MMA needs 16 query rows; a KV head has G (1 for MHA, 4 for Llama-3). So a
program takes a group of consecutive KV heads, up to 16 // G of them and `group_width` columns
of keys and of values, as one block-diagonal problem: query row j * G + g holds head
(h0 + j)'s query g in that head's columns of the group's [koff_h0, koff_h0 + sum k) slice and
zeros elsewhere, so one [rows, group slice] x [group slice, tokens] MMA gives every head's
scores and one P x V MMA every head's output (each row keeps its own head's columns). The
group's slice of a cache row is contiguous (256-512 bytes instead of one head's 64-192), the
16 rows are used, and nothing is padded in memory.

Chunks. Task (b, group) reads lengths[b] tokens of w_group = sum_h (k_h + v_h) elements each and
is cut along the sequence into chunks. Default: one chunk size for every group, n_chunks =
max(ceil(DEFAULT_TARGET_CHUNKS / (B * n_groups)), ceil(capacity / MAX_CHUNK_TOKENS)) chunks per
task at full capacity (an explicit target_chunks drops the length cap: n_chunks =
ceil(target_chunks / (B * n_groups))), so the groups' chunks of one (b, token range) read the
same cache rows (`lpt`'s "rows" order runs them side by side). Chunk sizes ~ 1 / group width
(FDC §5.2's row-block resizing applied to decode's chunks) were slower on the H200 and removed
(results/rotated_kernel.md; git history: commit 1b80474). Static chunk ids are (b, c, group): id
= (b * n_chunks + c) * n_groups + group, n_chunks the largest group's count; chunks past a row's
length (or past the capacity, in groups with larger chunks) are empty and write lse = -inf.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .reference import check_widths, offsets

KERNEL_DTYPES = ("bfloat16", "float16")
MAX_WIDTH = 256          # widest tile (registers: a [16, 256] fp32 accumulator per program)
MAX_GROUPS = 64          # query heads per KV head (rows of the query tile)
DEFAULT_BLOCK_S = 64
# Default chunking at full capacity: DEFAULT_TARGET_CHUNKS chunks in all (a compromise between
# the best values of the H200 sweeps for a Llama-3-8B and a Llama-2-7B layer at batch 8), and
# more where that would make chunks longer than MAX_CHUNK_TOKENS (large batches and many head
# groups: a fixed total makes few, long chunks there; the H200 measurements:
# results/rotated_kernel.md, "Chunk count and batch").
DEFAULT_TARGET_CHUNKS = 792
MAX_CHUNK_TOKENS = 1024
DEFAULT_GROUP_WIDTH = 256  # columns of keys (and of values) per program at most
MMA_ROWS = 16
MIN_TILES = 4            # tiles per chunk at least (per-chunk fixed costs stay small)
RECORD = 9               # int32 fields of a program's record (`triton_ragged.records`)
QUANT_BITS = (2, 4)      # codes the quantized kernel reads (`triton_ragged_quant`)
QUANT_GROUP = 16         # its key token group = value channel group (a sub-tile / block)
# Where the records and the combine around the kernel run (`epilogue` of the kernels'
# wrappers): "triton", one launch each (`triton_records`, `triton_combine`); "xla", the jnp
# `triton_ragged.records` and `combine_heads` (their references), several XLA fusions each.
EPILOGUES = ("triton", "xla")


def pow2_at_least(x: int, lo: int = 16) -> int:
  """The smallest power of two >= x, and at least lo (tile and loop-step sizes)."""
  return max(lo, 1 << (int(x) - 1).bit_length())


def head_groups(k_widths, v_widths, groups: int, group_width: int = DEFAULT_GROUP_WIDTH):
  """Consecutive KV heads packed greedily: at most max(1, 16 // G) heads and `group_width`
  key (and value) columns per group; a head wider than group_width is a group of its own."""
  per = max(1, MMA_ROWS // groups)
  out, cur, kw, vw = [], [], 0, 0
  for h, (k, v) in enumerate(zip(k_widths, v_widths)):
    if cur and (len(cur) == per or kw + k > group_width or vw + v > group_width):
      out.append(tuple(cur))
      cur, kw, vw = [], 0, 0
    cur.append(h)
    kw, vw = kw + k, vw + v
  out.append(tuple(cur))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
  """Static launch geometry of one (shape, widths, knobs)."""

  batch: int
  capacity: int
  groups: int                 # G query heads per KV head
  k_widths: tuple
  v_widths: tuple
  block_s: int
  chunk_tokens: tuple         # per head group
  n_chunks: int               # chunk ids per (b, head group) task (the largest group's count)
  head_groups: tuple          # tuples of consecutive KV heads (`head_groups`)

  @property
  def n_groups(self) -> int:
    return len(self.head_groups)

  @property
  def total_chunks(self) -> int:
    return self.batch * self.n_chunks * self.n_groups

  def _group_sums(self, widths):
    return [sum(widths[h] for h in grp) for grp in self.head_groups]

  @property
  def constexprs(self) -> dict:
    rows = max(len(grp) for grp in self.head_groups) * self.groups
    return dict(G=self.groups, GP=pow2_at_least(rows), GC=pow2_at_least(self.groups),
                SK=sum(self.k_widths), SV=sum(self.v_widths),
                KW=pow2_at_least(max(self._group_sums(self.k_widths))),
                VW=pow2_at_least(max(self._group_sums(self.v_widths))), BLOCK_S=self.block_s)

  def group_table(self) -> np.ndarray:
    """int32 [n_groups, 5]: (k offset, v offset, k width / 16, v width / 16, group index)."""
    ko, vo = offsets(self.k_widths), offsets(self.v_widths)
    return np.asarray([(ko[grp[0]], vo[grp[0]], kw // 16, vw // 16, i) for i, (grp, kw, vw) in
                       enumerate(zip(self.head_groups, self._group_sums(self.k_widths),
                                     self._group_sums(self.v_widths)))], np.int32)

  def row_table(self) -> np.ndarray:
    """int32 [n_groups, GP, 4]: each query row's key columns [start, end) / 16 and value
    columns [start, end) / 16 in its group's slices (row j * G + g: head j of the group; rows
    past the group's heads: empty)."""
    gp = self.constexprs["GP"]
    ko, vo = offsets(self.k_widths), offsets(self.v_widths)
    tab = np.zeros((self.n_groups, gp, 4), np.int32)
    for i, grp in enumerate(self.head_groups):
      for j, h in enumerate(grp):
        klo, vlo = (ko[h] - ko[grp[0]]) // 16, (vo[h] - vo[grp[0]]) // 16
        tab[i, j * self.groups:(j + 1) * self.groups] = (
            klo, klo + self.k_widths[h] // 16, vlo, vlo + self.v_widths[h] // 16)
    return tab

  def widths(self) -> np.ndarray:
    """int32 [n_groups]: sum over the group of k_h + v_h (elements read per token)."""
    return (np.asarray(self._group_sums(self.k_widths), np.int32)
            + np.asarray(self._group_sums(self.v_widths), np.int32))

  def output_index(self):
    """Static index tables of the combine (`triton_ragged.combine_heads`) over the kernel's
    compact partials (o [.., n_groups, G, VW]: row g holds query g of every head of the group,
    each head in its own value columns; lse [.., n_groups, GP], one per block-diagonal row):
      weight_row [n_groups, G, VW]: the lse row (j * G + g) whose split-K weight column c of
        query g takes (head j owns c; 0 past the group's columns, where o is 0);
      packed [G, sum v]: each packed output column's flat index in [n_groups * G * VW];
      lse [K, G]: head h's query g's flat index in [n_groups * GP]."""
    c = self.constexprs
    gp, vwt, g = c["GP"], c["VW"], self.groups
    vo = offsets(self.v_widths)
    weight_row = np.zeros((self.n_groups, g, vwt), np.int32)
    packed = np.zeros((g, sum(self.v_widths)), np.int32)
    lse = np.zeros((len(self.k_widths), g), np.int32)
    qs = np.arange(g)
    for i, grp in enumerate(self.head_groups):
      for j, h in enumerate(grp):
        lo = vo[h] - vo[grp[0]]
        cols = lo + np.arange(self.v_widths[h])
        weight_row[i, :, lo:lo + self.v_widths[h]] = (j * g + qs)[:, None]
        packed[:, vo[h]:vo[h] + self.v_widths[h]] = (i * g + qs)[:, None] * vwt + cols[None, :]
        lse[h] = i * gp + j * g + qs
    return weight_row, packed, lse

  def head_table(self) -> np.ndarray:
    """int32 [K, 5] of the one-launch combine (`triton_combine`): per KV head its group,
    first LSE row (j * G, head j of the group), first column in the group's compact partials,
    value width, and its column offset in the packed [B, G, sum v] output (vo[h])."""
    vo = offsets(self.v_widths)
    tab = np.zeros((len(self.v_widths), 5), np.int32)
    for i, grp in enumerate(self.head_groups):
      for j, h in enumerate(grp):
        tab[h] = (i, j * self.groups, vo[h] - vo[grp[0]], self.v_widths[h], vo[h])
    return tab

  def records_fit(self, schedule: str, max_rows: int) -> bool:
    """Whether the one-launch records (`triton_records`) build this plan's records under
    `schedule`: the "rows" order, one chunk size for every group, at most max_rows row
    tasks."""
    return (schedule == "rows" and len(set(self.chunk_tokens)) == 1
            and self.batch * self.n_chunks <= max_rows)

  def heads_index(self, width: int) -> np.ndarray:
    """int32 [K, G, width]: head h's query g's output column t (< v_h) as a flat index into
    [n_groups * G * VW] (the `output_index` packed table regrouped by head); columns
    t >= v_h get n_groups * G * VW, past the end (filled with zeros by the gather)."""
    _, packed, _ = self.output_index()
    vo = offsets(self.v_widths)
    end = self.n_groups * self.groups * self.constexprs["VW"]
    out = np.full((len(self.v_widths), self.groups, width), end, np.int32)
    for h, w in enumerate(self.v_widths):
      out[h, :, :w] = packed[:, vo[h]:vo[h] + w]
    return out


def check_epilogue(epilogue) -> None:
  """ValueError naming `epilogue` unless it is one of EPILOGUES."""
  if epilogue not in EPILOGUES:
    raise ValueError(f"triton ragged attention: epilogue must be one of {EPILOGUES}, got "
                     f"{epilogue!r}")


def check_fit(q_shape, k_widths, v_widths, dtype, capacity=None, block_s=DEFAULT_BLOCK_S):
  """ValueError naming the field unless the Triton kernel takes these operands."""
  check_widths(k_widths, v_widths)
  name = np.dtype(dtype).name
  if name not in KERNEL_DTYPES:
    raise ValueError(f"triton ragged attention: cache dtype is {name}; the kernel takes "
                     f"{' or '.join(KERNEL_DTYPES)} (fp32 would run its MMAs in TF32)")
  if len(q_shape) != 3 or q_shape[-1] != sum(k_widths):
    raise ValueError(f"triton ragged attention: q_rot must be [B, G, sum(k_widths)="
                     f"{sum(k_widths)}], got {tuple(q_shape)}")
  for field, ws in (("k_widths", k_widths), ("v_widths", v_widths)):
    if max(ws) > MAX_WIDTH:
      raise ValueError(f"triton ragged attention: {field} entries must be <= {MAX_WIDTH}, "
                       f"got {max(ws)}")
  if q_shape[1] > MAX_GROUPS:
    raise ValueError(f"triton ragged attention: at most {MAX_GROUPS} query heads per KV head "
                     f"(q_rot's G), got {q_shape[1]}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"triton ragged attention: block_s must be a power of 2 >= 16, got {block_s}")
  if capacity is not None and capacity * max(sum(k_widths), sum(v_widths)) >= 2 ** 31:
    raise ValueError("triton ragged attention: one sequence's cache exceeds int32 indexing")


def check_store(keys, values, k_widths, v_widths) -> None:
  """ValueError naming the field unless the kernel reads this store (`QUANT_BITS`, groups of
  `QUANT_GROUP`, 16-bit scales, the widths' sums as the store's channels)."""
  if keys.bits != values.bits or keys.bits not in QUANT_BITS:
    raise ValueError(f"quantized ragged attention: bits must be one of {QUANT_BITS} and equal "
                     f"for keys and values, got {keys.bits}/{values.bits}")
  if keys.group != QUANT_GROUP or values.group != QUANT_GROUP:
    raise ValueError(f"quantized ragged attention: the quantizer group (RotatedSpec."
                     f"group_size) must be {QUANT_GROUP}, got {keys.group}/{values.group}")
  if keys.head_dim != sum(k_widths) or values.head_dim != sum(v_widths):
    raise ValueError(f"quantized ragged attention: the store holds {keys.head_dim} key / "
                     f"{values.head_dim} value channels, the widths sum to {sum(k_widths)} / "
                     f"{sum(v_widths)}")
  for name, x in (("keys.scale", keys.scale), ("keys.zero", keys.zero),
                  ("values.scale", values.scale), ("values.zero", values.zero)):
    if np.dtype(x.dtype).name not in ("bfloat16", "float16"):
      raise ValueError(f"quantized ragged attention: {name} must be bf16 or fp16, got "
                       f"{np.dtype(x.dtype).name}")


def plan(q_shape, capacity, k_widths, v_widths, dtype, *, block_s=DEFAULT_BLOCK_S,
         target_chunks=None, chunk_tokens=None, group_width=DEFAULT_GROUP_WIDTH) -> RaggedPlan:
  """The static plan; ValueError (`check_fit`) for operands the kernel does not take.

  Args:
    q_shape: (B, G, sum k); capacity: cache slots S; dtype: the cache dtype.
    block_s: tokens per tile; target_chunks: chunks to aim for at full capacity (default:
      DEFAULT_TARGET_CHUNKS, and chunks of at most MAX_CHUNK_TOKENS); chunk_tokens: explicit
      chunk size for every group, a multiple of block_s;
    group_width: key (and value) columns per head group at most (`head_groups`; 16 gives
      one head per program).
  """
  k_widths, v_widths = tuple(int(w) for w in k_widths), tuple(int(w) for w in v_widths)
  check_fit(q_shape, k_widths, v_widths, dtype, capacity, block_s)
  b, g = int(q_shape[0]), int(q_shape[1])
  if group_width < 16 or group_width > MAX_WIDTH:
    raise ValueError(f"triton ragged attention: group_width must be in [16, {MAX_WIDTH}], "
                     f"got {group_width}")
  grps = head_groups(k_widths, v_widths, g, group_width)
  tiles = max(1, math.ceil(capacity / block_s))
  if chunk_tokens is None:
    target = DEFAULT_TARGET_CHUNKS if target_chunks is None else int(target_chunks)
    if target < 1:
      raise ValueError(f"triton ragged attention: target_chunks must be >= 1, got {target}")
    n = math.ceil(target / (b * len(grps)))
    if target_chunks is None:
      n = max(n, math.ceil(tiles * block_s / MAX_CHUNK_TOKENS))
    n = max(1, min(n, max(1, tiles // MIN_TILES)))
    ct = (math.ceil(tiles / n) * block_s,) * len(grps)
  else:
    if int(chunk_tokens) < block_s or int(chunk_tokens) % block_s:
      raise ValueError(f"triton ragged attention: chunk_tokens must be a positive multiple of "
                       f"block_s ({block_s}), got {chunk_tokens}")
    ct = (int(chunk_tokens),) * len(grps)
  return RaggedPlan(batch=b, capacity=int(capacity), groups=g, k_widths=k_widths,
                    v_widths=v_widths, block_s=block_s, chunk_tokens=ct,
                    n_chunks=max(math.ceil(capacity / c) for c in ct), head_groups=grps)
