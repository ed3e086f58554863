"""Bit packing of 1/2/3/4-bit integer codes along the last axis into uint8 (kernel layout).

Layout (shared by the Palu latent and KIVI kernels):
  bits in {1, 2, 4}: ppb = 8 // bits codes per byte; channel c = w * ppb + k is
    stored in byte w at bits [k * bits, (k + 1) * bits) (LSB first, adjacent
    channels together), so a row of R codes takes R * bits / 8 bytes.
  bits == 3: two bit planes concatenated along the last axis: the low 2 bits of
    every code packed as 2-bit codes (R / 4 bytes), then the high bit packed as
    1-bit codes (R / 8 bytes): 3R / 8 bytes. Planes keep every unpack a
    power-of-two shuffle in the kernel (3 does not divide 8).
R must be a multiple of 8 (16 for the kernels' tiles).
"""

from __future__ import annotations

import jax.numpy as jnp

SUPPORTED_BITS = (1, 2, 3, 4)


def packed_bytes(dim: int, bits: int) -> int:
  """Bytes of one packed row of `dim` codes."""
  if bits not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
  if dim % 8:
    raise ValueError(f"packed dim must be a multiple of 8, got {dim}")
  return dim * bits // 8


def _pack_pow2(codes, bits):
  ppb = 8 // bits
  c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // ppb, ppb)
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)
  # Disjoint bit fields: the sum is the bitwise OR.
  return jnp.sum(c << shifts, axis=-1, dtype=jnp.uint8)


def _unpack_pow2(packed, bits):
  ppb = 8 // bits
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)
  c = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
  return c.reshape(*packed.shape[:-1], packed.shape[-1] * ppb).astype(jnp.int32)


def pack_codes(codes, bits: int):
  """codes [..., R] ints in [0, 2**bits) -> uint8 [..., R * bits / 8]."""
  packed_bytes(codes.shape[-1], bits)
  if bits == 3:
    c = codes.astype(jnp.uint8)
    return jnp.concatenate([_pack_pow2(c & 3, 2), _pack_pow2(c >> 2, 1)], axis=-1)
  return _pack_pow2(codes, bits)


def unpack_codes(packed, bits: int, dim: int):
  """uint8 [..., dim * bits / 8] -> int32 codes [..., dim]."""
  if packed.shape[-1] != packed_bytes(dim, bits):
    raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected "
                     f"{packed_bytes(dim, bits)} for dim={dim}, bits={bits}")
  if bits == 3:
    lo = _unpack_pow2(packed[..., :dim // 4], 2)
    hi = _unpack_pow2(packed[..., dim // 4:], 1)
    return lo | (hi << 2)
  return _unpack_pow2(packed, bits)


def minmax_quantize(x, bits: int, axis, scale_dtype):
  """Asymmetric min/max quantizer over `axis` (int or tuple): x ~= code * scale + zero.

  scale = (max - min) / (2**bits - 1) (1 where max == min), zero = min, both
  rounded to `scale_dtype` first so that dequantization and codes agree.
  Returns:
    (codes int32 like x, scale, zero) with `axis` kept as size-1 dims.
  """
  xf = x.astype(jnp.float32)
  lo = jnp.min(xf, axis=axis, keepdims=True)
  hi = jnp.max(xf, axis=axis, keepdims=True)
  levels = (1 << bits) - 1
  scale = jnp.where(hi > lo, (hi - lo) / levels, 1.0).astype(scale_dtype)
  zero = lo.astype(scale_dtype)
  sf, zf = scale.astype(jnp.float32), zero.astype(jnp.float32)
  codes = jnp.clip(jnp.round((xf - zf) / sf), 0, levels).astype(jnp.int32)
  return codes, scale, zero
