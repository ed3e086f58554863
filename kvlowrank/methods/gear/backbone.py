"""GEAR's quantization backbone: the interface the residual layer (S and L) sits on.

GEAR's correction is a layer over any quantizer Q that compresses a chunk of K/V vectors
and dequantizes it again: the layer needs `quantize_*` (codes + D^ of a chunk, so that it
can form the residual X - D^ - S), `write` (the codes into the store) and `dequantize`
(D^ at attention time). `StoreBackbone` is that interface over a KIVI store
(`kvlowrank_kernels.kivi.store`: the arrays the KIVI decode kernels read; the warp layout of
the Mosaic kernel where GEAR-L's Mosaic kernel applies, `GearSpec.layout`, else planar) and
the project's one quantizer; both of the paper's backbones are instances of it:

  "kivi" (`kivi_backbone`): keys per channel over groups of g tokens, values per token over
    groups of g channels -- KIVI (g = 64, n_b = 64 in the paper's 2-bit runs);
  "kcvt" (`kcvt_backbone`): KCVT's whole-vector groups, applied to each compressed chunk as
    Algorithm 1 compresses it (its own groups per chunk): one key group per channel of a
    chunk (g_k = n_b tokens) and one value group per token (g_v = H). Two departures from
    the paper, both for the per-head planar store the kernels read: (1) the prefill's keys
    are grouped per n_b-token chunk, not per channel over the whole prompt (2 H fp16
    scale/zero per n_b tokens more); (2) a value group is one KV head's token vector, not
    the token's vector over all heads.

Levels (paper vs code): the range is divided by 2^b - 1 (Eq. 2; the project's one
quantizer, `kvlowrank_kernels.quant.quantizer`). The official code's outlier-aware path
divides by `bits**2 - 1`: the same at the paper's 2 and 4 bits, but at 3 bits its top code
8 does not fit in 3 bits and at 8 bits it uses only codes 0..63 of 0..255. Not copied.

Not GEAR backbones here (GearSpec.backbone refuses them): Palu's quantized latents and
XQuant's quantized rows. Both quantize something other than the post-RoPE K/V that
attention reads (Palu: pre-RoPE per-group latents h = x A_k whose keys are rebuilt through
B_k and RoPE at attention time; XQuant: the layer input X, K/V rematerialised through
W_k/W_v). A low-rank residual of those tensors is possible in principle, but its decode
term is not the (q B) A^T / (p A) B^T correction this cache and its kernel compute (Palu's
key term would pass through B_k and a position-dependent RoPE, XQuant's through W_k and
RoPE), so it would be a different method with its own cache and kernel; it is not built.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kvlowrank_kernels.kivi import planar
from kvlowrank_kernels.kivi import store as kstore
from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import dequantize_codes, quantize_codes


@dataclasses.dataclass(frozen=True)
class StoreBackbone:
  """Asymmetric min/max quantization into a KIVI store (static, hashable)."""

  name: str
  bits: int
  key_group: int      # tokens per key group (per channel)
  value_group: int    # channels per value group (per token)
  scale_dtype: str = "float16"
  layout: str = "planar"   # the store's layout (`kvlowrank_kernels.kivi.store.LAYOUTS`)

  def capacity_multiple(self, buffer: int) -> int:
    """The store's capacity is a multiple of this (key groups, value blocks or the warp
    layout's 128-token blocks, chunks)."""
    m = kstore.capacity_multiple(self.layout, self.key_group)
    return m * buffer // math.gcd(m, buffer)

  def empty(self, *, batch: int, kv_heads: int, capacity: int, head_dim: int):
    """A zeroed store (`kvlowrank_kernels.kivi.store`) of `capacity` slots."""
    if self.layout == "warp":
      return kstore.empty("warp", batch=batch, kv_heads=kv_heads, capacity=capacity,
                          head_dim=head_dim, k_bits=self.bits, v_bits=self.bits,
                          group=self.key_group, scale_dtype=self.scale_dtype)
    b, k, s, h, sd = batch, kv_heads, capacity, head_dim, jnp.dtype(self.scale_dtype)
    gk, gv, z = self.key_group, self.value_group, jnp.zeros
    kw = packing.packed_bytes(h, self.bits, packing.plane_width(h, self.bits))
    vw = packing.packed_bytes(h, self.bits, packing.plane_width(h, self.bits, gv))
    keys = planar.KiviKeys(codes=z((b, k, s, kw), jnp.uint8), scale=z((b, k, s // gk, h), sd),
                           zero=z((b, k, s // gk, h), sd), bits=self.bits, group=gk)
    values = planar.KiviValues(codes=z((b, k, s, vw), jnp.uint8),
                               scale=z((b, k, s, h // gv), sd), zero=z((b, k, s, h // gv), sd),
                               bits=self.bits, group=gv)
    return kstore.PlanarStore(keys=keys, values=values)

  def quantize_keys(self, x):
    """x [B, M, K, H] float32 (M a multiple of key_group) -> (codes, scale, zero, D^ fp32)."""
    c, s, z = quantize_codes(x, bits=self.bits, axis=1, group_size=self.key_group,
                             scale_dtype=self.scale_dtype)
    return c, s, z, dequantize_codes(c, s, z, axis=1, group_size=self.key_group)

  def quantize_values(self, x):
    """x [B, M, K, H] float32 -> (codes, scale, zero [B, M, K, H / value_group], D^)."""
    c, s, z = quantize_codes(x, bits=self.bits, axis=3, group_size=self.value_group,
                             scale_dtype=self.scale_dtype)
    return c, s, z, dequantize_codes(c, s, z, axis=3, group_size=self.value_group)

  def write(self, store, first_pos, ok, kq, vq):
    """Writes the quantized tokens [first_pos, first_pos + M) of each row where ok [B, M]
    (whole key groups: ok is constant over each group). kq, vq: quantize_* outputs."""
    b, m = ok.shape
    gk = self.key_group
    groups = first_pos[:, None] // gk + jnp.arange(m // gk)[None, :]
    g_ok = ok.reshape(b, m // gk, gk)[..., 0]
    store = kstore.write_keys(store, groups, g_ok, *kq[:3])
    pos = first_pos[:, None] + jnp.arange(m)[None, :]
    return kstore.write_values(store, pos, ok, *vq[:3])

  def dequantize(self, store, head_dim: int):
    """(K^, V^) float32 [B, S, K, H] of every slot."""
    return kstore.dequantize(store, head_dim)


def make_backbone(gspec, head_dim: int) -> StoreBackbone:
  """The backbone of a GearSpec for a model of this head dim."""
  if gspec.backbone == "kivi":
    return StoreBackbone("kivi", gspec.bits, gspec.group_size, gspec.group_size,
                         gspec.scale_dtype, gspec.store_layout(head_dim))
  return StoreBackbone("kcvt", gspec.bits, gspec.buffer, head_dim, gspec.scale_dtype)
