"""Append-only quantized token store for XQuant: rows of a [B, S, C] activation.

One store holds one cached activation per layer (X, X·U_k, X·U_v or a cross-layer
delta). Rows are written at slot = position and quantized with the project's one
quantizer, `kvlowrank_kernels.quant` (uniform asymmetric min/max, XQuant §2 / KIVI), in
one of two layouts that share the code layout, so one dequant-matmul kernel reads both:

  codes  [B, S, words(C)] uint32, packed along the channel axis (kvlowrank_kernels.quant.packing)
  axis="token"   (per-token):   scale/zero [B, S, C/gc]   one pair per gc channels
  axis="channel" (per-channel): scale/zero [B, S/gs, C]   one pair per gs tokens

Exact tail (KIVI's residual, XQuant §4.2 "we leave the final residual tokens
unquantized (up to group size tokens)"): with flush block F > 0 the positions
[floor(L/F)·F, L) are kept exact in a ring `tail` [B, F, C] (slot = position mod F)
and quantized all at once when the block of F completes. Per-channel stores need
F >= 1 (a token group can only be quantized once complete; F is a multiple of gs);
per-token stores use F = window (0: every row is quantized on arrival).

With bits=None the store keeps exact rows (`raw` [B, S, C] at the cache dtype): the
unquantized oracle used by the exactness tests.

Rows must be appended in order per batch row (new positions continue lens[b]);
padding positions (< 0) and positions >= capacity are dropped. Prefill (T > 1) and
decode (T = 1) run the same code, so both modes store identical codes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base
from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import canonical_scale_dtype, dequantize_codes, quantize_codes
from kvlowrank_kernels.xquant.reference import PackedRows

AXES = ("token", "channel")


_rows = base.gather_rows


def _scatter_rows(buf, idx, ok, vals):
  """buf[b, idx[b, m]] = vals[b, m] where ok; masked writes are dropped."""
  idx = jnp.where(ok, idx, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(vals.astype(buf.dtype),
                                                             mode="drop")


def resolve_group(group_size: int, width: int, axis: str, field: str) -> int:
  """Channels per group (per-token: clamped to the width, must divide it) or tokens per
  group (per-channel). Raises ValueError naming `field`."""
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size <= 0:
    raise ValueError(f"{field} must be a positive int, got {group_size!r}")
  if axis == "channel":
    return int(group_size)
  g = min(int(group_size), int(width))  # a group never spans two tokens
  if width % g:
    raise ValueError(f"{field} ({group_size}) must divide the quantized width ({width}) for "
                     f"per-token groups; pick a divisor of {width}")
  return g


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenStore:
  """Quantized (or exact, bits=None) rows of one cached activation; see module doc."""

  codes: Optional[jax.Array]   # [B, S, words(C)] uint32 (None when bits is None)
  scale: Optional[jax.Array]   # [B, S, C/gc] or [B, S/gs, C]
  zero: Optional[jax.Array]
  tail: Optional[jax.Array]    # [B, F, C] exact ring (None when F == 0)
  raw: Optional[jax.Array]     # [B, S, C] exact rows (bits None only)
  lens: jax.Array              # [B] int32
  width: int = base.static_field(default=0)
  bits: Optional[int] = base.static_field(default=None)
  axis: str = base.static_field(default="token")
  group: int = base.static_field(default=128)   # gc (token axis) or gs (channel axis)
  flush: int = base.static_field(default=0)     # F
  cap: int = base.static_field(default=0)       # requested capacity (<= allocated rows)

  @classmethod
  def init(cls, *, batch: int, capacity: int, width: int, bits: Optional[int], axis: str,
           group_size: int, window: int = 0, dtype=jnp.bfloat16, scale_dtype="float16",
           field: str = "XQuantSpec"):
    """Allocates an empty store.

    Args:
      batch, capacity: B and the number of positions S.
      width: C, channels per row.
      bits: 2/3/4/8, or None for exact storage.
      axis: "token" (groups of channels within a row) or "channel" (groups of tokens).
      group_size: channels (token axis, clamped to C) or tokens (channel axis) per group.
      window: exact tail length F for per-token stores (0: none). Per-channel stores
        use F = max(window, group) rounded up to a multiple of the token group.
      dtype: dtype of exact rows (tail / raw).
      scale_dtype: dtype of scales and zero points (fp16 as in KIVI / the paper).
      field: config name prefix for error messages.
    Returns:
      An empty TokenStore.
    """
    if axis not in AXES:
      raise ValueError(f"{field} axis must be one of {AXES}, got {axis!r}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
      raise ValueError(f"{field}.window must be an int >= 0, got {window!r}")
    lens = jnp.zeros((batch,), jnp.int32)
    if bits is None:
      return cls(codes=None, scale=None, zero=None, tail=None,
                 raw=jnp.zeros((batch, capacity, width), dtype), lens=lens, width=width,
                 bits=None, axis=axis, group=0, flush=0, cap=capacity)
    bits = packing.check_bits(bits, f"{field}.bits")
    g = resolve_group(group_size, width, axis, f"{field}.group_size")
    sd = jnp.dtype(canonical_scale_dtype(scale_dtype, f"{field}.scale_dtype"))
    if axis == "channel":
      f = -(-max(int(window), g) // g) * g
      s = -(-capacity // g) * g   # whole token groups (rows >= capacity never written)
      sshape = (batch, s // g, width)
    else:
      f = int(window)
      s = capacity
      sshape = (batch, s, width // g)
    return cls(codes=jnp.zeros((batch, s, packing.packed_words(width, bits)), jnp.uint32),
               scale=jnp.zeros(sshape, sd), zero=jnp.zeros(sshape, sd),
               tail=jnp.zeros((batch, f, width), dtype) if f else None, raw=None, lens=lens,
               width=width, bits=bits, axis=axis, group=g, flush=f, cap=capacity)

  @property
  def capacity(self) -> int:
    """Positions [0, capacity) can be stored (per-channel stores allocate whole groups)."""
    return self.cap

  @property
  def dtype(self):
    """Dtype of the exact rows."""
    if self.raw is not None:
      return self.raw.dtype
    return self.tail.dtype if self.tail is not None else jnp.float32

  def n_quantized(self, lens=None):
    """[B] number of leading positions held as codes (the rest of [0, L) is in the tail)."""
    lens = self.lens if lens is None else lens
    if self.bits is None:
      return jnp.zeros_like(lens)
    if self.flush == 0:
      return lens
    return (lens // self.flush) * self.flush

  def _quantize(self, rows):
    """rows [B, M, C] -> (packed codes [B, M, W], scale, zero) in this store's layout."""
    if self.axis == "token":
      c, s, z = quantize_codes(rows, bits=self.bits, axis=-1, group_size=self.group,
                               scale_dtype=self.scale.dtype)
    else:
      c, s, z = quantize_codes(rows, bits=self.bits, axis=1, group_size=self.group,
                               scale_dtype=self.scale.dtype)
    return packing.pack_words(c, self.bits), s, z

  def append(self, rows, positions) -> "TokenStore":
    """Writes rows [B, T, C] at slots = positions [B, T] (< 0: padding).

    Returns:
      The updated store (functional).
    """
    cap = self.capacity
    pos = jnp.where((positions >= 0) & (positions < cap), positions, -1)
    ok = pos >= 0
    l0 = self.lens
    l1 = base.new_lengths(l0, pos)
    if self.bits is None:
      return dataclasses.replace(self, raw=_scatter_rows(self.raw, pos, ok, rows), lens=l1)
    if self.flush == 0:   # per-token, no tail: quantize each row on arrival
      c, s, z = self._quantize(rows)
      return dataclasses.replace(
          self, codes=_scatter_rows(self.codes, pos, ok, c),
          scale=_scatter_rows(self.scale, pos, ok, s),
          zero=_scatter_rows(self.zero, pos, ok, z), lens=l1)
    f, t = self.flush, rows.shape[1]
    nq0, nq1 = self.n_quantized(l0), self.n_quantized(l1)
    # Exact window E: slot j holds position nq0 + j (tail for j < F, then new rows);
    # its length is a multiple of F, hence of the token group.
    e_len = f + -(-t // f) * f
    e = jnp.concatenate([self.tail, jnp.zeros((rows.shape[0], e_len - f, self.width),
                                              self.tail.dtype)], axis=1)
    e = _scatter_rows(e, pos - nq0[:, None], ok, rows)
    c, s, z = self._quantize(e)
    epos = nq0[:, None] + jnp.arange(e_len)[None, :]
    row_ok = epos < nq1[:, None]           # rows whose block completed in this call
    codes = _scatter_rows(self.codes, epos, row_ok, c)
    if self.axis == "token":
      scale = _scatter_rows(self.scale, epos, row_ok, s)
      zero = _scatter_rows(self.zero, epos, row_ok, z)
    else:
      g = self.group
      gidx = nq0[:, None] // g + jnp.arange(e_len // g)[None, :]
      g_ok = (gidx + 1) * g <= nq1[:, None]
      scale = _scatter_rows(self.scale, gidx, g_ok, s)
      zero = _scatter_rows(self.zero, gidx, g_ok, z)
    tail = _rows(e, (nq1 - nq0)[:, None] + jnp.arange(f)[None, :])   # positions nq1 + j
    return dataclasses.replace(self, codes=codes, scale=scale, zero=zero, tail=tail, lens=l1)

  def dequantize_codes(self, dtype=jnp.float32):
    """Dequantized code rows [B, S_alloc, C] (rows past n_quantized are meaningless)."""
    codes = packing.unpack_words(self.codes, self.bits, self.width)
    ax = 2 if self.axis == "token" else 1
    return dequantize_codes(codes, self.scale, self.zero, axis=ax, group_size=self.group,
                            dtype=dtype)

  def merge_tail(self, full, tail_rows):
    """Overlays tail_rows [B, F, N] (tail slot j = position nq + j) onto full [B, S, N]."""
    if self.flush == 0:
      return full
    nq = self.n_quantized()
    s = full.shape[1]
    spos = jnp.arange(s)[None, :]
    in_tail = spos >= nq[:, None]
    idx = jnp.clip(spos - nq[:, None], 0, self.flush - 1)
    return jnp.where(in_tail[..., None], _rows(tail_rows.astype(full.dtype), idx), full)

  def rows_at(self, positions, dtype=jnp.float32):
    """Rows at positions [B, W] as the cache reproduces them: [B, W, C] (dequantized codes
    below n_quantized, exact tail rows from there; positions outside the store read
    clipped slots, so callers mask them)."""
    if self.bits is None:
      return _rows(self.raw, jnp.clip(positions, 0, self.raw.shape[1] - 1)).astype(dtype)
    p = jnp.clip(positions, 0, self.codes.shape[1] - 1)
    q = packing.unpack_words(_rows(self.codes, p), self.bits, self.width).astype(jnp.float32)
    if self.axis == "token":
      s, z = _rows(self.scale, p), _rows(self.zero, p)
      s = jnp.repeat(s.astype(jnp.float32), self.group, axis=-1)
      z = jnp.repeat(z.astype(jnp.float32), self.group, axis=-1)
    else:
      s = _rows(self.scale, p // self.group).astype(jnp.float32)
      z = _rows(self.zero, p // self.group).astype(jnp.float32)
    x = q * s + z
    if self.flush:
      nq = self.n_quantized()[:, None]
      tail = _rows(self.tail, jnp.clip(positions - nq, 0, self.flush - 1)).astype(jnp.float32)
      x = jnp.where((positions >= nq)[..., None], tail, x)
    return x.astype(dtype)

  def window(self, start, size: int) -> "TokenStore":
    """Slots [start, start + size) as a store of capacity `size`: what `remat` of one chunk
    of the cache reads (no copy beyond the slices).

    Args:
      start: int (may be traced), a multiple of the flush block F and, per channel, of the
        token group.
      size: static; a multiple of F unless the window reaches the capacity.
    Returns:
      The window, lengths clip(lens - start, 0, size) (its n_quantized and exact tail are
      then those of the whole store, shifted by start).
    """
    sl = lambda a, lo, n: jax.lax.dynamic_slice_in_dim(a, lo, n, axis=1)
    lens = jnp.clip(self.lens - start, 0, size).astype(jnp.int32)
    if self.bits is None:
      return dataclasses.replace(self, raw=sl(self.raw, start, size), lens=lens, cap=size)
    if self.axis == "token":
      rows = size
      scale, zero = sl(self.scale, start, size), sl(self.zero, start, size)
    else:   # whole token groups (the store allocates them), cut back to `size` by `remat`
      g = self.group
      rows = -(-size // g) * g
      scale, zero = sl(self.scale, start // g, rows // g), sl(self.zero, start // g, rows // g)
    return dataclasses.replace(self, codes=sl(self.codes, start, rows), scale=scale,
                               zero=zero, lens=lens, cap=size)

  def packed(self):
    """The quantized rows as the dequant-matmul ops take them (PackedRows)."""
    return PackedRows(codes=self.codes, scale=self.scale, zero=self.zero, bits=self.bits,
                      axis=self.axis, group=self.group)

  def rows(self, dtype=jnp.float32):
    """All rows as the cache reproduces them: [B, capacity, C] (codes, tail overlaid)."""
    if self.bits is None:
      return self.raw.astype(dtype)
    full = self.dequantize_codes(dtype)
    full = self.merge_tail(full, self.tail) if self.flush else full
    return full[:, :self.cap]

  def nbytes(self) -> int:
    """Exact bytes of every allocated array (codes, scales, zeros, tail, raw, lengths)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))

  def bytes_per_token(self) -> float:
    """Asymptotic bytes per cached position: packed codes plus amortised scale and zero
    (the O(F) tail and the lengths are excluded)."""
    if self.bits is None:
      return float(self.width * self.raw.dtype.itemsize)
    return bytes_per_token(self.width, self.bits, self.axis, self.group, self.scale.dtype)


def bytes_per_token(width: int, bits: Optional[int], axis: str, group_size: int,
                    scale_dtype="float16", cache_dtype=jnp.bfloat16) -> float:
  """Analytic asymptotic bytes per position of a TokenStore (no arrays built).

  Quantized: 4·words(C, bits) bytes of codes plus one (scale, zero) pair per group:
  C/gc pairs per token (token axis) or C pairs shared by gs tokens (channel axis), i.e.
  2·itemsize·C/group either way. bits None: C elements at the cache dtype.
  """
  if bits is None:
    return float(width * jnp.dtype(cache_dtype).itemsize)
  g = resolve_group(group_size, width, axis, "group_size")
  sd = jnp.dtype(canonical_scale_dtype(scale_dtype)).itemsize
  return float(4 * packing.packed_words(width, bits) + 2 * sd * width / g)
