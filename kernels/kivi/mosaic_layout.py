"""KIVI codes and scales in the register order of the Mosaic GPU kernels' MMA A operands.

`to_mosaic(keys, values)` is a lossless relayout of a planar KIVI cache (`packing`): the
same 2-bit codes and the same scale/zero numbers, permuted so that each thread of a
warpgroup reads its whole share of a 128-token block with 16-byte loads, already in the
order of the m64 x k16 A fragments (`WGMMA_LAYOUT`: thread 32w + l holds rows
16w + l // 4 + 8 rh, columns 8 j + 2 (l % 4) + e of a [64, K] operand). Per (batch, KV head,
128-token block n):

  key codes   kc [1024] uint32 = [2, 128, 4]: sub-tile m (tokens 64 m ..), thread tau, word u
  value codes vc [1024] uint32 = [2, 128, 4]: channel half m (channels 64 m ..), thread tau, u
  key scales  ks [1024] fp16/bf16 = [4 groups g, 8 r, 4 quads l % 4, 2 (j % 2), (scale, zero),
                                      e] with j = 2 r + j % 2
  value scales vs [1024]          = [4 groups gv, 8 r, 4 quads, 2, (scale, zero), e]
(stored as [4, 256] rows, so that the kernel's TMA copies move 1 KiB / 512-byte rows: boxes of
16-byte rows ran at ~0.5 TB/s). A thread reads its scales as 8 16-byte chunks, the four quads'
chunks side by side (no bank conflicts).

A thread's 32 pairs (rh, j) of one m take words u = 2 rh + j // 8, pair slot k = j % 8 at
bits [2k, 2k + 2) (element e = 0) and [16 + 2k, 18 + 2k) (e = 1) of the word. Keys: the
pair is token 128 n + 64 m + 16 w + l // 4 + 8 rh, channels 8 j + 2 (l % 4) + e, scale of
key group g = 2 m + w // 2. Values (the operand is V^T): channel 64 m + 16 w + l // 4 + 8 rh,
tokens 128 n + 8 j + 2 (l % 4) + e, scale of channel group gv = 2 m + w // 2.
Why these bit fields: a pair's two codes are the same field of the two 16-bit halves, so
one mask-and-or puts both into the low mantissa bits of an fp16/bf16 pair (a magic number
M + c 2^P, exact) and the kernel needs no byte shuffles (`mosaic_dequant`).

The "warp" layout (`mosaic_kivi_warp`: each warp owns 32 tokens of a block and multiplies
with m16n8k16 `mma.sync`, whose per-warp A fragment is the wgmma one's) keeps the key words
and both scale rows' formats but moves tokens: warp w owns tokens 32 w .. 32 w + 31 (one key
group), key sub-tile m = its tokens 32 w + 16 m + l // 4 + 8 rh. Values (V^T as A, channel
tiles t of 16, k-steps kk of the warp's 16-token halves):
  value codes vc [1024] uint32 = [128 threads tau, 8 words u = 4 kk + gq]; slot k of word u
      is fragment register reg = k % 4 = rh + 2 jh of channel tile t = 2 gq + k // 4: channel
      16 t + l // 4 + 8 rh, tokens 32 w + 16 kk + 8 jh + 2 (l % 4) + e
  value scales vs [1024] = [4 warps, 8 chunks c = u, 4 quads, 2 jh, (scale, zero), e]: the
      pair of tokens 32 w + 16 (c // 4) + 8 jh + 2 quad + e, channel group c % 4
Restrictions (the kernels'): 2-bit codes, key and value groups of 32, head dim 128,
capacity a multiple of 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .planar import KiviKeys, KiviValues, unblock_tokens, unpack_planar

BLOCK = 128   # tokens per block (one ring slot of the kernel)
HEAD_DIM = 128
GROUP = 32
BITS = 2


LAYOUTS = ("wgmma", "warp")


@dataclasses.dataclass(frozen=True)
class KiviMosaic:
  """A KIVI-2bit cache in a Mosaic kernel's layout (module docstring); capacity S.

  kc, vc: uint32 [B, K, S / 128, 4, 256]; ks, vs: fp16 or bf16 [B, K, S / 128, 4, 256];
  layout: "wgmma" (`mosaic_kivi`) or "warp" (`mosaic_kivi_warp`; values differ).
  """

  kc: jax.Array
  ks: jax.Array
  vc: jax.Array
  vs: jax.Array
  layout: str = "wgmma"

  @property
  def capacity(self) -> int:
    return self.kc.shape[2] * BLOCK


jax.tree_util.register_dataclass(KiviMosaic, data_fields=["kc", "ks", "vc", "vs"],
                                 meta_fields=["layout"])


@functools.lru_cache(maxsize=None)
def _code_maps(layout: str):
  """(token in block, channel) of every code, for keys and for values, as int arrays
  [1024 words (stored order), 8 slots k, 2 elements e]."""
  m, tau, u, k, e = np.meshgrid(np.arange(2), np.arange(128), np.arange(4), np.arange(8),
                                np.arange(2), indexing="ij")
  w, lane = tau // 32, tau % 32
  rh, j = u // 2, (u % 2) * 8 + k
  row = 16 * w + lane // 4 + 8 * rh     # M index within the m64 operand
  col = 8 * j + 2 * (lane % 4) + e      # K index
  flat = lambda x: x.reshape(1024, 8, 2)
  if layout == "wgmma":
    return (flat(64 * m + row), flat(col)), (flat(col), flat(64 * m + row))
  # warp: warp w owns tokens 32 w .. 32 w + 31 (one key group); key sub-tile m is its
  # tokens 32 w + 16 m .., in the m16n8k16 A fragment order (the same per-thread order)
  keys = (flat(32 * w + 16 * m + lane // 4 + 8 * rh), flat(col))
  # warp: thread tau's 8 words u = 4 kk + gq; slot k = 4 (t % 2) + reg, t = 2 gq + k // 4,
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


@functools.lru_cache(maxsize=None)
def _scale_maps(layout: str):
  """(index a, index b) of every scale, as int arrays [4, 8, 4, 2, 2] (the stored order
  without the (scale, zero) axis, which sits before the last): keys (group, channel),
  values (token in block, group)."""
  g, r, quad, jj, e = np.meshgrid(np.arange(4), np.arange(8), np.arange(4), np.arange(2),
                                  np.arange(2), indexing="ij")
  x = 8 * (2 * r + jj) + 2 * quad + e
  keys = (g, x)
  if layout == "wgmma":
    return keys, (x, g)
  # warp: [warp w, chunk c = 4 kk + gq, quad, jh, (scale, zero), e]
  w, c, quad, jh, e = g, r, quad, jj, e
  tok = 32 * w + 16 * (c // 4) + 8 * jh + 2 * quad + e
  return keys, (tok, c % 4)


def _pack_words(c):
  """int codes [..., 8, 2] (slot k, element e) -> uint32 [...]."""
  shifts = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)
  return jnp.sum(c.astype(jnp.uint32) << shifts, axis=(-2, -1), dtype=jnp.uint32)


def _unpack_words(words):
  """uint32 [...] -> int32 codes [..., 8, 2]."""
  shifts = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)
  return ((words[..., None, None] >> shifts) & 3).astype(jnp.int32)


def _check(keys: KiviKeys, values: KiviValues):
  for name, x in (("keys", keys), ("values", values)):
    if x.bits != BITS or x.group != GROUP:
      raise ValueError(f"mosaic KIVI layout: {name} must be {BITS}-bit with groups of {GROUP}, "
                       f"got bits={x.bits}, group={x.group}")
    if x.head_dim != HEAD_DIM:
      raise ValueError(f"mosaic KIVI layout: {name} head dim must be {HEAD_DIM}, "
                       f"got {x.head_dim}")
  s = keys.codes.shape[2]
  if s % BLOCK:
    raise ValueError(f"mosaic KIVI layout: capacity ({s}) must be a multiple of {BLOCK}")
  if keys.scale.dtype != values.scale.dtype or keys.scale.dtype not in (jnp.float16,
                                                                        jnp.bfloat16):
    raise ValueError("mosaic KIVI layout: key and value scale/zero must share one dtype, "
                     f"float16 or bfloat16; got {keys.scale.dtype}, {values.scale.dtype}")


def to_mosaic(keys: KiviKeys, values: KiviValues, layout: str = "wgmma") -> KiviMosaic:
  """Planar KIVI-2bit keys/values (`packing`) -> a kernel's layout; lossless."""
  if layout not in LAYOUTS:
    raise ValueError(f"mosaic KIVI layout: layout must be one of {LAYOUTS}, got {layout!r}")
  _check(keys, values)
  (kt, kd), (vt, vd) = _code_maps(layout)
  b, kh, s, _ = keys.codes.shape
  nb = s // BLOCK
  kcodes = unpack_planar(keys.codes, BITS, keys.plane_width).reshape(b, kh, nb, BLOCK, HEAD_DIM)
  vcodes = unpack_planar(unblock_tokens(values.codes), BITS, values.plane_width)
  vcodes = vcodes.reshape(b, kh, nb, BLOCK, HEAD_DIM)
  kc = _pack_words(kcodes[:, :, :, kt, kd]).reshape(b, kh, nb, 4, 256)
  vc = _pack_words(vcodes[:, :, :, vt, vd]).reshape(b, kh, nb, 4, 256)
  (kg, kx), (vx, vg) = _scale_maps(layout)

  def key_scales(a):  # [B, K, S / 32, H] -> [B, K, nb, 4, 8, 4, 2, 2]
    return a.reshape(b, kh, nb, 4, HEAD_DIM)[:, :, :, kg, kx]

  def value_scales(a):  # [B, K, S, 4] -> [B, K, nb, 4, 8, 4, 2, 2]
    return a.reshape(b, kh, nb, BLOCK, 4)[:, :, :, vx, vg]

  ks = jnp.stack([key_scales(keys.scale), key_scales(keys.zero)], -2)
  vs = jnp.stack([value_scales(values.scale), value_scales(values.zero)], -2)
  return KiviMosaic(kc=kc, ks=ks.reshape(b, kh, nb, 4, 256), vc=vc,
                    vs=vs.reshape(b, kh, nb, 4, 256), layout=layout)


