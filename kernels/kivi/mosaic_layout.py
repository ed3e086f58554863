"""KIVI-2bit codes and scales in the register order of the Mosaic GPU kernel's MMA operands.

`KiviMosaic` is the cache layout of `mosaic_kivi_warp` (each warp owns 32 tokens of a
128-token block and multiplies with m16n8k16 `mma.sync`); `to_mosaic(keys, values)` is a
lossless relayout of a planar KIVI cache (`planar`), `from_mosaic` its inverse: the same
2-bit codes and the same scale/zero numbers, permuted so that each thread of a warpgroup
reads its whole share of a block with 16-byte loads, already in the order of its m16n8k16
A fragments (thread 32 w + l holds rows l // 4 + 8 rh, columns 2 (l % 4) + 8 jh + e of its
warp's [16, 16] tile, registers a0..a3 = (rh, jh) = (0, 0), (1, 0), (0, 1), (1, 1)).
Per (batch, KV head, 128-token block n), arrays of 1024 elements stored as [4, 256] rows
(so that the kernel's TMA copies move whole 1 KiB / 512-byte rows rather than boxes of
16-byte rows):

  key codes   kc [1024] uint32 = [2 sub-tiles m, 128 threads tau, 4 words u]: word u
      holds the pairs (rh, j) with rh = u // 2, j = 8 (u % 2) + k (slot k): key token
      32 w + 16 m + l // 4 + 8 rh (warp w owns tokens 32 w .. 32 w + 31, one key group),
      channels 8 j + 2 (l % 4) + e
  key scales  ks [1024] fp16/bf16 = [4 groups g, 8 r, 4 quads l % 4, 2 (j % 2),
      (scale, zero), e] with j = 2 r + j % 2: channel 8 j + 2 quad + e of key group g
  value codes vc [1024] uint32 = [128 threads tau, 8 words u = 4 kk + gq]: slot k of word
      u is fragment register reg = k % 4 = rh + 2 jh of channel tile t = 2 gq + k // 4 (V^T
      as A, channel tiles of 16, k-steps kk of the warp's 16-token halves): channel
      16 t + l // 4 + 8 rh, tokens 32 w + 16 kk + 8 jh + 2 (l % 4) + e
  value scales vs [1024] = [4 warps, 8 chunks c = u, 4 quads, 2 jh, (scale, zero), e]:
      the pair of tokens 32 w + 16 (c // 4) + 8 jh + 2 quad + e, channel group c % 4

A word's pair slot k takes bits [2k, 2k + 2) (element e = 0) and [16 + 2k, 18 + 2k)
(e = 1): its 16 codes in (e, k) order are an LSB-first 2-bit stream, i.e. the one packing
module's 2-bit word (`packing.pack_words`). Why these bit fields: a pair's two codes are
the same field of the two 16-bit halves, so one mask-and-or puts both into the low mantissa
bits of an fp16/bf16 pair (a magic number M + c 2^P, exact) and the kernel needs no byte
shuffles (`mosaic_dequant`). A thread reads its scales as 16-byte chunks, the four quads'
chunks side by side (no bank conflicts).
`code_maps()` / `scale_maps()` give the (token, channel) / (index, index) of every stored
element, for a cache that writes this layout directly.
Restrictions (the kernel's): 2-bit codes, key and value groups of 32, head dim 128,
capacity a multiple of 128, fp16 or bf16 scale/zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import packing
from .planar import (KiviKeys, KiviValues, block_tokens, dequantize_keys, dequantize_values,
                     key_codes, value_codes)

BLOCK = 128   # tokens per block (one ring slot of the kernel)
HEAD_DIM = 128
GROUP = 32    # tokens per warp in a block; the default key/value group
GROUPS = (32, 64)
BITS = 2
SCALE_DTYPES = ("float16", "bfloat16")


def scale_rows(group: int) -> int:
  """Rows of 256 halves that a block's key (or value) scale/zero pairs take: 128 / group."""
  return BLOCK // group


