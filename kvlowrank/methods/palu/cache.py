"""Palu's latent KV cache: stores h = x·A per decomposition group, never K or V.

Per layer, with G groups of gs KV heads, group ranks r_k / r_v:
  * update: h_k = x A_k, h_v = x A_v ([B,T,G,r], pre-RoPE: the latent carries no
    position) written at slot = position; optionally quantized per token with one
    (scale, zero) per (token, group) [Palu §4.1 / official `lt_group_size=0`], the
    Hadamard rotation already folded into A and B offline (no run-time cost).
    With `window > 0` the most recent `window` positions are also kept unquantized
    in a ring buffer (KIVI-style residual of the official latency code); a key is
    read at full precision iff its position >= length − window at attention time.
  * attend (RoPE models): K = h_k B_k (+ key bias) is reconstructed and rotated at
    the *key* positions, then standard attention [Palu §3.1.2]. Values are never
    reconstructed: where B_v is folded into W_o (Eq. 6; `PaluSpec.value_fold`) the output
    is p · h_v, [B,T,N,r_v], which the attention block multiplies by lp["wo"]; where W_o
    was kept (r_v > head_dim) the output is (p · h_v) B_v per head, [B,T,N,H]. The layer's
    lp["wo"] says which: N·r_v rows are folded.
  * attend (rope_layout == "none"): scores = (q B_kᵀ) h_kᵀ (Eq. 7), the key latent is
    scored directly; a key bias b adds the per-query constant q·b (kept, so the
    log-sum-exp stays exact for segment merging).

One code path serves prefill (T > 1) and decode (T = 1), any GQA ratio, batch > 1
and ragged rows (padding positions −1 are never written or attended). A decode step on a
GPU runs the fused kernel (`kvlowrank_kernels.palu.palu_attention`: key reconstruction,
RoPE, online softmax and the value-latent product in one pass; Mosaic GPU on Hopper for
bf16 latents, else Triton) on the cache's arrays; with a window, the kernel takes the
quantized prefix and the ring's exact latents are attended in jnp and LSE-merged.
Everything else (CPU, prefill, interleaved or no RoPE, shapes a kernel does not take)
runs the jnp reference below, with the reason logged once (`cache.dispatch`).

Storage accounting: `nbytes()` counts what grows with the cache (latents or packed
codes + scales + zeros, the ring, lengths). The reconstruction matrices B_k, B_v
and biases are model weights (copies of params kept only so `materialize()` and
key reconstruction need no params) and are reported by `weights_nbytes()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp

from kvlowrank.cache import base, dispatch
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank.model.projection import project
from kvlowrank.model.rope import apply_rope, inv_frequencies
from kvlowrank.methods.palu.spec import PaluSpec, layout_from_params
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import palu as palu_kernels
from kvlowrank_kernels.palu.packed import PackedLatent, dequantize_latent, quantize_latent
from kvlowrank_kernels.quant import packing

# Jitted so that the layers' identical kernel calls are lowered (and the Mosaic kernel
# compiled) once per model, not once per layer.
_kernel_attention = jax.jit(palu_kernels.palu_attention,
                            static_argnames=("rope_theta", "scale", "out_dtype",
                                             "implementation"))
# Slots are allocated in whole 64-token tiles: the decode kernels read the latents in tiles
# (the Mosaic kernel needs a capacity that is a multiple of 8 for its TMA copies).
CAPACITY_MULTIPLE = 64
# One (scale, zero) pair per token per group latent, stored like KIVI's (fp16).
SCALE_DTYPE = "float16"


def _per_kv_head_b(b, n_kv_heads: int):
  """[G, r, gs·H] → [K, r, H] (slice of group g's columns for each of its KV heads)."""
  g, r, cols = b.shape
  gs = n_kv_heads // g
  return b.reshape(g, r, gs, cols // gs).transpose(0, 2, 1, 3).reshape(n_kv_heads, r, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache(base.KVCache):
  """One layer of Palu latents (see module docstring)."""

  hk: Any                      # [B,S,G,r_k] array at cache dtype, or PackedLatent (bits set)
  hv: Any                      # [B,S,G,r_v] likewise
  ring_k: Optional[jax.Array]  # [B,W,G,r_k] unquantized recent latents (window > 0)
  ring_v: Optional[jax.Array]
  lens: jax.Array              # [B] int32
  bk: jax.Array                # [G, r_k, gs·H] key reconstruction (weights)
  bv: jax.Array                # [K, r_v, H] value reconstruction B_v, per KV head
  k_bias: Optional[jax.Array]  # [K·H] or None
  v_bias: Optional[jax.Array]
  spec: ModelSpec = base.static_field()
  bits: Optional[int] = base.static_field(default=None)
  window: int = base.static_field(default=0)
  implementation: Optional[str] = base.static_field(default=None)

  name = "palu"

  def shard_axes(self) -> dict:
    """Latents (and their codes/scales) split by group, whole groups per device
    (`kvlowrank.parallel.param_specs` refuses groups that would straddle devices); the
    reconstruction weights and biases kept on the cache by group / KV head."""
    return {".hk": (0, 2), ".hv": (0, 2), ".ring_k": (0, 2), ".ring_v": (0, 2),
            ".lens": (0, None), ".bk": (None, 0), ".bv": (None, 0), ".k_bias": (None, 0),
            ".v_bias": (None, 0)}

  def for_spec(self, spec: ModelSpec) -> "LatentCache":
    return dataclasses.replace(self, spec=spec)

  @classmethod
  def init(cls, spec: ModelSpec, lp: dict, *, batch: int, capacity: int,
           dtype=jnp.bfloat16, bits: Optional[int] = None, window: int = 0,
           implementation: Optional[str] = None):
    """Empty cache for one compressed layer `lp` (needs palu_bk / palu_bv)."""
    if bits is not None:
      packing.check_bits(bits, "PaluSpec.bits")
    capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
    g, rk, _ = lp["palu_bk"].shape
    rv = lp["palu_bv"].shape[1]

    def store(r):
      if bits is None:
        return jnp.zeros((batch, capacity, g, r), dtype)
      sd = jnp.dtype(SCALE_DTYPE)
      return PackedLatent(
          codes=jnp.zeros((batch, capacity, g, packing.packed_bytes(r, bits)), jnp.uint8),
          scale=jnp.zeros((batch, capacity, g), sd), zero=jnp.zeros((batch, capacity, g), sd),
          bits=bits, dim=r)

    use_ring = bits is not None and window > 0
    ring = lambda r: jnp.zeros((batch, window, g, r), dtype) if use_ring else None
    # Own copies of the reconstruction weights: callers donate caches to jitted steps,
    # which must not invalidate the parameter buffers.
    own = lambda a: None if a is None else jnp.array(a, copy=True)
    return cls(hk=store(rk), hv=store(rv), ring_k=ring(rk), ring_v=ring(rv),
               lens=jnp.zeros((batch,), jnp.int32), bk=own(lp["palu_bk"]),
               bv=own(_per_kv_head_b(lp["palu_bv"], spec.n_kv_heads)),
               k_bias=own(lp.get("bk")), v_bias=own(lp.get("bv")),
               spec=spec, bits=bits, window=window if use_ring else 0,
               implementation=implementation)

  # -- protocol -------------------------------------------------------------

  @property
  def capacity(self) -> int:
    return self.batch_capacity()[1]

  @property
  def lengths(self):
    return self.lens

  def batch_capacity(self):
    """(B, S); a PackedLatent also carries its logical shape."""
    return tuple(self.hk.shape[:2])

  def update(self, inputs: base.AttnInputs, lp):
    pos = inputs.positions
    b, t = pos.shape
    g = self.bk.shape[0]
    hk = project(inputs.x, lp["palu_ak"]).reshape(b, t, g, -1)
    hv = project(inputs.x, lp["palu_av"]).reshape(b, t, g, -1)
    lens = base.new_lengths(self.lens, pos)
    ring_k, ring_v = self.ring_k, self.ring_v
    if self.window:
      # Only positions that are still inside the window after this update go to the
      # ring; they are distinct mod W, so the scatter has no duplicate slots.
      keep = (pos >= 0) & (pos >= lens[:, None] - self.window)
      ring_pos = jnp.where(keep, pos % self.window, -1)
      ring_k = base.scatter_slots(ring_k, hk, ring_pos)
      ring_v = base.scatter_slots(ring_v, hv, ring_pos)
    return dataclasses.replace(self, hk=self._write(self.hk, hk, pos),
                               hv=self._write(self.hv, hv, pos), ring_k=ring_k,
                               ring_v=ring_v, lens=lens)

  def kernel_candidates(self, q_shape):
    """The decode kernels for a query [B, N, H] (fastest first) with their fit checks."""
    b, n, h = q_shape
    args = lambda: (jax.ShapeDtypeStruct(q_shape, jnp.bfloat16), self.hk, self.hv,
                    self.bk, jax.ShapeDtypeStruct((b,), jnp.int32), self._kernel_bias())

    def fit(check):
      def go():
        if self.spec.rope_layout != "half":
          return f"{self.spec.rope_layout} RoPE (the kernels rotate half-layout keys)"
        return check(*args())
      return go

    return [("mosaic", "hopper", fit(palu_kernels.mosaic_fit)),
            ("triton", "gpu", fit(palu_kernels.triton_fit))]

  @property
  def sliding_window(self):
    return self.spec.sliding_window

  def _kernel_bias(self):
    if self.k_bias is None:
      return None
    return self.k_bias.reshape(self.bk.shape[0], self.bk.shape[2])

  def _attend_kernel(self, q, q_positions, lp, spec: ModelSpec, impl: str):
    """Decode attention of q [B, 1, N, H] through the fused kernel (+ the exact ring)."""
    n_kernel = self.lens
    if self.window:   # the ring's latents are exact: the kernel takes the older tokens
      n_kernel = jnp.maximum(self.lens - self.window, 0)
    out, lse = _kernel_attention(
        q[:, 0], self.hk, self.hv, self.bk, n_kernel,
        inv_freq=jnp.asarray(inv_frequencies(spec), jnp.float32), k_bias=self._kernel_bias(),
        out_dtype=jnp.float32, implementation=impl)
    out, lse = out[:, None], lse[:, None]
    if self.window:
      out, lse = combine([(out, lse), self._attend_ring(q, q_positions, spec)],
                         out_dtype=jnp.float32)
    out = self._value_output(out, lp, spec, q.dtype)
    return base.mask_padding_queries(out, lse, q_positions, q.dtype)

  def _attend_ring(self, q, q_positions, spec: ModelSpec):
    """Reference attention over the ring's exact latents (positions >= length − window)."""
    w = self.window
    start = (self.lens - w)[:, None]
    pos = start + jnp.mod(jnp.arange(w)[None, :] - start, w)          # ring slot i's position
    hk = self.ring_k.astype(jnp.float32)
    hv = self.ring_v.astype(jnp.float32)
    k = apply_rope(self._reconstruct_k(hk), jnp.maximum(pos, 0), spec)
    return dot_product_attention(q, k, hv[:, :, self._kv_group(spec)], q_positions, pos,
                                 pos >= 0,
                                 out_dtype=jnp.float32)

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    impl = self.decode_implementation(q.shape, implementation)
    if impl != dispatch.REFERENCE:
      return self._attend_kernel(q, q_positions, lp, spec, impl)
    k_pos, valid = self.slot_positions()
    hk, hv = self.latents()
    kv_group = self._kv_group(spec)
    # Each KV head reads its group's value latent; the output stays in latent space.
    v_lat = hv[:, :, kv_group]                                   # [B,S,K,r_v]
    if spec.rope_layout != "none":
      k = apply_rope(self._reconstruct_k(hk), k_pos, spec)       # [B,S,K,H] post-RoPE
      out, lse = dot_product_attention(q, k, v_lat, q_positions, k_pos, valid,
                                       sliding_window=spec.sliding_window,
                                       out_dtype=jnp.float32)
      return self._value_output(out, lp, spec, q.dtype), lse
    # No RoPE: score the latent directly with q B_kᵀ (Eq. 7 fold, see fold.py).
    b, t, n, h = q.shape
    kh = spec.n_kv_heads
    bh = _per_kv_head_b(self.bk.astype(jnp.float32), kh)        # [K, r_k, H]
    qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
    q_lat = jnp.einsum("btkgh,krh->btkgr", qg, bh, precision=jax.lax.Precision.HIGHEST)
    k_lat = hk[:, :, kv_group]                                   # [B,S,K,r_k]
    if self.k_bias is not None:
      bias = self.k_bias.astype(jnp.float32).reshape(kh, h)
      qb = jnp.einsum("btkgh,kh->btkg", qg, bias, precision=jax.lax.Precision.HIGHEST)
      q_lat = jnp.concatenate([q_lat, qb[..., None]], axis=-1)
      k_lat = jnp.concatenate([k_lat, jnp.ones(k_lat.shape[:-1] + (1,), k_lat.dtype)], -1)
    q_lat = q_lat.reshape(b, t, n, -1)
    out, lse = dot_product_attention(q_lat, k_lat, v_lat, q_positions, k_pos, valid,
                                     sliding_window=spec.sliding_window, scale=h ** -0.5,
                                     out_dtype=jnp.float32)
    return self._value_output(out, lp, spec, q.dtype), lse

  def _value_output(self, out, lp, spec: ModelSpec, dtype):
    """The latent output p · h_v [B,T,N,r_v] (fp32) as the layer's W_o reads it: unchanged
    where W_o has B_v folded in (N·r_v rows), else (p · h_v) B_v per head → [B,T,N,H]."""
    b, t, n, r = out.shape
    if lp["wo"].shape[0] == n * r:
      return out.astype(dtype)
    kh = spec.n_kv_heads
    # At the weights' dtype (the GPU accumulates in fp32): the folded path too rounds
    # p · h_v to the activation dtype before its W_o product.
    y = jnp.einsum("btkgr,krh->btkgh", out.reshape(b, t, kh, n // kh, r).astype(self.bv.dtype),
                   self.bv, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(b, t, n, -1).astype(dtype)

  def materialize(self):
    """(k [B,S,K,H] reconstructed + RoPE, v [B,S,K,H] reconstructed, valid [B,S])."""
    k_pos, valid = self.slot_positions()
    hk, hv = self.latents()
    k = apply_rope(self._reconstruct_k(hk), k_pos, self.spec)
    v = jnp.einsum("bskr,krh->bskh", hv[:, :, self._kv_group(self.spec)],
                   self.bv.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if self.v_bias is not None:
      v = v + self.v_bias.astype(jnp.float32).reshape(v.shape[2:])
    return k, v, valid

  def nbytes(self) -> int:
    """Bytes of per-sequence storage: latents/codes/scales, ring, lengths."""
    leaves = jax.tree.leaves((self.hk, self.hv, self.ring_k, self.ring_v, self.lens))
    return int(sum(x.size * x.dtype.itemsize for x in leaves))

  def weights_nbytes(self) -> int:
    leaves = jax.tree.leaves((self.bk, self.bv, self.k_bias, self.v_bias))
    return int(sum(x.size * x.dtype.itemsize for x in leaves))

  def bytes_per_token(self) -> float:
    """Storage per cached token of this layer (latents or codes + scale + zero)."""
    b, s = self.batch_capacity()
    leaves = jax.tree.leaves((self.hk, self.hv))
    return sum(x.size * x.dtype.itemsize for x in leaves) / (b * s)

  # -- helpers --------------------------------------------------------------

  def slot_positions(self):
    b, s = self.batch_capacity()
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return k_pos, k_pos < self.lens[:, None]

  def _write(self, store, h, pos):
    if self.bits is None:
      return base.scatter_slots(store, h, pos)
    pl = quantize_latent(h, self.bits, scale_dtype=jnp.dtype(SCALE_DTYPE))
    return dataclasses.replace(
        store, codes=base.scatter_slots(store.codes, pl.codes, pos),
        scale=base.scatter_slots(store.scale, pl.scale, pos),
        zero=base.scatter_slots(store.zero, pl.zero, pos))

  def _read(self, store, ring):
    if self.bits is None:
      return store.astype(jnp.float32)
    h = dequantize_latent(store)
    if ring is None:
      return h
    k_pos, _ = self.slot_positions()
    recent = k_pos >= self.lens[:, None] - self.window                # [B,S]
    from_ring = jnp.take(ring, k_pos[0] % self.window, axis=1).astype(jnp.float32)
    return jnp.where(recent[:, :, None, None], from_ring, h)

  def latents(self):
    """(h_k [B,S,G,r_k], h_v [B,S,G,r_v]) fp32 as attention sees them."""
    return self._read(self.hk, self.ring_k), self._read(self.hv, self.ring_v)

  def _kv_group(self, spec: ModelSpec):
    """[K]: the latent group of each KV head."""
    return jnp.arange(spec.n_kv_heads) // (spec.n_kv_heads // self.bk.shape[0])

  def _reconstruct_k(self, hk):
    """h_k [B,S,G,r_k] @ B_k [G,r_k,gs·H] → keys [B,S,K,H] (+ key bias), fp32, pre-RoPE.
    The key bias belongs to the reconstruction side and precedes RoPE."""
    bsz, s, _, _ = hk.shape
    y = jnp.einsum("bsgr,grn->bsgn", hk, self.bk.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(bsz, s, -1)
    if self.k_bias is not None:
      y = y + self.k_bias.astype(jnp.float32)
    return y.reshape(bsz, s, self.spec.n_kv_heads, self.spec.head_dim)


@base.register_cache("palu")
def _make_latent(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  """Per-layer LatentCaches for Palu-compressed `params` (kvlowrank.methods.palu.compress).

  `method_spec` is a PaluSpec (only `bits` and `window` are read here: ranks come
  from the compressed parameter shapes) or None for unquantized latents.
  """
  if isinstance(method_spec, Mapping):
    method_spec = PaluSpec(**method_spec)
  if method_spec is not None and not isinstance(method_spec, PaluSpec):
    raise ValueError(f"palu cache: method_spec must be a PaluSpec, got "
                     f"{type(method_spec).__name__}")
  layout_from_params(params, spec)  # clear error if params are not compressed
  bits = None if method_spec is None else method_spec.bits
  window = 0 if method_spec is None else method_spec.window
  impl = None if method_spec is None else method_spec.implementation
  return tuple(LatentCache.init(spec, lp, batch=batch, capacity=capacity, dtype=dtype,
                                bits=bits, window=window, implementation=impl)
               for lp in params["layers"])