def dequantize_mosaic(cache: KiviMosaic):
  """(keys, values) float32 [B, S, K, H] from the kernel's layout (inverse maps of
  `to_mosaic`, for the tests and the reference path)."""
  (kt, kd), (vt, vd) = _code_maps(cache.layout)
  b, kh, nb = cache.kc.shape[:3]
  (kg, kx), (vx, vg) = _scale_maps(cache.layout)

  def codes(words, rows, cols):
    c = _unpack_words(words.reshape(b, kh, nb, 1024))
    out = jnp.zeros((b, kh, nb, BLOCK, HEAD_DIM), jnp.int32)
    return out.at[:, :, :, rows, cols].set(c).astype(jnp.float32)

  def scales(a, rows, cols, shape):
    a = a.reshape(b, kh, nb, 4, 8, 4, 2, 2, 2).astype(jnp.float32)
    z = jnp.zeros((b, kh, nb, *shape), jnp.float32)
    return (z.at[:, :, :, rows, cols].set(a[..., 0, :]),
            z.at[:, :, :, rows, cols].set(a[..., 1, :]))

  kcodes = codes(cache.kc, kt, kd).reshape(b, kh, nb, 4, GROUP, HEAD_DIM)
  s, z = scales(cache.ks, kg, kx, (4, HEAD_DIM))
  k = kcodes * s[:, :, :, :, None] + z[:, :, :, :, None]
  vcodes = codes(cache.vc, vt, vd).reshape(b, kh, nb, BLOCK, 4, GROUP)
  s, z = scales(cache.vs, vx, vg, (BLOCK, 4))
  v = vcodes * s[..., None] + z[..., None]
  to_bshd = lambda x: jnp.transpose(x.reshape(b, kh, nb * BLOCK, HEAD_DIM), (0, 2, 1, 3))
  return to_bshd(k), to_bshd(v)