@dataclasses.dataclass(frozen=True)
class KiviMosaic:
  """A KIVI-2bit cache in the warp kernel's layout (module docstring); capacity S.

  kc, vc: uint32 [B, K, S / 128, 4, 256]; ks, vs: fp16 or bf16 [B, K, S / 128, 4, 256].
  """

  kc: jax.Array
  ks: jax.Array
  vc: jax.Array
  vs: jax.Array

  @property
  def capacity(self) -> int:
    return self.kc.shape[2] * BLOCK

  @property
  def group(self) -> int:
    """The key / value group (32 or 64), from the scale arrays' rows per block."""
    return BLOCK // self.ks.shape[3]


jax.tree_util.register_dataclass(KiviMosaic, data_fields=["kc", "ks", "vc", "vs"],
                                 meta_fields=[])


@functools.lru_cache(maxsize=None)
def _code_maps():
  m, tau, u, k, e = np.meshgrid(np.arange(2), np.arange(128), np.arange(4), np.arange(8),
                                np.arange(2), indexing="ij")
  w, lane = tau // 32, tau % 32
  rh, j = u // 2, (u % 2) * 8 + k
  flat = lambda x: x.reshape(1024, 8, 2)
  # keys: warp w owns tokens 32 w .. 32 w + 31 (one key group); sub-tile m is its tokens
  # 32 w + 16 m .., in the m16n8k16 A fragment order
  keys = (flat(32 * w + 16 * m + lane // 4 + 8 * rh), flat(8 * j + 2 * (lane % 4) + e))
  # values: thread tau's 8 words u = 4 kk + gq; slot k = 4 (t % 2) + reg, t = 2 gq + k // 4,
  # reg = rh + 2 jh (the m16n8k16 A fragment order a0..a3)
  tau, u, k, e = np.meshgrid(np.arange(128), np.arange(8), np.arange(8), np.arange(2),
                             indexing="ij")
  w, lane = tau // 32, tau % 32
  kk, gq = u // 4, u % 4
  t, reg = 2 * gq + k // 4, k % 4
  rh, jh = reg % 2, reg // 2
  chan = 16 * t + lane // 4 + 8 * rh
  tok = 32 * w + 16 * kk + 8 * jh + 2 * (lane % 4) + e
  return keys, (flat(tok), flat(chan))


def code_maps():
  """((key token, key channel), (value token, value channel)) of every stored code: int
  arrays [1024 words (stored order), 8 slots k, 2 elements e]; tokens within the block."""
  (kt, kd), (vt, vd) = _code_maps()
  return (kt.copy(), kd.copy()), (vt.copy(), vd.copy())


@functools.lru_cache(maxsize=None)
def _scale_maps(group=GROUP):
  ng = scale_rows(group)     # key groups per block = value groups per token (H = 128)
  g, r, quad, jj, e = np.meshgrid(np.arange(ng), np.arange(8), np.arange(4), np.arange(2),
                                  np.arange(2), indexing="ij")
  keys = (g, 8 * (2 * r + jj) + 2 * quad + e)
  # values: [warp w, chunk c = ng kk + gq, quad, jh, (scale, zero), e]
  w, c, quad, jh, e = np.meshgrid(np.arange(4), np.arange(2 * ng), np.arange(4), np.arange(2),
                                  np.arange(2), indexing="ij")
  return keys, (32 * w + 16 * (c // ng) + 8 * jh + 2 * quad + e, c % ng)


def scale_maps(group=GROUP):
  """((key group, key channel), (value token, value group)) of every stored scale/zero pair:
  int arrays ([128 / G, 8, 4, 2, 2] keys, [4, 256 / G, 4, 2, 2] values), the stored order
  without the (scale, zero) axis, which sits before the last; tokens and key groups within
  the block. Groups of 64: warps 2 i and 2 i + 1 share key scale row i, and a token's 2
  value groups take chunks c = 2 kk + g."""
  (kg, kx), (vx, vg) = _scale_maps(group)
  return (kg.copy(), kx.copy()), (vx.copy(), vg.copy())


@functools.lru_cache(maxsize=None)
def _inverses(group=GROUP):
  """Gathers that undo the relayout: for each planar element (key codes [token, channel],
  value codes [token, channel], key scales [group, channel], value scales [token, group],
  flattened), its position in the stored order (without the (scale, zero) axis)."""
  (kt, kd), (vt, vd) = _code_maps()
  (kg, kx), (vx, vg) = _scale_maps(group)
  flats = (kt * HEAD_DIM + kd, vt * HEAD_DIM + vd, kg * HEAD_DIM + kx,
           vx * scale_rows(group) + vg)
  return tuple(np.argsort(f.ravel()) for f in flats)


def _pack_words(c):
  """int codes [..., 8, 2] (slot k, element e) -> uint32 [...]: the 16 codes in (e, k)
  order as one 2-bit word of the packing module (bits 2 k + 16 e)."""
  stream = jnp.swapaxes(c, -1, -2).reshape(*c.shape[:-2], 16)
  return packing.pack_words(stream, BITS)[..., 0]


def _unpack_words(words):
  """uint32 [...] -> int32 codes [..., 8, 2] (inverse of `_pack_words`)."""
  stream = packing.unpack_words(words[..., None], BITS, 16)
  return jnp.swapaxes(stream.reshape(*words.shape, 2, 8), -1, -2)


def check_planar(keys: KiviKeys, values: KiviValues):
  """ValueError (one line, naming the field) unless planar keys/values fit this layout."""
  for name, x in (("keys", keys), ("values", values)):
    if x.bits != BITS or x.group not in GROUPS or x.group != keys.group:
      raise ValueError(f"mosaic KIVI layout: {name} must be {BITS}-bit with groups of 32 or 64 "
                       f"(keys' and values' alike), got bits={x.bits}, group={x.group}")
    if x.head_dim != HEAD_DIM:
      raise ValueError(f"mosaic KIVI layout: {name} head dim must be {HEAD_DIM}, "
                       f"got {x.head_dim}")
    if x.codes.shape[-1] != HEAD_DIM * BITS // 8:
      raise ValueError(f"mosaic KIVI layout: {name}.codes rows must be "
                       f"{HEAD_DIM * BITS // 8} bytes, got {x.codes.shape[-1]}")
  s = keys.codes.shape[2]
  if s % BLOCK:
    raise ValueError(f"mosaic KIVI layout: capacity ({s}) must be a multiple of {BLOCK}")
  if values.codes.shape[:3] != keys.codes.shape[:3]:
    raise ValueError(f"mosaic KIVI layout: values.codes {values.codes.shape} do not match "
                     f"keys.codes {keys.codes.shape}")
  dtypes = (jnp.dtype(keys.scale.dtype).name, jnp.dtype(values.scale.dtype).name)
  if dtypes[0] != dtypes[1] or dtypes[0] not in SCALE_DTYPES:
    raise ValueError("mosaic KIVI layout: key and value scale/zero must share one dtype, "
                     f"float16 or bfloat16; got {dtypes[0]}, {dtypes[1]}")


def check_mosaic(cache: KiviMosaic) -> str:
  """The cache's scale dtype name (the kernel's MMA operand type), after checking its
  arrays' shapes and dtypes (ValueError naming the bad field)."""
  shape = cache.kc.shape
  if len(shape) != 5 or shape[3:] != (4, 256):
    raise ValueError(f"KiviMosaic.kc must be [B, K, S / {BLOCK}, 4, 256], got {shape}")
  rows = cache.ks.shape[3] if cache.ks.ndim == 5 else -1
  if rows not in tuple(scale_rows(g) for g in GROUPS):
    raise ValueError(f"KiviMosaic.ks must be [B, K, S / {BLOCK}, 4 or 2, 256] (groups of 32 or "
                     f"64), got {cache.ks.shape}")
  for name in ("kc", "ks", "vc", "vs"):
    x = getattr(cache, name)
    want = shape if name.endswith("c") else shape[:3] + (rows, 256)
    if x.shape != want:
      raise ValueError(f"KiviMosaic.{name} shape {x.shape} != {want}")
    if name in ("kc", "vc") and x.dtype != jnp.uint32:
      raise ValueError(f"KiviMosaic.{name} must be uint32, got {x.dtype}")
  dtype = jnp.dtype(cache.ks.dtype).name
  if dtype not in SCALE_DTYPES or cache.vs.dtype != cache.ks.dtype:
    raise ValueError(f"KiviMosaic scales must be float16 or bfloat16, got ks {cache.ks.dtype}"
                     f", vs {cache.vs.dtype}")
  return dtype


def to_mosaic(keys: KiviKeys, values: KiviValues) -> KiviMosaic:
  """Planar KIVI-2bit keys/values (`planar`) -> the warp kernel's layout; lossless."""
  check_planar(keys, values)
  (kt, kd), (vt, vd) = _code_maps()
  b, kh, s, _ = keys.codes.shape
  nb, g = s // BLOCK, keys.group
  ng = scale_rows(g)
  kcodes = key_codes(keys).reshape(b, kh, nb, BLOCK, HEAD_DIM)
  vcodes = value_codes(values).reshape(b, kh, nb, BLOCK, HEAD_DIM)
  kc = _pack_words(kcodes[:, :, :, kt, kd]).reshape(b, kh, nb, 4, 256)
  vc = _pack_words(vcodes[:, :, :, vt, vd]).reshape(b, kh, nb, 4, 256)
  (kg, kx), (vx, vg) = _scale_maps(g)

  def key_scales(a):  # [B, K, S / G, H] -> [B, K, nb, *kg.shape]
    return a.reshape(b, kh, nb, ng, HEAD_DIM)[:, :, :, kg, kx]

  def value_scales(a):  # [B, K, S, H / G] -> [B, K, nb, *vx.shape]
    return a.reshape(b, kh, nb, BLOCK, ng)[:, :, :, vx, vg]

  ks = jnp.stack([key_scales(keys.scale), key_scales(keys.zero)], -2)
  vs = jnp.stack([value_scales(values.scale), value_scales(values.zero)], -2)
  return KiviMosaic(kc=kc, ks=ks.reshape(b, kh, nb, ng, 256), vc=vc,
                    vs=vs.reshape(b, kh, nb, ng, 256))


def from_mosaic(cache: KiviMosaic) -> tuple[KiviKeys, KiviValues]:
  """The planar keys/values (`planar`, 2-bit, groups of 32) that `to_mosaic` relays out into
  `cache`: its exact inverse (same codes bytes, same scale/zero numbers)."""
  check_mosaic(cache)
  b, kh, nb = cache.kc.shape[:3]
  s, g = nb * BLOCK, cache.group
  ng = scale_rows(g)
  inv_kc, inv_vc, inv_ks, inv_vs = _inverses(g)

  def codes(words, inv):  # -> int32 [B, K, S, H]
    c = _unpack_words(words.reshape(b, kh, nb, 1024)).reshape(b, kh, nb, BLOCK * HEAD_DIM)
    return c[..., inv].reshape(b, kh, s, HEAD_DIM)

  def scales(a, inv):  # [.., ng, 256] -> (scale, zero), each [B, K, nb, 128 ng] planar order
    a = a.reshape(b, kh, nb, 64 * ng, 2, 2)
    return tuple(a[..., i, :].reshape(b, kh, nb, 128 * ng)[..., inv] for i in range(2))

  ks, kz = scales(cache.ks, inv_ks)
  vs, vz = scales(cache.vs, inv_vs)
  cw_k = packing.plane_width(HEAD_DIM, BITS)
  cw_v = packing.plane_width(HEAD_DIM, BITS, g)
  keys = KiviKeys(codes=packing.pack(codes(cache.kc, inv_kc), BITS, cw_k),
                  scale=ks.reshape(b, kh, s // g, HEAD_DIM),
                  zero=kz.reshape(b, kh, s // g, HEAD_DIM), bits=BITS, group=g)
  values = KiviValues(codes=block_tokens(packing.pack(codes(cache.vc, inv_vc), BITS, cw_v)),
                      scale=vs.reshape(b, kh, s, HEAD_DIM // g),
                      zero=vz.reshape(b, kh, s, HEAD_DIM // g), bits=BITS, group=g)
  return keys, values


def dequantize_mosaic(cache: KiviMosaic):
  """(keys, values) float32 [B, S, K, H] of the cache (`from_mosaic`, then the planar
  dequantization: the same numbers as the planar cache's)."""
  keys, values = from_mosaic(cache)
  return dequantize_keys(keys, HEAD_DIM), dequantize_values(values, HEAD_DIM)
