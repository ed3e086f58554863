"""KV size of a GEAR configuration in two conventions: ours and the paper's Table 9.

  honest: `GearCache.bytes_per_token()` x layers, i.e. `nbytes()` of everything that grows
    with the context: codes, fp16 scales and zeros, the fp16 low-rank factors, the sparse
    outliers as fp16 value plus uint8 index (`method.py` spells out the sum).
  paper_table9: the paper gives no formula (digests/gear.md section 6); its Table 9 sizes
    are reproduced as the backbone's honest bytes (s = 0, r = 0) plus the overheads the
    table reports for the same recipe, in points of the fp16 K/V size:
      low rank: +1.9 at r = 4 (GEAR-L r=4 minus its backbone: 23.6 - 21.7 over 2-bit KIVI,
        29.0 - 27.1 over 4-bit KCVT), scaled by r_p / 4 (the table has r = 4 only);
      sparse: GEAR minus GEAR-L, +4.0 over KIVI at s = 2 % (27.6 - 23.6, i.e. 2 s points)
        and +2.0 over KCVT (31.0 - 29.0, i.e. s points).
  dense: the fp16/bf16 K and V, 2 x layers x KV heads x head dim x 2 bytes.
results/gear.md explains why the two differ.
"""

from __future__ import annotations

import dataclasses

import jax

from kvlowrank.methods.gear.cache import GearCache
from kvlowrank.methods.gear.spec import GearSpec
from kvlowrank.spec import ModelSpec

# Table 9's averages (points of the fp16 size) that the convention adds to the backbone.
LOW_RANK_POINTS_AT_R4 = 1.9
SPARSE_POINTS_PER_PERCENT = {"kivi": 2.0, "kcvt": 1.0}


@dataclasses.dataclass(frozen=True)
class KvSize:
  """Bytes per token over all layers (module docstring)."""

  honest: float
  paper_table9: float
  dense: float

  def percent(self, which: str) -> float:
    """`which` ("honest" | "paper_table9") as a percentage of the dense size."""
    return 100.0 * getattr(self, which) / self.dense


def honest_bytes_per_token(spec: ModelSpec, gspec: GearSpec) -> float:
  """`GearCache.bytes_per_token()` x layers, from the cache's array shapes (none allocated)."""
  cache = jax.eval_shape(lambda: GearCache.init(gspec, spec, batch=1, capacity=1))
  return cache.bytes_per_token() * spec.n_layers


def kv_size(spec: ModelSpec, gspec: GearSpec) -> KvSize:
  """The KV bytes per token of `gspec` on `spec` in both conventions."""
  dense = 2.0 * spec.n_layers * spec.n_kv_heads * spec.head_dim * 2
  bare = dataclasses.replace(gspec, sparsity=0.0, rank_prefill=0, rank_chunk=0)
  points = (LOW_RANK_POINTS_AT_R4 * gspec.rank_prefill / 4
            + SPARSE_POINTS_PER_PERCENT[gspec.backbone] * gspec.sparsity)
  return KvSize(honest=honest_bytes_per_token(spec, gspec),
                paper_table9=honest_bytes_per_token(spec, bare) + dense * points / 100,
                dense=dense)
