"""The project's one bit-packing scheme: b-bit codes along the last axis, byte-planar.

Every cache and kernel stores codes this way (KIVI's planar rows and warp-fragment words,
Palu's packed latents, XQuant's rows), so that a cache's arrays are its kernel's operands.

Rule, for b in {1, 2, 4, 8} and a plane width CW (a power of two, 1 by default):
ppb = 8 // b codes share a byte. The row of n codes is cut into segments of ppb * CW
codes; segment s occupies bytes [s CW, (s + 1) CW), and byte s CW + w holds, at bits
[k b, (k + 1) b) (LSB first), the code of
    c = s ppb CW + k CW + w.
With CW = 1 a byte holds ppb adjacent codes (code c in byte c // ppb at bits b (c % ppb));
read as little-endian uint32 words (`as_words`) that is the LSB-first "32 / b codes per
word" layout of KIVI's own code. A plane width CW > 1 makes `(byte >> k b) & mask` of a
[T, CW] byte tile one contiguous chunk of CW channels (KIVI's Triton kernel unpacks a
plane with one shift and mask, no shuffles).
b = 3 is two planes, concatenated along the last axis: the low 2 bits of every code
packed as 2-bit codes, then the high bit as 1-bit codes (each with the same CW).

Rows are zero-padded to `row_block(b, CW)` codes (a whole number of uint32 words, and of
segments), so a row takes `packed_bytes(n, b, CW)` bytes: b n / 8 when n is a multiple of
the block. The padding is real storage and every `nbytes()` counts it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (2, 3, 4, 8)     # what the caches quantize to
PACK_BITS = (1, 2, 3, 4, 8)       # what this module packs (1: the high plane of 3-bit codes)
MAX_PLANE_WIDTH = 32


def check_bits(bits, field: str = "bits", allowed=SUPPORTED_BITS) -> int:
  """Returns bits as int or raises ValueError naming `field`."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in allowed:
    raise ValueError(f"{field} must be one of {tuple(allowed)}, got {bits!r}")
  return int(bits)


def _check_cw(cw: int) -> int:
  if cw < 1 or cw > MAX_PLANE_WIDTH or cw & (cw - 1):
    raise ValueError(f"plane width must be a power of two in [1, {MAX_PLANE_WIDTH}], got {cw}")
  return int(cw)


