"""Dense bit-packing of b-bit integer codes into uint32 words (b in {2, 3, 4, 8}).

Scheme (one rule for every bit width): codes are packed along the LAST axis in
blocks of `cpb = 32 / gcd(b, 32)` codes that fill exactly `wpb = b / gcd(b, 32)`
uint32 words, i.e. the block is a little-endian bit stream of cpb*b = 32*wpb bits:

  code i of a block occupies stream bits [i*b, i*b + b); stream bit s lives in
  word s // 32 at bit s % 32 (LSB first).

  b=2: 16 codes -> 1 word    b=4: 8 codes -> 1 word    b=8: 4 codes -> 1 word
  b=3: 32 codes -> 3 words (codes 10 and 21 straddle a word boundary)

For b in {2, 4, 8} this is exactly KIVI's LSB-first "32/b values per int32"
layout. A last axis whose length n is not a multiple of cpb is zero-padded to
ceil(n/cpb)*cpb codes, so storage is ceil(n/cpb)*wpb words (`packed_words`);
that padding is real allocated storage and is counted by every `nbytes()`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (2, 3, 4, 8)


def check_bits(bits, field: str = "bits") -> int:
  """Returns bits as int or raises ValueError naming `field`."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or \
      int(bits) not in SUPPORTED_BITS:
    raise ValueError(f"{field} must be one of {SUPPORTED_BITS}, got {bits!r}")
  return int(bits)


def block_shape(bits: int) -> tuple[int, int]:
  """(codes per block, uint32 words per block) of the dense packing for `bits`."""
  bits = check_bits(bits)
  g = math.gcd(bits, 32)
  return 32 // g, bits // g


def packed_words(n: int, bits: int) -> int:
  """Number of uint32 words that hold n codes of `bits` bits (with block padding)."""
  cpb, wpb = block_shape(bits)
  return -(-int(n) // cpb) * wpb


@functools.lru_cache(maxsize=None)
def _tables(bits: int):
  """Static per-block tables: for code i, its low word, bit offset and whether it spills."""
  cpb, wpb = block_shape(bits)
  start = np.arange(cpb) * bits
  lo_word = start // 32
  offset = start % 32
  spills = offset + bits > 32
  hi_word = np.minimum(lo_word + 1, wpb - 1)
  # Shift of code i into word w (positive = left); valid where the code overlaps the word.
  shift = start[:, None] - 32 * np.arange(wpb)[None, :]
  overlaps = (shift > -bits) & (shift < 32)
  return lo_word, offset, spills, hi_word, shift, overlaps


@functools.partial(jax.jit, static_argnames=("bits",))
def pack(codes, bits: int):
  """Packs integer codes in [0, 2^bits) along the last axis.

  Args:
    codes: [..., n] integer array (any int dtype), values in [0, 2^bits).
    bits: 2, 3, 4 or 8.
  Returns:
    uint32 [..., packed_words(n, bits)].
  """
  bits = check_bits(bits)
  cpb, wpb = block_shape(bits)
  n = codes.shape[-1]
  nb = -(-n // cpb)
  c = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
  if nb * cpb != n:
    c = jnp.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, nb * cpb - n)])
  c = c.reshape(c.shape[:-1] + (nb, cpb, 1))
  _, _, _, _, shift, overlaps = _tables(bits)
  left = jnp.asarray(np.clip(shift, 0, 31), jnp.uint32)
  right = jnp.asarray(np.clip(-shift, 0, 31), jnp.uint32)
  parts = jnp.where(jnp.asarray(shift >= 0), c << left, c >> right)
  parts = jnp.where(jnp.asarray(overlaps), parts, jnp.uint32(0))
  # Contributions to one word occupy disjoint bits, so the sum is the bitwise OR.
  words = jnp.sum(parts, axis=-2, dtype=jnp.uint32)  # [..., nb, wpb]
  return words.reshape(words.shape[:-2] + (nb * wpb,))


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack(words, bits: int, n: int):
  """Inverse of `pack`: uint32 [..., W] -> uint32 codes [..., n]."""
  bits = check_bits(bits)
  cpb, wpb = block_shape(bits)
  nb = words.shape[-1] // wpb
  if nb * wpb != words.shape[-1] or nb * cpb < n:
    raise ValueError(f"unpack: {words.shape[-1]} words cannot hold {n} codes of {bits} bits")
  w = words.astype(jnp.uint32).reshape(words.shape[:-1] + (nb, wpb))
  lo_word, offset, spills, hi_word, _, _ = _tables(bits)
  lo = w[..., lo_word] >> jnp.asarray(offset, jnp.uint32)
  hi_shift = jnp.asarray(np.clip(32 - offset, 0, 31), jnp.uint32)
  hi = jnp.where(jnp.asarray(spills), w[..., hi_word] << hi_shift, jnp.uint32(0))
  codes = (lo | hi) & jnp.uint32((1 << bits) - 1)
  return codes.reshape(codes.shape[:-2] + (nb * cpb,))[..., :n]
