"""Sizes, fit checks and launch plan of GEAR-L's Mosaic warp kernel (`mosaic_gear`).

`config_fit` says whether a GEAR configuration fits the kernel (the cache then keeps its
backbone in the warp layout, `GearSpec.layout`); `fit` whether a call's operands do;
`plan` is the KIVI warp kernel's plan with the extension's shared memory added.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..kivi import mosaic_kivi_warp as mkw
from ..kivi import store as kstore
from ..kivi.mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic, check_mosaic

NAME = "mosaic GEAR-L (warp)"
LR = 8          # rank columns of the per-CTA operands (q B_p, B_v,p), zero-padded
CHUNKS = (32, 64, 128)
RANKS = (2, 4, 8)
DTYPE = "float16"


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
  """Static sizes of the low-rank terms: left-factor columns RA, ranks r_p / r_g, chunk."""

  ra: int
  rp: int
  rg: int
  chunk: int

  @property
  def chunks_per_block(self) -> int:
    return max(1, BLOCK // self.chunk)

  @property
  def b_rows(self) -> int:
    """Rows of 256 of one chunk's right factor [H, r_g]."""
    return HEAD_DIM * self.rg // 256


def config_fit(*, bits: int, group: int, head_dim: int, scale_dtype, sparse: bool,
               rank_prefill: int, rank_chunk: int, chunk: int) -> str | None:
  """None when a GEAR configuration's store and factors fit this kernel (the cache then
  keeps its backbone in the warp layout), else why not (one line)."""
  if sparse:
    return "outliers (the Mosaic GEAR kernel adds the low rank only)"
  why = kstore.warp_fit(k_bits=bits, v_bits=bits, group=group, head_dim=head_dim,
                        scale_dtype=scale_dtype)
  if why is not None:
    return why
  if jnp.dtype(scale_dtype) != jnp.float16:
    return (f"{jnp.dtype(scale_dtype).name} scales (the Mosaic GEAR kernel's MMAs are fp16, "
            "as GEAR's factors)")
  ra, rp, rg = max(rank_prefill, rank_chunk), rank_prefill, rank_chunk
  if ra not in RANKS or rg not in RANKS or not 1 <= rp <= LR:
    return (f"ranks RA={ra}, r_p={rp}, r_g={rg} (the Mosaic GEAR kernel takes RA = "
            f"max(r_p, r_g) and r_g in {RANKS}, 1 <= r_p <= {LR})")
  if chunk not in CHUNKS:
    return f"chunks of {chunk} tokens (the Mosaic GEAR kernel takes {CHUNKS})"
  return None


def fit(q_shape, cache, lowrank, chunk: int, sparse=False) -> str | None:
  """None when this kernel takes the problem, else why not (one line)."""
  if sparse:
    return "outliers (the Mosaic GEAR kernel adds the low rank only)"
  if not isinstance(cache, KiviMosaic):
    return "the store is not in the warp layout"
  if lowrank is None:
    return "no low-rank factors"
  try:
    dtype = check_mosaic(cache)
  except ValueError as e:
    return str(e)
  ra, rp, rg = lowrank.a_k.shape[-1], lowrank.prefill_rank, lowrank.chunk_rank
  why = config_fit(bits=2, group=cache.group, head_dim=HEAD_DIM, scale_dtype=dtype, sparse=False,
                   rank_prefill=rp, rank_chunk=rg, chunk=chunk)
  if why is not None:
    return why
  if ra != max(rp, rg):
    return f"lowrank.a_k has {ra} columns, expected max(r_p={rp}, r_g={rg})"
  if lowrank.b_k.shape[2] * chunk != cache.capacity:
    return (f"lowrank.b_k has {lowrank.b_k.shape[2]} chunks of {chunk} tokens for a capacity "
            f"of {cache.capacity}")
  for name in ("a_k", "a_v", "b_k", "b_v", "bp_k", "bp_v"):
    if getattr(lowrank, name).dtype != jnp.float16:
      return f"lowrank.{name} is {getattr(lowrank, name).dtype} (the kernel reads fp16)"
  try:
    plan(q_shape, cache, LowRankPlan(ra, rp, rg, chunk))
  except ValueError as e:
    return str(e)
  return None


def extra_smem(lp: LowRankPlan):
  kib = lambda n: -(-n // 1024) * 1024

  def extra(w, stages, np_, q_slots):
    per_slot = 2 * (lp.ra // 2) * 512 + 2 * lp.chunks_per_block * lp.b_rows * 512
    return (stages * per_slot + kib(q_slots * np_ * LR * 2) + kib(q_slots * HEAD_DIM * LR * 2)
            + kib(4 * w * 8 * np_ * 4) + 256)
  return extra


def plan(q_shape, cache, lp, **knobs):
  return mkw.plan(q_shape, cache.kc.shape, extra_smem=extra_smem(lp), kgroup=cache.group,
                  **knobs)
