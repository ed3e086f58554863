"""A KIVI cache's quantized store in its kernel's layout, written in place token by token.

The library's KIVI cache keeps its quantized keys and values in exactly the arrays a decode
kernel reads, so a decode step passes them to the kernel as they are:
  * "warp" (`mosaic_layout.KiviMosaic`): the register order of the Mosaic warp kernel's MMA
    fragments; 2-bit codes, key and value groups of 32, head dim 128, fp16/bf16 scales,
    capacity a multiple of 128 (`mosaic_layout`);
  * "planar" (`PlanarStore`: `planar.KiviKeys` + `planar.KiviValues`): the Triton kernel's
    head-major planar rows (any bits the packing module takes; the kernel reads 2 and 4).
`warp_fit` says where the warp layout applies. Both take the same writes:
  * `write_keys`: whole key groups (G tokens quantized per channel), as KIVI flushes them;
  * `write_values`: single tokens (quantized per token), as they leave the exact window.
Codes are given unpacked (integers); the store packs them through `quant.packing`. In the
warp layout a value token's 128 codes share 32 words with 3 other tokens, so they are
written by read-modify-write: each write adds (new field - old field) to its words, which
is exact even when several tokens of one word are written at once (disjoint bit fields).
Writes with `ok` False are dropped (out-of-range scatter indices).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import packing
from . import mosaic_layout as ml
from .planar import (VALUE_BLOCK, KiviKeys, KiviValues, dequantize_keys, dequantize_values)

LAYOUTS = ("warp", "planar")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlanarStore:
  """Planar keys and values (`planar`), capacity S."""

  keys: KiviKeys
  values: KiviValues


def warp_fit(*, k_bits: int, v_bits: int, group: int, head_dim: int, scale_dtype) -> str | None:
  """None when the warp layout holds this configuration, else why not (one line)."""
  if (k_bits, v_bits) != (ml.BITS, ml.BITS):
    return f"{k_bits}/{v_bits}-bit keys/values (the warp layout is {ml.BITS}-bit)"
  if group not in ml.GROUPS:
    return f"group size {group} (the warp layout takes {ml.GROUPS})"
  if head_dim != ml.HEAD_DIM:
    return f"head dim {head_dim} (the warp layout takes {ml.HEAD_DIM})"
  if jnp.dtype(scale_dtype) not in (jnp.float16, jnp.bfloat16):
    return f"{jnp.dtype(scale_dtype).name} scales (the warp layout takes float16/bfloat16)"
  return None


def fused_update_fit(store, k_res, residual: int) -> str | None:
  """None when a fused decode update (one Triton launch per step: `triton_update` on the warp
  layout, `triton_update_planar` on the planar one) updates this cache, else why not (one
  line): a ring of R > 0 tokens in bf16/fp16; planar: 2, 4 or 8 bits and a group that is a
  power of two."""
  if residual <= 0 or residual != k_res.shape[1]:
    return f"residual {residual} (the fused update needs R > 0: the ring of R tokens)"
  if k_res.dtype not in (jnp.bfloat16, jnp.float16):
    return f"{jnp.dtype(k_res.dtype).name} ring (the fused update takes bf16/fp16)"
  if isinstance(store, ml.KiviMosaic):
    if store.group != ml.GROUP:
      return f"groups of {store.group} (the fused update writes groups of {ml.GROUP})"
    return None
  keys, values = store.keys, store.values
  for what, q in (("key", keys), ("value", values)):
    if q.bits not in (2, 4, 8):
      return f"{q.bits}-bit {what}s (the fused planar update writes 2, 4 or 8 bits)"
  g = keys.group
  if g & (g - 1) or values.group != g:
    return f"groups of {g} (the fused planar update takes one group, a power of two)"
  for what, q in (("key", keys), ("value", values)):
    if q.codes.shape[-1] * 8 != q.head_dim * q.bits:
      return f"padded {what} rows (the fused planar update writes rows of width * bits / 8 bytes)"
  return None


def capacity_multiple(layout: str, group: int) -> int:
  """The store's capacity is rounded up to a multiple of this."""
  if layout == "warp":
    return ml.BLOCK
  return group * VALUE_BLOCK // math.gcd(group, VALUE_BLOCK)


