"""GEAR problem shapes and seeded contract-conforming inputs (tests and the benchmark).

The backbone is a KIVI planar store of random data (`kivi.shapes.make_inputs`); the residual
operands are random with the contract's shapes, dtypes and zero patterns (a's columns beyond
a segment's rank are 0, a few outlier slots of value 0, slots distinct per vector).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..kivi import shapes as kivi_shapes
from .operands import GearLowRank, GearSparseKeys, GearSparseValues

VARIANTS = ("gear", "gear-l", "outlier")  # Q + S + L, Q + L, Q + S


@dataclasses.dataclass(frozen=True)
class GearShape:
  """One GEAR decode problem: its KIVI backbone problem (whose fields -- batch, capacity,
  window, heads, head_dim, groups, scale dtype -- read through, e.g. `shape.batch`) plus
  chunks of `chunk` tokens, the ranks and the outlier slots. GEAR quantizes K and V with
  the same bits (`bits`)."""

  backbone: kivi_shapes.KiviShape
  chunk: int = 64
  prefill_rank: int = 4
  chunk_rank: int = 2
  key_slots: int = 2
  value_slots: int = 3

  def __post_init__(self):
    if self.backbone.k_bits != self.backbone.v_bits:
      raise ValueError(f"GearShape.backbone: GEAR quantizes K and V with the same bits, got "
                       f"k_bits={self.backbone.k_bits}, v_bits={self.backbone.v_bits}")

  def __getattr__(self, name):
    if name == "backbone":   # not set yet (copy / unpickle): no recursion
      raise AttributeError(name)
    return getattr(self.backbone, name)

  @property
  def bits(self) -> int:
    return self.backbone.k_bits


def backbone(batch, capacity, window, n_heads, n_kv_heads, head_dim=128, bits=2, k_group=64,
             v_group=64, scale_dtype: Optional[str] = "float16") -> kivi_shapes.KiviShape:
  """GEAR's default backbone problem: KIVI g = 64 at `bits` for K and V, fp16 scales."""
  return kivi_shapes.KiviShape(batch=batch, capacity=capacity, window=window, n_heads=n_heads,
                               n_kv_heads=n_kv_heads, head_dim=head_dim, k_bits=bits,
                               v_bits=bits, k_group=k_group, v_group=v_group,
                               scale_dtype=scale_dtype)


# Tiny problems for the CPU interpreter: MHA H = 64 with key groups of 32 in chunks of 64;
# GQA 4 H = 128 with chunks of 32 (block_s 32) and ranks 3 / 1.
TEST_SHAPES = (
    GearShape(backbone(batch=2, capacity=192, window=24, n_heads=2, n_kv_heads=2, head_dim=64,
                       k_group=32, v_group=32)),
    GearShape(backbone(batch=2, capacity=128, window=9, n_heads=8, n_kv_heads=2, head_dim=128,
                       k_group=32, v_group=64, scale_dtype=None),
              chunk=32, prefill_rank=3, chunk_rank=1, key_slots=1, value_slots=2),
)


def residual_operands(shape: GearShape, key, n_pchunks, variant="gear"):
  """(lowrank, sparse_k, sparse_v) of `variant` (VARIANTS), seeded."""
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  b, kh, s, h, nb = shape.batch, shape.n_kv_heads, shape.capacity, shape.head_dim, shape.chunk
  c = s // nb
  rp, rg = shape.prefill_rank, shape.chunk_rank
  ra = max(rp, rg)
  ks = jax.random.split(key, 10)
  f16 = jnp.float16
  npc = jnp.asarray(n_pchunks, jnp.int32)
  lowrank = sparse_k = sparse_v = None
  if variant in ("gear", "gear-l"):
    pre = ((jnp.arange(s) // nb)[None, :] < npc[:, None])[:, None, :, None]  # [B,1,S,1]
    col = jnp.arange(ra)[None, None, None, :]
    keep = jnp.where(pre, col < rp, col < rg)

    def left(k):
      return jnp.where(keep, 0.5 * jax.random.normal(k, (b, kh, s, ra)), 0.0).astype(f16)

    lowrank = GearLowRank(
        a_k=left(ks[0]), a_v=left(ks[1]),
        b_k=(0.3 * jax.random.normal(ks[2], (b, kh, c, h, rg))).astype(f16),
        b_v=(0.3 * jax.random.normal(ks[3], (b, kh, c, h, rg))).astype(f16),
        bp_k=(0.3 * jax.random.normal(ks[4], (b, kh, h, rp))).astype(f16),
        bp_v=(0.3 * jax.random.normal(ks[5], (b, kh, h, rp))).astype(f16),
        n_pchunks=npc)
  if variant in ("gear", "outlier"):
    nk, nv = shape.key_slots, shape.value_slots
    kval = 3.0 * jax.random.normal(ks[6], (b, kh, c, nk, h))
    kval = jnp.where(jax.random.uniform(ks[9], kval.shape) < 0.1, 0.0, kval)  # unused slots
    # Distinct slots per vector, as GEAR selects them (the contract): NK tokens of a key
    # channel's chunk, NV channels of a value token.
    tok = jnp.argsort(jax.random.uniform(ks[7], (b, kh, c, h, nb)), axis=-1)[..., :nk]
    sparse_k = GearSparseKeys(idx=jnp.swapaxes(tok, -1, -2).astype(jnp.uint8),
                              val=kval.astype(f16))
    ch = jnp.argsort(jax.random.uniform(ks[8], (b, kh, s, h)), axis=-1)[..., :nv]
    sparse_v = GearSparseValues(
        idx=ch.astype(jnp.uint8),
        val=(3.0 * jax.random.normal(ks[9], (b, kh, s, nv))).astype(f16))
  return lowrank, sparse_k, sparse_v


def make_inputs(shape: GearShape, key, q_len=None, w_len=None, n_pchunks=None,
                variant="gear"):
  """((q, keys, values, k_win, v_win, q_len, w_len), dict(lowrank, sparse_k, sparse_v)).

  q_len defaults to the capacity, n_pchunks to half of each sequence's chunks.
  """
  k1, k2 = jax.random.split(key)
  args = kivi_shapes.make_inputs(shape.backbone, k1, q_len=q_len, w_len=w_len)
  ql = np.asarray(args[5])
  if n_pchunks is None:
    n_pchunks = ql // shape.chunk // 2
  lowrank, sparse_k, sparse_v = residual_operands(shape, k2, n_pchunks, variant)
  return args, dict(lowrank=lowrank, sparse_k=sparse_k, sparse_v=sparse_v)
