"""KIVI (Liu et al., ICML'24) as an evaluable method: kvlowrank.methods.kivi.cache, no calibration.

KV bytes per token (asymptotic, per layer and KV head, H = head dim, G = group size,
s = bytes of a scale/zero): keys and values as packed codes (`quant.packing` rows at the
store's plane width: H b / 8 bytes when H fills whole rows), plus keys' per-channel (scale, zero) shared by G
tokens, 2 s H / G, plus values' per-token (scale, zero) per G channels, 2 s H / G. The
exact residual window (R tokens at the cache dtype) does not grow with the context and
is excluded, as in KIVI's and the Palu paper's compression ratios.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvlowrank.methods.kivi.cache import KiviSpec
from kvlowrank.methods.registry import Method, register_method
from kvlowrank_kernels.quant import packing


def _validate(spec, kspec: KiviSpec) -> None:
  if spec.head_dim % kspec.group_size:
    raise ValueError(f"config.kivi.group_size ({kspec.group_size}) must divide the model's "
                     f"head_dim ({spec.head_dim}): values are quantized per token in groups "
                     "of group_size channels")
  kspec.store_layout(spec.head_dim)   # layout="warp" where it does not apply
  for field, bits in (("bits", kspec.bits), ("v_bits", kspec.value_bits)):
    ppb = 8 if bits == 3 else 8 // bits
    if spec.head_dim % ppb:
      raise ValueError(f"config.kivi.{field}={bits}: the model's head_dim ({spec.head_dim}) "
                       f"must be a multiple of {ppb} to pack {bits}-bit codes")


def _kv_bytes(spec, kspec: KiviSpec, params, cache_dtype) -> float:
  del params, cache_dtype  # scales/zeros use kspec.scale_dtype, not the cache dtype
  h, g = spec.head_dim, kspec.group_size
  s = jnp.dtype(kspec.scale_dtype).itemsize
  codes = (packing.packed_bytes(h, kspec.bits, packing.plane_width(h, kspec.bits))
           + packing.packed_bytes(h, kspec.value_bits,
                                  packing.plane_width(h, kspec.value_bits, g)))
  per_head = codes + 2 * s * h / g + 2 * s * h / g
  return float(spec.n_layers * spec.n_kv_heads * per_head)


def _bits(kspec: KiviSpec, cache_dtype) -> str:
  del cache_dtype
  if kspec.value_bits == kspec.bits:
    return str(kspec.bits)
  return f"K{kspec.bits}V{kspec.value_bits}"


KIVI = register_method(Method(name="kivi", cache="kivi", spec_cls=KiviSpec,
                              kv_bytes_per_token=_kv_bytes, validate=_validate, bits=_bits))
