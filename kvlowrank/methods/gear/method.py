"""GEAR (Kang et al. 2024) as an evaluable method: kvlowrank.methods.gear.cache, no calibration.

KV bytes per token (asymptotic, per layer and KV head; H = head dim, Gk/Gv = the
backbone's key/value groups, n_b = buffer, s_b = bytes of a scale, RA = max(r_p, r_g),
NK/NV = outlier slots per key channel of a chunk / per value token):
  codes (planar rows, `quant.packing`)          2 x H b / 8
  key scale+zero per channel per Gk tokens      2 s_b H / Gk
  value scale+zero per token per Gv channels    2 s_b H / Gv
  left factors a_k, a_v (fp16)                  2 x 2 RA
  right factors b_k, b_v per chunk (fp16)       2 x 2 H r_g / n_b
  key outliers (fp16 value + uint8 index)       3 NK H / n_b
  value outliers                                3 NV
The exact buffer (n_b tokens), the prefill factor bp (H r_p per head) and the lengths do
not grow with the context and are excluded, as in KIVI's accounting. This is the honest
count (indices and factors included); `size.kv_size` gives it next to the paper's Table 9
convention.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvlowrank.methods.gear import outliers
from kvlowrank.methods.gear.backbone import make_backbone
from kvlowrank.methods.gear.spec import GearSpec
from kvlowrank.methods.registry import Method, register_method
from kvlowrank_kernels.quant import packing


def _validate(spec, gspec: GearSpec) -> None:
  gspec.check_model(spec.head_dim, where="config.gear")


def bytes_per_head_token(head_dim: int, gspec: GearSpec) -> float:
  """The module docstring's sum for one layer and KV head."""
  h, nb = head_dim, gspec.buffer
  bb = make_backbone(gspec, h)
  sb = jnp.dtype(gspec.scale_dtype).itemsize
  codes = (packing.packed_bytes(h, bb.bits, packing.plane_width(h, bb.bits))
           + packing.packed_bytes(h, bb.bits, packing.plane_width(h, bb.bits, bb.value_group)))
  scales = 2 * sb * h / bb.key_group + 2 * sb * h / bb.value_group
  ra = max(gspec.rank_prefill, gspec.rank_chunk)
  factors = 2 * 2 * ra + 2 * 2 * h * gspec.rank_chunk / nb
  nk = sum(outliers.counts(gspec.sparsity, nb))
  nv = sum(outliers.counts(gspec.sparsity, h))
  sparse = 3 * nk * h / nb + 3 * nv
  return codes + scales + factors + sparse


def _kv_bytes(spec, gspec: GearSpec, params, cache_dtype) -> float:
  del params, cache_dtype
  return float(spec.n_layers * spec.n_kv_heads * bytes_per_head_token(spec.head_dim, gspec))


def _bits(gspec: GearSpec, cache_dtype) -> str:
  """e.g. "2 s2% r4/2" (GEAR), "2 r4/2" (GEAR-L), "2 s2%" (outlier-only), "4kcvt ..."."""
  del cache_dtype
  label = f"{gspec.bits}" + ("kcvt" if gspec.backbone == "kcvt" else "")
  if gspec.sparsity > 0:
    label += f" s{gspec.sparsity:g}%"
  if gspec.rank_prefill or gspec.rank_chunk:
    label += f" r{gspec.rank_prefill}/{gspec.rank_chunk}"
  return label


GEAR = register_method(Method(name="gear", cache="gear", spec_cls=GearSpec,
                              kv_bytes_per_token=_kv_bytes, validate=_validate, bits=_bits))
