"""KIVI-quantized K/V in the planar layout (head-major: a tile of one KV head is contiguous).

Keys (post-RoPE) are quantized per channel over groups of G consecutive tokens,
values per token over groups of Gv consecutive channels (KIVI §3), both by the project's
one quantizer (`quant.quantizer.quantize_codes`: asymmetric min/max, x ~= code * scale +
zero with zero = min; a constant group stores scale 0 and codes 0, so it dequantizes to
its zero):
  KiviKeys:   codes uint8 [B, K, S, R], scale/zero [B, K, S / G, H]
  KiviValues: codes uint8 [B, K, S, R], scale/zero [B, K, S, H / Gv]
with R = `packing.packed_bytes(H, bits, CW)` bytes per row (H * bits / 8, see below);
the head dim H is read from the scales' shape.
bits in `BITS` (2, 3, 4, 8; the Triton kernel reads 2 and 4). The capacity S must be a
multiple of G (and of VALUE_BLOCK for values). Tokens beyond a sequence's quantized length
are ignored; the recent tokens live in a full-precision window.

Planar code layout: one token's row of H codes is packed by the one packing module
(`quant.packing.pack`) with the plane width CW = `packing.plane_width(H, bits, Gv)` (the
largest power of two <= 32 that divides H / ppb; for values it also divides Gv). For
bits in {2, 4, 8}: ppb = 8 // bits codes per byte; the row is cut into H / (ppb * CW)
segments of ppb * CW channels; segment s takes bytes [s * CW, (s + 1) * CW), and byte
s * CW + w holds, at bits [k * bits, (k + 1) * bits) (LSB first), the code of channel
    c = s * ppb * CW + k * CW + w.
  Example, bits = 2, H = 16, CW = 2 (ppb = 4, two segments of 2 bytes): byte 0 =
  c0 | c2 << 2 | c4 << 4 | c6 << 6, byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6.
  Why: `(bytes >> (k * bits)) & mask` of a [T, CW] byte tile is directly the
  contiguous channel chunk [s * ppb * CW + k * CW, + CW) of T tokens (a plane),
  so a kernel unpacks with one shift and mask per plane and no shuffles; with
  CW | Gv a value plane lies in one channel group (one scale per token).
3-bit rows are two such rows side by side (the low 2 bits of every code, then the high
bit as 1-bit codes; `packing`). A row takes H * bits / 8 bytes where
`packing.row_block(bits, CW)` divides H (H = 64 and 128 at every bit width); the packing
module zero-pads the rows of smaller head dims (e.g. H = 16 at 3 bits), which the kernels'
plans refuse (they read rows of exactly H * bits / 8 bytes).
Token order: key rows are stored token after token ([B, K, S, R]). Value rows are
  token-blocked: the codes array has the same shape [B, K, S, R], but its memory, read as
  [B, K, S / VALUE_BLOCK, R, VALUE_BLOCK], holds byte r of token i * VALUE_BLOCK + u at
  [.., i, r, u] (each block of VALUE_BLOCK tokens stored byte-column by byte-column). Why:
  the value product contracts over tokens, so in a kernel's value tile [channels, tokens]
  the tokens are the MMA's K dimension, which must be contiguous per register; token-major
  rows would need a byte gather per register. S must be a multiple of VALUE_BLOCK for
  values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..quant import packing
from ..quant.quantizer import dequantize_codes, quantize_codes

BITS = packing.SUPPORTED_BITS  # what the quantizer makes: 2, 3, 4, 8
VALUE_BLOCK = 32  # tokens per transposed block of value codes


def _static():
  return dataclasses.field(metadata=dict(static=True))


def plane_width(head_dim: int, bits: int, group=None) -> int:
  """CW of a row of `head_dim` codes (`packing.plane_width`).

  Args:
    head_dim: channels H per row.
    bits: code width (2, 3, 4 or 8).
    group: value channel group Gv (None for keys).
  Returns:
    CW >= 1.
  """
  bits = packing.check_bits(bits, "KIVI codes: bits", BITS)
  return packing.plane_width(head_dim, bits, group)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviKeys:
  """Per-channel quantized keys (see module docstring)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = _static()
  group: int = _static()

  @property
  def head_dim(self) -> int:
    """H (the scales' last dim)."""
    return self.scale.shape[-1]

  @property
  def plane_width(self) -> int:
    """CW of the planar code layout."""
    return plane_width(self.head_dim, self.bits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviValues:
  """Per-token quantized values (see module docstring)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = _static()
  group: int = _static()

  @property
  def head_dim(self) -> int:
    """H (the scales' last dim times the value group)."""
    return self.scale.shape[-1] * self.group

  @property
  def plane_width(self) -> int:
    """CW of the planar code layout (divides the value group)."""
    return plane_width(self.head_dim, self.bits, self.group)


def block_tokens(rows):
  """[..., S, R] token-major rows -> value order (blocks of VALUE_BLOCK tokens, transposed)."""
  *lead, s, r = rows.shape
  if s % VALUE_BLOCK:
    raise ValueError(f"value capacity ({s}) must be a multiple of {VALUE_BLOCK}")
  x = rows.reshape(*lead, s // VALUE_BLOCK, VALUE_BLOCK, r)
  return jnp.swapaxes(x, -1, -2).reshape(*lead, s, r)


def unblock_tokens(codes):
  """Inverse of `block_tokens`."""
  *lead, s, r = codes.shape
  if s % VALUE_BLOCK:
    raise ValueError(f"value capacity ({s}) must be a multiple of {VALUE_BLOCK}")
  x = codes.reshape(*lead, s // VALUE_BLOCK, r, VALUE_BLOCK)
  return jnp.swapaxes(x, -1, -2).reshape(*lead, s, r)


def _scale_dtype(x, scale_dtype):
  """The requested scale dtype, or by default x's if 16-bit, else float32."""
  if scale_dtype is not None:
    return scale_dtype
  return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def quantize_keys(k, bits: int, group: int, scale_dtype=None) -> KiviKeys:
  """k [B, S, K, H] -> KiviKeys (per channel over groups of `group` tokens)."""
  s, h = k.shape[1], k.shape[3]
  if group < 1 or s % group:
    raise ValueError(f"key capacity ({s}) must be a multiple of the key group ({group})")
  cw = plane_width(h, bits)
  codes, scale, zero = quantize_codes(k, bits=bits, axis=1, group_size=group,
                                      scale_dtype=_scale_dtype(k, scale_dtype))
  head_major = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  return KiviKeys(codes=packing.pack(head_major(codes), bits, cw), scale=head_major(scale),
                  zero=head_major(zero), bits=bits, group=group)


def quantize_values(v, bits: int, group: int, scale_dtype=None) -> KiviValues:
  """v [B, S, K, H] -> KiviValues (per token over groups of `group` channels)."""
  s, h = v.shape[1], v.shape[3]
  if group < 1 or h % group:
    raise ValueError(f"value head dim ({h}) must be a multiple of the value group ({group})")
  if s % VALUE_BLOCK:
    raise ValueError(f"value capacity ({s}) must be a multiple of {VALUE_BLOCK}")
  cw = plane_width(h, bits, group)
  codes, scale, zero = quantize_codes(v, bits=bits, axis=3, group_size=group,
                                      scale_dtype=_scale_dtype(v, scale_dtype))
  head_major = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  return KiviValues(codes=block_tokens(packing.pack(head_major(codes), bits, cw)),
                    scale=head_major(scale), zero=head_major(zero), bits=bits, group=group)


def _check_head_dim(q, head_dim, what):
  if q.head_dim != head_dim:
    raise ValueError(f"{what}.scale holds {q.head_dim} channels, expected head_dim={head_dim}")
  row = packing.packed_bytes(head_dim, q.bits, q.plane_width)
  if q.codes.shape[-1] != row:
    raise ValueError(f"{what}.codes rows have {q.codes.shape[-1]} bytes, expected {row} "
                     f"({head_dim} channels at {q.bits} bits)")


def key_codes(kq: KiviKeys):
  """int32 codes [B, K, S, H] of planar keys."""
  return packing.unpack(kq.codes, kq.bits, kq.head_dim, kq.plane_width)


def value_codes(vq: KiviValues):
  """int32 codes [B, K, S, H] (token-major) of planar values."""
  return packing.unpack(unblock_tokens(vq.codes), vq.bits, vq.head_dim, vq.plane_width)


def dequantize_keys(kq: KiviKeys, head_dim: int):
  """float32 [B, S, K, H]."""
  _check_head_dim(kq, head_dim, "keys")
  x = dequantize_codes(key_codes(kq), kq.scale, kq.zero, axis=2, group_size=kq.group)
  return jnp.transpose(x, (0, 2, 1, 3))


def dequantize_values(vq: KiviValues, head_dim: int):
  """float32 [B, S, K, H]."""
  _check_head_dim(vq, head_dim, "values")
  x = dequantize_codes(value_codes(vq), vq.scale, vq.zero, axis=3, group_size=vq.group)
  return jnp.transpose(x, (0, 2, 1, 3))
