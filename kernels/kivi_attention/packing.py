"""KIVI-quantized K/V in the kernel's layout (head-major, so a tile of one KV head is contiguous).

Keys (post-RoPE) are quantized per channel over groups of G consecutive tokens,
values per token over groups of Gv consecutive channels (KIVI §3, asymmetric
min/max, x ~= code * scale + zero with zero = min):
  KiviKeys:   codes uint8 [B, K, S, H * bits / 8], scale/zero [B, K, S / G, H]
  KiviValues: codes uint8 [B, K, S, H * bits / 8], scale/zero [B, K, S, H / Gv]
Codes use the `latent_attention.bitpack` layout (LSB-first, adjacent channels).
The capacity S must be a multiple of G. Tokens beyond a sequence's quantized
length are ignored; the recent tokens live in a full-precision window.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..latent_attention import bitpack


def _static():
  return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviKeys:
  """Per-channel quantized keys (see module docstring)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = _static()
  group: int = _static()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviValues:
  """Per-token quantized values (see module docstring)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = _static()
  group: int = _static()


def _default_scale_dtype(x):
  return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def quantize_keys(k, bits: int, group: int, scale_dtype=None) -> KiviKeys:
  """k [B, S, K, H] -> KiviKeys (per channel over groups of `group` tokens)."""
  b, s, kh, h = k.shape
  if s % group:
    raise ValueError(f"key capacity ({s}) must be a multiple of the key group ({group})")
  x = jnp.transpose(k, (0, 2, 1, 3)).reshape(b, kh, s // group, group, h)
  codes, scale, zero = bitpack.minmax_quantize(x, bits, axis=3,
                                               scale_dtype=scale_dtype or _default_scale_dtype(k))
  codes = bitpack.pack_codes(codes.reshape(b, kh, s, h), bits)
  return KiviKeys(codes=codes, scale=scale[:, :, :, 0], zero=zero[:, :, :, 0], bits=bits,
                  group=group)


def quantize_values(v, bits: int, group: int, scale_dtype=None) -> KiviValues:
  """v [B, S, K, H] -> KiviValues (per token over groups of `group` channels)."""
  b, s, kh, h = v.shape
  if h % group:
    raise ValueError(f"value head dim ({h}) must be a multiple of the value group ({group})")
  x = jnp.transpose(v, (0, 2, 1, 3)).reshape(b, kh, s, h // group, group)
  codes, scale, zero = bitpack.minmax_quantize(x, bits, axis=4,
                                               scale_dtype=scale_dtype or _default_scale_dtype(v))
  codes = bitpack.pack_codes(codes.reshape(b, kh, s, h), bits)
  return KiviValues(codes=codes, scale=scale[..., 0], zero=zero[..., 0], bits=bits, group=group)


def dequantize_keys(kq: KiviKeys, head_dim: int):
  """float32 [B, S, K, H]."""
  c = bitpack.unpack_codes(kq.codes, kq.bits, head_dim).astype(jnp.float32)
  b, kh, s, h = c.shape
  c = c.reshape(b, kh, s // kq.group, kq.group, h)
  x = c * kq.scale.astype(jnp.float32)[:, :, :, None] + kq.zero.astype(jnp.float32)[:, :, :, None]
  return jnp.transpose(x.reshape(b, kh, s, h), (0, 2, 1, 3))


def dequantize_values(vq: KiviValues, head_dim: int):
  """float32 [B, S, K, H]."""
  c = bitpack.unpack_codes(vq.codes, vq.bits, head_dim).astype(jnp.float32)
  b, kh, s, h = c.shape
  c = c.reshape(b, kh, s, h // vq.group, vq.group)
  x = c * vq.scale.astype(jnp.float32)[..., None] + vq.zero.astype(jnp.float32)[..., None]
  return jnp.transpose(x.reshape(b, kh, s, h), (0, 2, 1, 3))
