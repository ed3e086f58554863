"""Launch plan of the ragged-head Triton decode kernel (`triton_ragged`), importable without
Triton: the shape rules `triton_fit` checks, the static chunk tables and the launch geometry
that the JAX wrapper and the CPU interpreter check share.

Chunks. Task (b, h) reads lengths[b] tokens of k_h + v_h elements each. It is split along the
sequence into chunks of `chunk_tokens[h]` slots, sized so that every full chunk costs about
the same whatever its head's width (FDC §5.2's row-block resizing, B_r^i ~ 1/d_sum^i, applied
to decode's key chunks): chunk_tokens[h] ~ C / (k_h + v_h) tokens, a multiple of block_s, with
C set so that a batch at full capacity has about `target_chunks` chunks. Chunk counts are
static (sized for the capacity S); chunks past a row's length are empty and write lse = -inf.
Static chunk ids are head-major (h, b, c), so each head's partials are one contiguous slice
for the split-K combine.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .reference import check_widths, offsets

KERNEL_DTYPES = ("bfloat16", "float16")
MAX_WIDTH = 256          # widest head tile (registers: a [16, 256] fp32 accumulator per program)
DEFAULT_BLOCK_S = 64
# Chunks at full capacity: ~8 per SM slot of the 132 SMs of an H100/H200.
DEFAULT_TARGET_CHUNKS = 1056
MIN_TILES = 4            # tiles per chunk at least (per-chunk fixed costs stay small)


def _pow2_at_least(x: int, lo: int = 16) -> int:
  return max(lo, 1 << (int(x) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
  """Static launch geometry of one (shape, widths, knobs)."""

  batch: int
  capacity: int
  groups: int                 # G query heads per KV head
  k_widths: tuple
  v_widths: tuple
  block_s: int
  chunk_tokens: tuple         # per KV head
  n_chunks: tuple             # per KV head (chunks per batch row)

  @property
  def heads(self) -> int:
    return len(self.k_widths)

  @property
  def total_chunks(self) -> int:
    return self.batch * sum(self.n_chunks)

  @property
  def chunk_base(self) -> tuple:
    """First static chunk id of each head (ids are head-major: (h, b, c))."""
    return offsets(tuple(self.batch * n for n in self.n_chunks))

  @property
  def constexprs(self) -> dict:
    return dict(G=self.groups, GP=_pow2_at_least(self.groups), SK=sum(self.k_widths),
                SV=sum(self.v_widths), KW=_pow2_at_least(max(self.k_widths)),
                VW=_pow2_at_least(max(self.v_widths)), BLOCK_S=self.block_s)

  def head_table(self) -> np.ndarray:
    """int32 [K, 5]: (k offset, v offset, k width, v width, chunk tokens) per KV head."""
    return np.asarray([(ko, vo, kw, vw, ct) for ko, vo, kw, vw, ct in zip(
        offsets(self.k_widths), offsets(self.v_widths), self.k_widths, self.v_widths,
        self.chunk_tokens)], np.int32)

  def chunk_table(self) -> np.ndarray:
    """int32 [T, 3]: (batch row, KV head, first slot) of each static chunk id."""
    rows = [(b, h, c * ct) for h, (n, ct) in enumerate(zip(self.n_chunks, self.chunk_tokens))
            for b in range(self.batch) for c in range(n)]
    return np.asarray(rows, np.int32).reshape(-1, 3)

  def chunk_cost_terms(self):
    """(batch row, first slot, chunk tokens, k_h + v_h) of each static chunk: the static
    inputs of `lpt.chunk_order`."""
    tab = self.chunk_table()
    h = tab[:, 1]
    ct = np.asarray(self.chunk_tokens, np.int32)[h]
    width = (np.asarray(self.k_widths, np.int32) + np.asarray(self.v_widths, np.int32))[h]
    return tab[:, 0], tab[:, 2], ct, width


def check_fit(q_shape, k_widths, v_widths, dtype, capacity=None, block_s=DEFAULT_BLOCK_S):
  """ValueError naming the field unless the Triton kernel takes these operands."""
  check_widths(k_widths, v_widths)
  name = np.dtype(dtype).name if not hasattr(dtype, "name") else dtype.name
  if str(name) not in KERNEL_DTYPES:
    raise ValueError(f"triton ragged attention: cache dtype is {name}; the kernel takes "
                     f"{' or '.join(KERNEL_DTYPES)} (fp32 would run its MMAs in TF32)")
  if len(q_shape) != 3 or q_shape[-1] != sum(k_widths):
    raise ValueError(f"triton ragged attention: q_rot must be [B, G, sum(k_widths)="
                     f"{sum(k_widths)}], got {tuple(q_shape)}")
  for field, ws in (("k_widths", k_widths), ("v_widths", v_widths)):
    if max(ws) > MAX_WIDTH:
      raise ValueError(f"triton ragged attention: {field} entries must be <= {MAX_WIDTH}, "
                       f"got {max(ws)}")
  if q_shape[1] > 64:
    raise ValueError(f"triton ragged attention: at most 64 query heads per KV head, got "
                     f"{q_shape[1]}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"triton ragged attention: block_s must be a power of 2 >= 16, got {block_s}")
  if capacity is not None and capacity * max(sum(k_widths), sum(v_widths)) >= 2 ** 31:
    raise ValueError("triton ragged attention: one sequence's cache exceeds int32 indexing")


def plan(q_shape, capacity, k_widths, v_widths, dtype, *, block_s=DEFAULT_BLOCK_S,
         target_chunks=None, chunk_tokens=None) -> RaggedPlan:
  """The static plan; ValueError (`check_fit`) for operands the kernel does not take.

  Args:
    q_shape: (B, G, sum k); capacity: cache slots S.
    block_s: tokens per tile; target_chunks: chunks to aim for at full capacity (default
      DEFAULT_TARGET_CHUNKS); chunk_tokens: explicit per-head (tuple) or common (int) chunk
      size in tokens, a multiple of block_s (sweeps, tests).
  """
  k_widths, v_widths = tuple(int(w) for w in k_widths), tuple(int(w) for w in v_widths)
  check_fit(q_shape, k_widths, v_widths, dtype, capacity, block_s)
  b, g = int(q_shape[0]), int(q_shape[1])
  tiles = max(1, math.ceil(capacity / block_s))
  widths = [kw + vw for kw, vw in zip(k_widths, v_widths)]
  if chunk_tokens is None:
    target = target_chunks or DEFAULT_TARGET_CHUNKS
    if target < 1:
      raise ValueError(f"triton ragged attention: target_chunks must be >= 1, got {target}")
    # Cost per chunk C so that B * sum_h S * w_h / C ~ target.
    per_chunk = b * tiles * block_s * sum(widths) / target
    ct = []
    for w in widths:
      n_tiles = max(1, round(per_chunk / w / block_s))
      ct.append(block_s * min(tiles, max(min(MIN_TILES, tiles), n_tiles)))
  else:
    ct = list(chunk_tokens) if isinstance(chunk_tokens, (tuple, list)) else [int(chunk_tokens)] * len(widths)
    if len(ct) != len(widths) or any(c < block_s or c % block_s for c in ct):
      raise ValueError(f"triton ragged attention: chunk_tokens must be multiples of block_s "
                       f"({block_s}), one per KV head or one for all, got {chunk_tokens}")
  n_chunks = tuple(max(1, math.ceil(capacity / c)) for c in ct)
  return RaggedPlan(batch=b, capacity=int(capacity), groups=g, k_widths=k_widths,
                    v_widths=v_widths, block_s=block_s, chunk_tokens=tuple(ct), n_chunks=n_chunks)
