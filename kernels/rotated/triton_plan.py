"""Launch plan of the ragged-head Triton decode kernel (`triton_ragged`), importable without
Triton: the shape rules `triton_fit` checks, the static chunk table and the launch geometry
that the JAX wrapper and the CPU interpreter check share.

Chunks. Task (b, h) reads lengths[b] tokens of k_h + v_h elements each. Every task is cut
along the sequence into `n_chunks` chunks of `chunk_tokens` slots (a multiple of block_s),
sized so that a batch at full capacity has about `target_chunks` chunks. The chunk size is
common to all heads, so the K chunks of one (b, token range) read the same rows of the packed
[B, S, sum k] cache and can run side by side (see `lpt`); chunks past a row's length are
empty and write lse = -inf. Static chunk ids are (b, c, h): id = (b * n_chunks + c) * K + h.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .reference import check_widths, offsets

KERNEL_DTYPES = ("bfloat16", "float16")
MAX_WIDTH = 256          # widest head tile (registers: a [16, 256] fp32 accumulator per program)
MAX_GROUPS = 64          # query heads per KV head (rows of the query tile)
DEFAULT_BLOCK_S = 64
DEFAULT_TARGET_CHUNKS = 528
MIN_TILES = 4            # tiles per chunk at least (per-chunk fixed costs stay small)
RECORD = 8               # int32 fields of a program's record (`records`)


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
  chunk_tokens: int
  n_chunks: int               # chunks per (b, h) task

  @property
  def heads(self) -> int:
    return len(self.k_widths)

  @property
  def total_chunks(self) -> int:
    return self.batch * self.n_chunks * self.heads

  @property
  def constexprs(self) -> dict:
    return dict(G=self.groups, GP=_pow2_at_least(self.groups), SK=sum(self.k_widths),
                SV=sum(self.v_widths), KW=_pow2_at_least(max(self.k_widths)),
                VW=_pow2_at_least(max(self.v_widths)), BLOCK_S=self.block_s)

  def head_table(self) -> np.ndarray:
    """int32 [K, 4]: (k offset, v offset, k width / 16, v width / 16) per KV head."""
    return np.asarray([(ko, vo, kw // 16, vw // 16) for ko, vo, kw, vw in zip(
        offsets(self.k_widths), offsets(self.v_widths), self.k_widths, self.v_widths)],
                      np.int32)

  def widths(self) -> np.ndarray:
    """int32 [K]: k_h + v_h (elements read per token)."""
    return np.asarray(self.k_widths, np.int32) + np.asarray(self.v_widths, np.int32)

  def value_columns(self) -> np.ndarray:
    """int32 [sum v]: where each packed output column sits in the kernel's [K, VW] rows."""
    vw = self.constexprs["VW"]
    return np.concatenate([h * vw + np.arange(w) for h, w in enumerate(self.v_widths)]
                          ).astype(np.int32)


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


def plan(q_shape, capacity, k_widths, v_widths, dtype, *, block_s=DEFAULT_BLOCK_S,
         target_chunks=None, chunk_tokens=None) -> RaggedPlan:
  """The static plan; ValueError (`check_fit`) for operands the kernel does not take.

  Args:
    q_shape: (B, G, sum k); capacity: cache slots S; dtype: the cache dtype.
    block_s: tokens per tile; target_chunks: chunks to aim for at full capacity (default
      DEFAULT_TARGET_CHUNKS); chunk_tokens: explicit chunk size, a multiple of block_s.
  """
  k_widths, v_widths = tuple(int(w) for w in k_widths), tuple(int(w) for w in v_widths)
  check_fit(q_shape, k_widths, v_widths, dtype, capacity, block_s)
  b, g = int(q_shape[0]), int(q_shape[1])
  tiles = max(1, math.ceil(capacity / block_s))
  if chunk_tokens is None:
    target = DEFAULT_TARGET_CHUNKS if target_chunks is None else int(target_chunks)
    if target < 1:
      raise ValueError(f"triton ragged attention: target_chunks must be >= 1, got {target}")
    n = max(1, min(math.ceil(target / (b * len(k_widths))), max(1, tiles // MIN_TILES)))
    ct = math.ceil(tiles / n) * block_s
  else:
    ct = int(chunk_tokens)
    if ct < block_s or ct % block_s:
      raise ValueError(f"triton ragged attention: chunk_tokens must be a positive multiple of "
                       f"block_s ({block_s}), got {chunk_tokens}")
  return RaggedPlan(batch=b, capacity=int(capacity), groups=g, k_widths=k_widths,
                    v_widths=v_widths, block_s=block_s, chunk_tokens=ct,
                    n_chunks=max(1, math.ceil(capacity / ct)))
