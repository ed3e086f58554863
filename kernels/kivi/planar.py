"""KIVI-quantized K/V in the kernel's layout (head-major, so a tile of one KV head is contiguous).

Keys (post-RoPE) are quantized per channel over groups of G consecutive tokens,
values per token over groups of Gv consecutive channels (KIVI §3, asymmetric
min/max, x ~= code * scale + zero with zero = min):
  KiviKeys:   codes uint8 [B, K, S, H * bits / 8], scale/zero [B, K, S / G, H]
  KiviValues: codes uint8 [B, K, S, H * bits / 8], scale/zero [B, K, S, H / Gv]
The capacity S must be a multiple of G (and of VALUE_BLOCK for values). Tokens
beyond a sequence's quantized length are ignored; the recent tokens live in a
full-precision window.

Planar code layout (one token's row of H channels, bits in {1, 2, 4}):
  ppb = 8 // bits codes per byte and a chunk ("plane") width CW
  (`plane_width`: the largest power of two <= 32 dividing H / ppb, and for
  values also Gv). The row is cut into H / (ppb * CW) segments of ppb * CW
  channels; segment s takes bytes [s * CW, (s + 1) * CW), and byte s * CW + w
  holds, at bits [k * bits, (k + 1) * bits) (LSB first), the code of channel
    c = s * ppb * CW + k * CW + w.
  Example, bits = 2, H = 8, CW = 2 (ppb = 4, one segment of 2 bytes): byte 0 =
  c0 | c2 << 2 | c4 << 4 | c6 << 6, byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6.
  Why: `(bytes >> (k * bits)) & mask` of a [T, CW] byte tile is directly the
  contiguous channel chunk [s * ppb * CW + k * CW, + CW) of T tokens (a plane),
  so a kernel unpacks with one shift and mask per plane and no shuffles; with
  CW | Gv a value plane lies in one channel group (one scale per token).
Token order: key rows are stored token after token ([B, K, S, R], R = H * bits
  / 8 bytes). Value rows are token-blocked: the codes array has the same shape
  [B, K, S, R], but its memory, read as [B, K, S / VALUE_BLOCK, R, VALUE_BLOCK],
  holds byte r of token i * VALUE_BLOCK + u at [.., i, r, u] (each block of
  VALUE_BLOCK tokens stored byte-column by byte-column). Why: the value product
  contracts over tokens, so in a kernel's value tile [channels, tokens] the
  tokens are the MMA's K dimension, which must be contiguous per register;
  token-major rows would need a byte gather per register. S must be a multiple
  of VALUE_BLOCK for values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..palu import bitpack

PLANAR_BITS = (1, 2, 4)
MAX_PLANE_WIDTH = 32
VALUE_BLOCK = 32  # tokens per transposed block of value codes


def _static():
  return dataclasses.field(metadata=dict(static=True))


def plane_width(head_dim: int, bits: int, group=None) -> int:
  """CW of the planar layout: largest power of two <= 32 dividing H / ppb (and `group`).

  Args:
    head_dim: channels H per row.
    bits: code width (1, 2 or 4).
    group: value channel group Gv (None for keys).
  Returns:
    CW >= 1.
  """
  if bits not in PLANAR_BITS:
    raise ValueError(f"KIVI codes: bits must be one of {PLANAR_BITS}, got {bits}")
  ppb = 8 // bits
  if head_dim % ppb:
    raise ValueError(f"KIVI codes: head dim ({head_dim}) must be a multiple of {ppb} "
                     f"for {bits}-bit codes")
  n = head_dim // ppb
  if group is not None:
    n = _gcd(n, group)
  cw = 1
  while cw < MAX_PLANE_WIDTH and n % (2 * cw) == 0:
    cw *= 2
  return cw


def _gcd(a: int, b: int) -> int:
  while b:
    a, b = b, a % b
  return a


def _head_dim(codes, bits):
  return codes.shape[-1] * 8 // bits


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
    return _head_dim(self.codes, self.bits)

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
    return _head_dim(self.codes, self.bits)

  @property
  def plane_width(self) -> int:
    """CW of the planar code layout (divides the value group)."""
    return plane_width(self.head_dim, self.bits, self.group)


def pack_planar(codes, bits: int, cw: int):
  """codes [..., H] ints in [0, 2**bits) -> uint8 [..., H * bits / 8] (planar layout)."""
  h = codes.shape[-1]
  ppb = 8 // bits
  if h % (ppb * cw):
    raise ValueError(f"head dim ({h}) must be a multiple of {ppb} * plane width ({cw})")
  c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], h // (ppb * cw), ppb, cw)
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
  # Disjoint bit fields: the sum is the bitwise OR.
  packed = jnp.sum(c << shifts, axis=-2, dtype=jnp.uint8)
  return packed.reshape(*codes.shape[:-1], h * bits // 8)


def unpack_planar(packed, bits: int, cw: int):
  """uint8 [..., H * bits / 8] (planar layout) -> int32 codes [..., H]."""
  nb = packed.shape[-1]
  if nb % cw:
    raise ValueError(f"packed rows have {nb} bytes, not a multiple of the plane width {cw}")
  ppb = 8 // bits
  x = packed.reshape(*packed.shape[:-1], nb // cw, 1, cw)
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
  c = (x >> shifts) & jnp.uint8((1 << bits) - 1)
  return c.reshape(*packed.shape[:-1], nb * ppb).astype(jnp.int32)


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


def _default_scale_dtype(x):
  return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def quantize_keys(k, bits: int, group: int, scale_dtype=None) -> KiviKeys:
  """k [B, S, K, H] -> KiviKeys (per channel over groups of `group` tokens)."""
  b, s, kh, h = k.shape
  if group < 1 or s % group:
    raise ValueError(f"key capacity ({s}) must be a multiple of the key group ({group})")
  cw = plane_width(h, bits)
  x = jnp.transpose(k, (0, 2, 1, 3)).reshape(b, kh, s // group, group, h)
  codes, scale, zero = bitpack.minmax_quantize(x, bits, axis=3,
                                               scale_dtype=scale_dtype or _default_scale_dtype(k))
  codes = pack_planar(codes.reshape(b, kh, s, h), bits, cw)
  return KiviKeys(codes=codes, scale=scale[:, :, :, 0], zero=zero[:, :, :, 0], bits=bits,
                  group=group)


def quantize_values(v, bits: int, group: int, scale_dtype=None) -> KiviValues:
  """v [B, S, K, H] -> KiviValues (per token over groups of `group` channels)."""
  b, s, kh, h = v.shape
  if group < 1 or h % group:
    raise ValueError(f"value head dim ({h}) must be a multiple of the value group ({group})")
  if s % VALUE_BLOCK:
    raise ValueError(f"value capacity ({s}) must be a multiple of {VALUE_BLOCK}")
  cw = plane_width(h, bits, group)
  x = jnp.transpose(v, (0, 2, 1, 3)).reshape(b, kh, s, h // group, group)
  codes, scale, zero = bitpack.minmax_quantize(x, bits, axis=4,
                                               scale_dtype=scale_dtype or _default_scale_dtype(v))
  codes = block_tokens(pack_planar(codes.reshape(b, kh, s, h), bits, cw))
  return KiviValues(codes=codes, scale=scale[..., 0], zero=zero[..., 0], bits=bits, group=group)


def _check_head_dim(q, head_dim, what):
  if q.head_dim != head_dim:
    raise ValueError(f"{what}.codes rows hold {q.head_dim} channels at {q.bits} bits, "
                     f"expected head_dim={head_dim}")


def dequantize_keys(kq: KiviKeys, head_dim: int):
  """float32 [B, S, K, H]."""
  _check_head_dim(kq, head_dim, "keys")
  c = unpack_planar(kq.codes, kq.bits, kq.plane_width).astype(jnp.float32)
  b, kh, s, h = c.shape
  c = c.reshape(b, kh, s // kq.group, kq.group, h)
  x = c * kq.scale.astype(jnp.float32)[:, :, :, None] + kq.zero.astype(jnp.float32)[:, :, :, None]
  return jnp.transpose(x.reshape(b, kh, s, h), (0, 2, 1, 3))


def dequantize_values(vq: KiviValues, head_dim: int):
  """float32 [B, S, K, H]."""
  _check_head_dim(vq, head_dim, "values")
  c = unpack_planar(unblock_tokens(vq.codes), vq.bits, vq.plane_width).astype(jnp.float32)
  b, kh, s, h = c.shape
  c = c.reshape(b, kh, s, h // vq.group, vq.group)
  x = c * vq.scale.astype(jnp.float32)[..., None] + vq.zero.astype(jnp.float32)[..., None]
  return jnp.transpose(x.reshape(b, kh, s, h), (0, 2, 1, 3))