def row_block(bits: int, cw: int = 1) -> int:
  """Codes per padding block: a whole number of uint32 words and of CW-wide segments."""
  bits = check_bits(bits, allowed=PACK_BITS)
  cw = _check_cw(cw)
  if bits == 3:
    return max(32, 8 * cw)            # the 1-bit plane: 32 codes per word, 8 CW per segment
  return max(32 // bits, (8 // bits) * cw)


def block_shape(bits: int) -> tuple[int, int]:
  """(codes, uint32 words) of one padding block at plane width 1."""
  n = row_block(bits)
  return n, n * bits // 32


def padded_length(n: int, bits: int, cw: int = 1) -> int:
  blk = row_block(bits, cw)
  return -(-int(n) // blk) * blk


def packed_bytes(n: int, bits: int, cw: int = 1) -> int:
  """Bytes of one packed row of n codes (with its padding)."""
  return padded_length(n, bits, cw) * int(bits) // 8


def packed_words(n: int, bits: int, cw: int = 1) -> int:
  """uint32 words of one packed row of n codes."""
  return packed_bytes(n, bits, cw) // 4


def plane_width(n: int, bits: int, group=None) -> int:
  """The widest plane width that needs no padding: the largest power of two <= 32 that
  divides n / ppb (and `group`, so that a plane lies in one quantization group). 3-bit
  rows use the 1-bit plane's ppb = 8."""
  bits = check_bits(bits, allowed=PACK_BITS)
  ppb = 8 if bits == 3 else 8 // bits
  if n % ppb:
    raise ValueError(f"a row of {n} codes is not a multiple of {ppb} ({bits}-bit codes)")
  m = n // ppb
  if group is not None:
    a, b = m, int(group)
    while b:
      a, b = b, a % b
    m = a
  cw = 1
  while cw < MAX_PLANE_WIDTH and m % (2 * cw) == 0:
    cw *= 2
  return cw


def _pack_pow2(c, bits, cw):
  """uint8 codes [..., n] (n a multiple of ppb * cw) -> uint8 [..., n * bits / 8]."""
  ppb = 8 // bits
  n = c.shape[-1]
  c = c.reshape(*c.shape[:-1], n // (ppb * cw), ppb, cw)
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
  # Disjoint bit fields: the sum is the bitwise OR.
  return jnp.sum(c << shifts, axis=-2, dtype=jnp.uint8).reshape(*c.shape[:-3], n * bits // 8)


def _unpack_pow2(packed, bits, cw):
  """uint8 [..., nb] -> uint8 codes [..., nb * 8 / bits]."""
  ppb = 8 // bits
  nb = packed.shape[-1]
  x = packed.reshape(*packed.shape[:-1], nb // cw, 1, cw)
  shifts = (jnp.arange(ppb, dtype=jnp.uint8) * bits).astype(jnp.uint8)[:, None]
  c = (x >> shifts) & jnp.uint8((1 << bits) - 1)
  return c.reshape(*packed.shape[:-1], nb * ppb)


@functools.partial(jax.jit, static_argnames=("bits", "cw"))
def pack(codes, bits: int, cw: int = 1):
  """Packs integer codes in [0, 2^bits) along the last axis (module rule).

  Args:
    codes: [..., n] integer array (any int dtype).
    bits: 1, 2, 3, 4 or 8.
    cw: plane width (power of two <= 32).
  Returns:
    uint8 [..., packed_bytes(n, bits, cw)].
  """
  bits = check_bits(bits, allowed=PACK_BITS)
  n = codes.shape[-1]
  n_pad = padded_length(n, bits, cw)
  c = codes.astype(jnp.uint8) & jnp.uint8((1 << bits) - 1)
  if n_pad != n:
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, n_pad - n)])
  if bits == 3:
    return jnp.concatenate([_pack_pow2(c & 3, 2, cw), _pack_pow2(c >> 2, 1, cw)], axis=-1)
  return _pack_pow2(c, bits, cw)


@functools.partial(jax.jit, static_argnames=("bits", "n", "cw"))
def unpack(packed, bits: int, n: int, cw: int = 1):
  """Inverse of `pack`: uint8 [..., packed_bytes(n, bits, cw)] -> int32 codes [..., n]."""
  bits = check_bits(bits, allowed=PACK_BITS)
  n_pad = padded_length(n, bits, cw)
  if packed.shape[-1] != n_pad * bits // 8:
    raise ValueError(f"unpack: rows of {packed.shape[-1]} bytes do not hold {n} codes of "
                     f"{bits} bits (plane width {cw}): expected {n_pad * bits // 8}")
  if bits == 3:
    lo = _unpack_pow2(packed[..., :n_pad // 4], 2, cw)
    hi = _unpack_pow2(packed[..., n_pad // 4:], 1, cw)
    c = lo | (hi << 2)
  else:
    c = _unpack_pow2(packed, bits, cw)
  return c[..., :n].astype(jnp.int32)


def as_words(packed):
  """uint8 [..., 4 W] -> uint32 [..., W] (little-endian: byte 4 i + j is bits 8 j of word i)."""
  if packed.shape[-1] % 4:
    raise ValueError(f"as_words: {packed.shape[-1]} bytes is not a whole number of words")
  x = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4).astype(jnp.uint32)
  return x[..., 0] | (x[..., 1] << 8) | (x[..., 2] << 16) | (x[..., 3] << 24)


def as_bytes(words):
  """Inverse of `as_words`: uint32 [..., W] -> uint8 [..., 4 W]."""
  w = words.astype(jnp.uint32)
  parts = [((w >> (8 * j)) & 0xFF).astype(jnp.uint8) for j in range(4)]
  return jnp.stack(parts, axis=-1).reshape(*w.shape[:-1], 4 * w.shape[-1])


def pack_words(codes, bits: int, cw: int = 1):
  """`pack` read as uint32 words: [..., n] -> uint32 [..., packed_words(n, bits, cw)]."""
  return as_words(pack(codes, bits, cw))


def unpack_words(words, bits: int, n: int, cw: int = 1):
  """Inverse of `pack_words`."""
  return unpack(as_bytes(words), bits, n, cw)