def empty(layout: str, *, batch: int, kv_heads: int, capacity: int, head_dim: int,
          k_bits: int, v_bits: int, group: int, scale_dtype, v_head_dim: int | None = None):
  """A zeroed store of `capacity` slots (a multiple of `capacity_multiple`); values are
  `v_head_dim` wide (default: head_dim; planar only, e.g. FDC/ZACK's rotated widths)."""
  if layout not in LAYOUTS:
    raise ValueError(f"KIVI store layout must be one of {LAYOUTS}, got {layout!r}")
  if capacity % capacity_multiple(layout, group):
    raise ValueError(f"KIVI store capacity ({capacity}) must be a multiple of "
                     f"{capacity_multiple(layout, group)}")
  sd = jnp.dtype(scale_dtype)
  z = jnp.zeros
  if layout == "warp":
    why = warp_fit(k_bits=k_bits, v_bits=v_bits, group=group, head_dim=head_dim,
                   scale_dtype=sd)
    if why is not None:
      raise ValueError(f"KIVI warp layout: {why}")
    shape = (batch, kv_heads, capacity // ml.BLOCK, 4, 256)
    sshape = shape[:3] + (ml.scale_rows(group), 256)
    return ml.KiviMosaic(kc=z(shape, jnp.uint32), ks=z(sshape, sd), vc=z(shape, jnp.uint32),
                         vs=z(sshape, sd))
  h, b, k, s = head_dim, batch, kv_heads, capacity
  hv = h if v_head_dim is None else v_head_dim
  kw = packing.packed_bytes(h, k_bits, packing.plane_width(h, k_bits))
  vw = packing.packed_bytes(hv, v_bits, packing.plane_width(hv, v_bits, group))
  keys = KiviKeys(codes=z((b, k, s, kw), jnp.uint8), scale=z((b, k, s // group, h), sd),
                  zero=z((b, k, s // group, h), sd), bits=k_bits, group=group)
  values = KiviValues(codes=z((b, k, s, vw), jnp.uint8), scale=z((b, k, s, hv // group), sd),
                      zero=z((b, k, s, hv // group), sd), bits=v_bits, group=group)
  return PlanarStore(keys=keys, values=values)


def capacity(store) -> int:
  if isinstance(store, ml.KiviMosaic):
    return store.capacity
  return store.keys.codes.shape[2]


def dequantize(store, head_dim: int, v_head_dim: int | None = None):
  """(keys, values) float32 [B, S, K, H] (code * scale + zero of every slot); values
  `v_head_dim` wide when given."""
  if isinstance(store, ml.KiviMosaic):
    return ml.dequantize_mosaic(store)
  hv = head_dim if v_head_dim is None else v_head_dim
  return dequantize_keys(store.keys, head_dim), dequantize_values(store.values, hv)


def _drop(idx, ok, size):
  return jnp.where(ok, idx, size)


# ---------------------------------------------------------------------------- planar

def _planar_keys(keys: KiviKeys, groups, ok, codes, scale, zero):
  b, k, s, _ = keys.codes.shape
  g = keys.group
  h = codes.shape[-1]
  tok = (groups[:, :, None] * g + jnp.arange(g)[None, None, :]).reshape(b, -1)
  tok = _drop(tok, jnp.repeat(ok, g, axis=1), s)
  rows = packing.pack(codes, keys.bits, packing.plane_width(h, keys.bits))   # [B, M, K, R]
  bi = jnp.arange(b)[:, None]
  grp = _drop(groups, ok, s // g)
  sd = keys.scale.dtype
  return dataclasses.replace(
      keys, codes=keys.codes.at[bi, :, tok].set(rows, mode="drop"),
      scale=keys.scale.at[bi, :, grp].set(scale.astype(sd), mode="drop"),
      zero=keys.zero.at[bi, :, grp].set(zero.astype(sd), mode="drop"))


def _planar_values(values: KiviValues, pos, ok, codes, scale, zero):
  b, k, s, r = values.codes.shape
  h = codes.shape[-1]
  rows = packing.pack(codes, values.bits, packing.plane_width(h, values.bits, values.group))
  bi = jnp.arange(b)[:, None]
  p = _drop(pos, ok, s)
  # Token-blocked storage: byte r of token 32 i + u at [.., i, r, u] (`planar`).
  blocked = values.codes.reshape(b, k, s // VALUE_BLOCK, r, VALUE_BLOCK)
  blocked = blocked.at[bi, :, p // VALUE_BLOCK, :, p % VALUE_BLOCK].set(rows, mode="drop")
  sd = values.scale.dtype
  return dataclasses.replace(
      values, codes=blocked.reshape(b, k, s, r),
      scale=values.scale.at[bi, :, p].set(scale.astype(sd), mode="drop"),
      zero=values.zero.at[bi, :, p].set(zero.astype(sd), mode="drop"))


# ---------------------------------------------------------------------------- warp

@functools.lru_cache(maxsize=None)
def _warp_tables(group=ml.GROUP):
  """Static index tables of the warp layout, derived from `mosaic_layout`'s maps.

  Returns a dict of numpy arrays:
    key_words [4, 256]: the block's word indices holding key group w (tokens 32 w ..),
    key_tok, key_ch [256, 8, 2]: (token within the group, channel) of each code of those
      words, in (word, slot k, element e) order (the same for every group);
    key_axes: the same map as a transpose: a group's codes [32, 128] split into 12 binary
      axes (token bits high to low, then channel bits), transposed by key_axes, are the
      words' codes in (word, element e, slot k) order, i.e. [256, 16] code 8 e + k;
    key_scale_ch [256]: channel of each half of a key group's scale row (its (s, z)
      entries: key_scale_sz [256]);
    val_words [128, 32]: the words holding token t's value codes; val_ch, val_shift
      [128, 32, 4]: channel and bit offset of t's 4 codes in each;
    val_scale_idx [128, 128 / G, 2]: flat index (of the block's 512 or 1024 scale halves)
      of token t's scale (0) and zero (1) of channel group gv.
  Key codes are tabled per warp (32 tokens); a key group of 64 is two warps' words and one
  scale row (`mosaic_layout.scale_maps`).
  """
  (kt, kd), (vt, vd) = ml.code_maps()
  (kg, kx), (vx, vg) = ml.scale_maps(group)
  ng = ml.scale_rows(group)
  words = np.arange(1024)
  owner = kt[:, 0, 0] // ml.GROUP
  if not all(np.all(kt[w] // ml.GROUP == owner[w]) for w in words):
    raise AssertionError("warp layout: a key word spans two key groups")
  key_words = np.stack([words[owner == w] for w in range(4)])
  key_tok = kt[key_words[0]] % ml.GROUP
  if not all(np.array_equal(kt[key_words[w]] % ml.GROUP, key_tok) and
             np.array_equal(kd[key_words[w]], kd[key_words[0]]) for w in range(4)):
    raise AssertionError("warp layout: key groups are not laid out alike")
  key_ch = kd[key_words[0]]
  key_axes = _bit_transpose(key_tok, key_ch)
  # scale rows: [4 g, 8, 4, 2, (s, z), 2 e] flat; entry (g, ...) is channel kx of group kg
  sz = np.broadcast_to(np.arange(2)[:, None], (2, 2))
  ch = np.stack([kx[0], kx[0]], axis=-2)                      # [8, 4, 2, (s, z), 2]
  key_scale_ch = ch.reshape(256)
  key_scale_sz = np.broadcast_to(sz, (8, 4, 2, 2, 2)).reshape(256)
  val_words = np.zeros((128, 32), np.int64)
  val_ch = np.zeros((128, 32, 4), np.int64)
  val_shift = np.zeros((128, 32, 4), np.int64)
  shift = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :])   # [8 k, 2 e]
  for t in range(128):
    w_idx, k_idx, e_idx = np.nonzero(vt == t)
    order = np.lexsort((e_idx, k_idx, w_idx))
    w_idx, k_idx, e_idx = w_idx[order], k_idx[order], e_idx[order]
    if len(w_idx) != 128:
      raise AssertionError("warp layout: a value token does not have 128 codes")
    val_words[t] = w_idx.reshape(32, 4)[:, 0]
    if not np.all(w_idx.reshape(32, 4) == val_words[t][:, None]):
      raise AssertionError("warp layout: a value token's codes are not 4 per word")
    val_ch[t] = vd[w_idx, k_idx, e_idx].reshape(32, 4)
    val_shift[t] = shift[k_idx, e_idx].reshape(32, 4)
  flat = np.arange(256 * ng).reshape(4, 2 * ng, 4, 2, 2, 2)  # [w, c, quad, jh, (s, z), e]
  val_scale_idx = np.zeros((128, ng, 2), np.int64)
  for t in range(128):
    for gv in range(ng):
      hit = np.argwhere((vx == t) & (vg == gv))
      if len(hit) != 1:
        raise AssertionError("warp layout: a value scale is not stored exactly once")
      w, c, quad, jh, e = hit[0]
      val_scale_idx[t, gv] = flat[w, c, quad, jh, :, e]
  return dict(key_words=key_words, key_tok=key_tok, key_ch=key_ch, key_axes=key_axes,
              key_scale_ch=key_scale_ch,
              key_scale_sz=key_scale_sz, val_words=val_words, val_ch=val_ch,
              val_shift=val_shift, val_scale_idx=val_scale_idx)


def _bit_transpose(key_tok, key_ch):
  """The axes order that turns a key group's codes [32 tok, 128 ch], reshaped to 12 binary
  axes (tok bits 4..0, ch bits 6..0), into its words' codes [256 words, 2 e, 8 k] (word
  bits 7..0, e, k bits 2..0), found from the layout's maps; AssertionError if the map is
  not a permutation of bits (then a transpose cannot express it)."""
  word, slot, elem = np.meshgrid(np.arange(256), np.arange(8), np.arange(2), indexing="ij")
  src = [(key_tok >> b) & 1 for b in range(4, -1, -1)] + [(key_ch >> b) & 1
                                                            for b in range(6, -1, -1)]
  dst = ([(word >> b) & 1 for b in range(7, -1, -1)] + [elem]
         + [(slot >> b) & 1 for b in range(2, -1, -1)])
  axes = []
  for d in dst:
    hit = [i for i, a in enumerate(src) if np.array_equal(a, d)]
    if len(hit) != 1:
      raise AssertionError("warp layout: the key code map is not a permutation of bits")
    axes.append(hit[0])
  if sorted(axes) != list(range(12)):
    raise AssertionError("warp layout: the key code map is not a permutation of bits")
  return tuple(axes)


def _flat(a):
  """[B, K, nb, rows, 256] -> [B, K, nb * rows * 256]."""
  b, k, nb = a.shape[:3]
  return a.reshape(b, k, -1)


def _warp_keys(store: ml.KiviMosaic, groups, ok, codes, scale, zero):
  g = store.group
  t = _warp_tables(g)
  b, k, nb = store.kc.shape[:3]
  ng, per = ml.scale_rows(g), g // ml.GROUP       # key groups per block, warps per group
  rows = ng * 256                                 # a block's key scale halves
  # the scale rows: group j of block j // ng is row j % ng
  sz = jnp.stack([scale, zero], axis=0).astype(store.ks.dtype)        # [2, B, Gc, K, H]
  srows = sz[t["key_scale_sz"], :, :, :, t["key_scale_ch"]]          # [256, B, Gc, K]
  gc0 = groups.shape[1]
  sidx = _drop((groups // ng) * rows + (groups % ng) * 256, ok, nb * rows)[:, :, None] + \
      jnp.arange(256)
  bi = jnp.arange(b)[:, None]
  ks = _flat(store.ks).at[bi, :, sidx.reshape(b, gc0 * 256)].set(
      jnp.moveaxis(srows, 0, 2).reshape(b, gc0 * 256, k), mode="drop")
  store = dataclasses.replace(store, ks=ks.reshape(store.ks.shape))
  # the codes, per warp (32 tokens): a group of 64 is two warps' words
  groups = (groups[:, :, None] * per + jnp.arange(per)).reshape(b, -1)
  ok = jnp.repeat(ok, per, axis=1)
  gc = groups.shape[1]
  blk, w = groups // 4, groups % 4                                   # [B, Gc]
  c = codes.reshape(b, gc, ml.GROUP, k, ml.HEAD_DIM)
  c = jnp.moveaxis(c, 3, 2)                                          # [B, Gc, K, 32, H]
  # The layout's (token, channel) of each word's code is a permutation of index bits, so
  # one transpose places the codes (not a gather by key_tok / key_ch: decode runs this
  # every step).
  axes = (0, 1, 2) + tuple(3 + a for a in t["key_axes"])
  c = c.reshape((b, gc, k) + (2,) * 12).transpose(axes)
  c = c.reshape(b, gc, k, 256, 16)                                   # code 8 e + k
  words = packing.pack_words(c, ml.BITS)[..., 0]                     # [B, Gc, K, 256]
  idx = blk[:, :, None] * 1024 + jnp.asarray(t["key_words"])[w]      # [B, Gc, 256]
  idx = _drop(idx, ok[:, :, None], nb * 1024).reshape(b, gc * 256)
  bi = jnp.arange(b)[:, None]
  kc = _flat(store.kc).at[bi, :, idx].set(
      jnp.moveaxis(words, 2, 3).reshape(b, gc * 256, k), mode="drop")
  return dataclasses.replace(store, kc=kc.reshape(store.kc.shape))


def _warp_values(store: ml.KiviMosaic, pos, ok, codes, scale, zero):
  t = _warp_tables(store.group)
  ng = ml.scale_rows(store.group)                 # value groups per token
  rows = ng * 256                                 # a block's value scale halves
  b, k, nb = store.kc.shape[:3]
  n_tok = pos.shape[1]
  tb = pos % ml.BLOCK                                               # [B, T]
  base = (pos // ml.BLOCK) * 1024
  idx = _drop(base[:, :, None] + jnp.asarray(t["val_words"])[tb], ok[:, :, None],
              nb * 1024)                                            # [B, T, 32]
  ch = jnp.asarray(t["val_ch"])[tb]                                 # [B, T, 32, 4]
  sh = jnp.asarray(t["val_shift"], jnp.uint32)[tb]
  c = jnp.take_along_axis(codes.astype(jnp.uint32)[:, :, :, None, :],   # [B, T, K, 1, H]
                          ch[:, :, None, :, :].reshape(b, n_tok, 1, 1, 128), axis=-1)
  c = c.reshape(b, n_tok, k, 32, 4)
  new = jnp.sum(c << sh[:, :, None], axis=-1, dtype=jnp.uint32)     # [B, T, K, 32]
  mask = jnp.sum(jnp.uint32(3) << sh, axis=-1, dtype=jnp.uint32)    # [B, T, 32]
  vc = _flat(store.vc)
  bi = jnp.arange(b)[:, None]
  flat_idx = idx.reshape(b, n_tok * 32)
  # The barrier keeps this gather out of the scatter's fusion: a scatter fusion that also
  # reads its operand cannot run in place, and XLA copies the whole code array (measured:
  # GEAR's chunk write under a conditional copied 2 x 67 MB per layer and step, H200).
  old = jax.lax.optimization_barrier(
      vc.at[bi, :, flat_idx].get(mode="fill", fill_value=0))          # [B, T*32, K]
  old = jnp.moveaxis(old.reshape(b, n_tok, 32, k), 3, 2)             # [B, T, K, 32]
  delta = new - (old & mask[:, :, None, :])                          # mod 2^32
  vc = vc.at[bi, :, flat_idx].add(jnp.moveaxis(delta, 2, 3).reshape(b, n_tok * 32, k),
                                  mode="drop")
  sz = jnp.stack([scale, zero], axis=-1).astype(store.vs.dtype)      # [B, T, K, ng, 2]
  sbase = (pos // ml.BLOCK) * rows
  sidx = _drop(sbase[:, :, None, None] + jnp.asarray(t["val_scale_idx"])[tb],
               ok[:, :, None, None], nb * rows)                     # [B, T, ng, 2]
  vs = _flat(store.vs).at[bi, :, sidx.reshape(b, n_tok * 2 * ng)].set(
      jnp.moveaxis(sz, 2, 4).reshape(b, n_tok * 2 * ng, k), mode="drop")
  return dataclasses.replace(store, vc=vc.reshape(store.vc.shape),
                             vs=vs.reshape(store.vs.shape))


# ---------------------------------------------------------------------------- writes

def write_keys(store, groups, ok, codes, scale, zero):
  """Writes whole key groups.

  Args:
    store: a KiviMosaic or PlanarStore of capacity S, key group G.
    groups: [B, Gc] int group indices (group j holds tokens [j G, (j + 1) G)).
    ok: [B, Gc] bool; False drops the write.
    codes: [B, Gc * G, K, H] integer codes of those tokens (group-major).
    scale, zero: [B, Gc, K, H] per-channel scale and zero point of each group.
  Returns:
    the new store.
  """
  if isinstance(store, ml.KiviMosaic):
    return _warp_keys(store, groups, ok, codes, scale, zero)
  return dataclasses.replace(store, keys=_planar_keys(store.keys, groups, ok, codes, scale,
                                                       zero))


def write_values(store, pos, ok, codes, scale, zero):
  """Writes single value tokens.

  Args:
    store: a KiviMosaic or PlanarStore.
    pos: [B, T] int slots; ok: [B, T] bool (False drops the write; the written slots of
      one row must be distinct).
    codes: [B, T, K, H] integer codes; scale, zero: [B, T, K, H / Gv] per-token groups.
  Returns:
    the new store.
  """
  if isinstance(store, ml.KiviMosaic):
    return _warp_values(store, pos, ok, codes, scale, zero)
  return dataclasses.replace(store, values=_planar_values(store.values, pos, ok, codes, scale,
                                                           zero))
