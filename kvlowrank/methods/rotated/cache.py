"""The FDC / ZACK rotated cache: post-RoPE keys and values in per-KV-head rotated bases,
truncated to ragged widths, attended in the reduced dimension.

Storage (per layer; the contract shared with the ragged decode kernel, kernels/rotated):
  k_rot [B, S, Σk] cache dtype: K'_g = RoPE(K_g) R_g[:, :k_g] for every KV head g, heads
        concatenated along the last axis (head g at offset Σ_{<g} k), no padding;
  v_rot [B, S, Σv]: V'_g = x A_g[:, :v_g] (FDC: Palu's latent; ZACK: V_g R_v[:, :v_g]);
  lens [B] int32; k_widths / v_widths: static tuples (pytree metadata);
  rk [K, H, k_max] / bv [K, v_max, H]: the layer's per-head rotations and reconstructions
        (`compression`), kept beside the storage; head g's first k_g columns / v_g rows are
        real, the rest zero. Queries and keys are rotated through all k_max columns and
        head g's k_g are sliced out statically and packed (`pack`), so K', V' and the
        kernel operands never carry the padding.
With `bits` set the same two arrays are stored quantized instead, KIVI-style (K' per channel
in groups of G tokens, V' per token in groups of G channels, the last R tokens exact), by
an inner KIVI cache (`kvlowrank.methods.kivi.cache.KiviCache` over one "head" of width Σk
for keys and Σv for values: per-channel and per-token groups never mix heads since every
width is a multiple of width_multiple or head_dim, both multiples of G; RotatedSpec and the
method's model check refuse anything else before calibration).

Attention (prefill and decode, any GQA ratio, ragged rows): the query is rotated per KV
head, q'_n = q_n R_{g(n)}[:, :k_g] (laid out [B, T, G, Σk] like the kernel's q_rot), and
each KV head's G query heads attend to their k_g-wide keys with the ORIGINAL softmax scale
1/sqrt(H) (the rotation preserves dot products; truncation only drops low-energy dims).
The output stays in the value space: head n's [v_g] output is zero-padded to
v_max = max_g v_g so the attention block's folded W_O' [N·v_max, D] applies unchanged
(`compress`); the padding is transient, never stored. Long prompts attend in query chunks
(`model.attention.dot_product_attention`), so no [T, S] fp32 score matrix is built at once.

Decode path: a decode step (T = 1) on a GPU runs the ragged-head kernel
(`kvlowrank_kernels.rotated.ragged_attention`, Triton: (request, KV head) tasks split along
the sequence, launched longest first) on k_rot / v_rot as stored; with quantized K'/V' its
twin `triton_ragged_quant` reads the inner store's planar codes over the quantized prefix
(dequantizing each tile) and the exact ring runs the jnp path (`_attend_kernel`); anything
else (CPU, prefill, widths or stores the kernels refuse) runs this jnp reference, the reason
logged once (`cache.dispatch`).

`nbytes()` counts what grows with the cache (k_rot, v_rot or the quantized store and its
exact window, lengths); the rotations and reconstructions are weights (`weights_nbytes`,
padded as stored).

Over a tensor-parallel mesh (`kvlowrank.parallel`; `shard_axes`, `for_spec`): K' and V'
split along their packed channel axis, the weights by KV head, in equal blocks, and one
traced body serves every device, so every device's heads must have the same widths:
`sharding.balance` permutes and zero-pads the heads so that they do, and `for_spec`
raises a one-line error naming it when they do not. Quantized K'/V'
(`RotatedSpec.bits`) split over the data axis only: the inner KIVI planar store packs
channels into bit planes and token blocks across the whole Σk / Σv row, so a device's
channel block is not a block of the stored arrays; on a model axis > 1 `for_spec` refuses
with a one-line error naming RotatedSpec.bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp

from kvlowrank.cache import base, dispatch
from kvlowrank.methods.kivi.cache import KiviCache, KiviSpec
from kvlowrank.methods.rotated import sharding
from kvlowrank.methods.rotated.spec import RotatedSpec, layout_from_params
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank.model.projection import project
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import rotated as rotated_kernels
from kvlowrank_kernels.rotated.reference import offsets, unpack

_HI = jax.lax.Precision.HIGHEST
# Jitted so that the layers' identical kernel calls are lowered once per model.
_kernel_attention = jax.jit(rotated_kernels.ragged_attention,
                            static_argnames=("k_widths", "v_widths", "scale", "out_dtype",
                                             "implementation", "heads_width"))
_quantized_attention = jax.jit(rotated_kernels.ragged_attention_quantized,
                               static_argnames=("k_widths", "v_widths", "scale", "out_dtype",
                                                "implementation", "heads_width"))
# Slots in whole 64-token tiles, as the dense and Palu caches (the decode kernels' blocks).
CAPACITY_MULTIPLE = 64


def pack(x, widths):
  """[..., K, W] → [..., Σw]: head g's first widths[g] columns, heads concatenated."""
  return jnp.concatenate([x[..., g, :w] for g, w in enumerate(widths)], axis=-1)


def rotation_product(spec: str, x, rk):
  """einsum(spec, x, rk) in float32. bf16 operands (both) are upcast and multiplied at DEFAULT
  precision: on a GPU a single TF32 (or bf16) pass, exact for them (bf16 values survive either
  rounding, and their products are float32 values; accumulation is float32), instead of the
  three to six passes of a HIGHEST-precision float32 GEMM; other dtypes at HIGHEST."""
  exact = x.dtype == rk.dtype == jnp.bfloat16
  return jnp.einsum(spec, x.astype(jnp.float32), rk.astype(jnp.float32),
                    precision=jax.lax.Precision.DEFAULT if exact else _HI)


def rotate_queries(q, rk, k_widths):
  """q [B, T, N, H] (RoPE applied) → q_rot [B, T, G, Σk] fp32 (query n = g_kv·G + g sits
  at [.., g, off_{g_kv}:...]), through the per-head rotations rk [K, H, k_max]."""
  b, t, n, h = q.shape
  kh = len(k_widths)
  qr = rotation_product("btkgh,khw->btgkw", q.reshape(b, t, kh, n // kh, h), rk)
  return pack(qr, k_widths)


def ragged_attention(q_rot, k_rot, v_rot, q_pos, k_pos, k_valid, *, k_widths, v_widths,
                     scale: float, sliding_window=None):
  """Attention of rotated queries over ragged-width heads (the jnp path of the cache).

  Args:
    q_rot: [B, T, G, Σk] rotated queries (see `rotate_queries`).
    k_rot: [B, S, Σk]; v_rot: [B, S, Σv] (any float dtype; math in fp32).
    q_pos [B, T], k_pos [B, S], k_valid [B, S]: as `dot_product_attention`.
    k_widths, v_widths: static per-KV-head widths.
    scale: softmax scale (1/sqrt(original head dim)).
  Returns:
    out [B, T, N, v_max] fp32 (head n = g_kv·G + g; columns >= v_{g_kv} are zero),
    lse [B, T, N] fp32.
  """
  vmax = max(v_widths)
  outs, lses = [], []
  for ko, kw, vo, vw in zip(offsets(k_widths), k_widths, offsets(v_widths), v_widths):
    o, l = dot_product_attention(
        q_rot[..., ko:ko + kw], k_rot[:, :, None, ko:ko + kw], v_rot[:, :, None, vo:vo + vw],
        q_pos, k_pos, k_valid, sliding_window=sliding_window, scale=scale,
        out_dtype=jnp.float32)                                     # [B, T, G, vw], [B, T, G]
    outs.append(jnp.pad(o, ((0, 0), (0, 0), (0, 0), (0, vmax - vw))))
    lses.append(l)
  b, t, g = lses[0].shape
  out = jnp.stack(outs, axis=2).reshape(b, t, len(k_widths) * g, vmax)
  return out, jnp.stack(lses, axis=2).reshape(b, t, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RotatedCache(base.KVCache):
  """One layer of rotated K' / V' (module docstring)."""

  k_rot: Optional[jax.Array]    # [B, S, Σk] (None when quantized)
  v_rot: Optional[jax.Array]    # [B, S, Σv]
  quant: Optional[Any]          # inner KiviCache holding K', V' quantized (bits set)
  lens: jax.Array               # [B] int32
  rk: jax.Array                 # [K, H, k_max] key rotations per head (weights)
  bv: jax.Array                 # [K, v_max, H] value reconstructions (materialize only)
  v_bias: Optional[jax.Array]   # [K·H] (materialize only; folded into bo for attention)
  spec: ModelSpec = base.static_field()
  k_widths: tuple = base.static_field(default=())
  v_widths: tuple = base.static_field(default=())
  implementation: Optional[str] = base.static_field(default=None)

  name = "rotated"

  @classmethod
  def init(cls, spec: ModelSpec, lp: dict, *, batch: int, capacity: int,
           dtype=jnp.bfloat16, rspec: Optional[RotatedSpec] = None):
    """Empty cache for one compressed layer `lp` (needs rot_rk, rot_bv, rot_kw, rot_vw)."""
    rspec = RotatedSpec() if rspec is None else rspec
    if lp["rot_rk"].ndim != 3:
      raise ValueError(f"params 'rot_rk' of shape {tuple(lp['rot_rk'].shape)} is the old "
                       f"block-diagonal layout: re-run the FDC/ZACK compression (per-head "
                       f"rot_rk [K, H, k_max])")
    kw = tuple(int(x) for x in jax.device_get(lp["rot_kw"]))
    vw = tuple(int(x) for x in jax.device_get(lp["rot_vw"]))
    own = lambda a: None if a is None else jnp.array(a, copy=True)
    capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
    k_rot = v_rot = quant = None
    if rspec.bits is None:
      k_rot = jnp.zeros((batch, capacity, sum(kw)), dtype)
      v_rot = jnp.zeros((batch, capacity, sum(vw)), dtype)
    else:
      # The inner cache's implementation only picks its decode update (its attention is never
      # called: `_attend_kernel` reads its store): the fused planar update
      # (`kivi.triton_update_planar`) on a GPU unless this spec asks for the reference.
      inner_impl = dispatch.REFERENCE if rspec.implementation == dispatch.REFERENCE else None
      kspec = KiviSpec(bits=rspec.bits, group_size=rspec.group_size, residual=rspec.residual,
                       layout="planar", implementation=inner_impl)
      pseudo = spec.replace(n_heads=1, n_kv_heads=1, head_dim=sum(kw), rope_layout="none")
      quant = KiviCache.init(kspec, pseudo, batch=batch, capacity=capacity, dtype=dtype,
                             v_head_dim=sum(vw))
    return cls(k_rot=k_rot, v_rot=v_rot, quant=quant, lens=jnp.zeros((batch,), jnp.int32),
               rk=own(lp["rot_rk"]), bv=own(lp["rot_bv"]), v_bias=own(lp.get("bv")),
               spec=spec, k_widths=kw, v_widths=vw, implementation=rspec.implementation)

  # -- protocol -------------------------------------------------------------

  def shard_axes(self) -> dict:
    """K' / V' split along their packed channels (device-major heads, equal blocks once
    `sharding.balance`d), the per-head weights by KV head; the quantized store (`bits`) by
    batch row only (module docstring)."""
    return {".k_rot": (0, 2), ".v_rot": (0, 2), ".quant": (0, None), ".lens": (0, None),
            ".rk": (None, 0), ".bv": (None, 0), ".v_bias": (None, 0)}

  def for_spec(self, spec: ModelSpec) -> "RotatedCache":
    """This cache with `spec` and the widths of its heads: a device's block of the global
    heads (every device's must be equal: `sharding.balance`) or, back, the global heads."""
    n, m = len(self.k_widths), spec.n_kv_heads
    if m == n:
      return dataclasses.replace(self, spec=spec)
    if m > n:                          # local → global: every device holds the same widths
      tp = m // n
      return dataclasses.replace(self, spec=spec, k_widths=self.k_widths * tp,
                                 v_widths=self.v_widths * tp)
    tp = n // m
    if self.quant is not None:
      raise ValueError(f"RotatedSpec.bits={self.quant.k_bits}: quantized K'/V' do not split "
                       f"over mesh model={tp} devices (the KIVI planar store packs channels "
                       f"across devices' blocks); use bits=None or a mesh with model=1")
    if why := sharding.unbalanced(self.k_widths, self.v_widths, tp):
      raise ValueError(why)
    return dataclasses.replace(self, spec=spec, k_widths=self.k_widths[:m],
                               v_widths=self.v_widths[:m])

  @property
  def capacity(self) -> int:
    return self.quant.capacity if self.quant is not None else self.k_rot.shape[1]

  @property
  def lengths(self):
    return self.lens

  @property
  def sliding_window(self):
    return self.spec.sliding_window

  def rotate_keys(self, k):
    """Post-RoPE keys [B, T, K, H] → K' [B, T, Σk] fp32."""
    return pack(rotation_product("btkh,khw->btkw", k, self.rk), self.k_widths)

  def update(self, inputs: base.AttnInputs, lp):
    pos = inputs.positions
    kr = self.rotate_keys(inputs.k)
    vr = project(inputs.x, lp["rot_av"])
    lens = base.new_lengths(self.lens, pos)
    if self.quant is not None:
      inner = base.AttnInputs(x=inputs.x, k=kr[:, :, None], k_pre=kr[:, :, None],
                              v=vr[:, :, None], positions=pos)
      # Checked above against this cache's capacity (= the store's); an eviction wrapper
      # may hand more columns than slots, the surplus padding (`base.update_unchecked`).
      return dataclasses.replace(self, quant=base.update_unchecked(self.quant, inner, lp),
                                 lens=lens)
    return dataclasses.replace(self, k_rot=base.scatter_slots(self.k_rot, kr, pos),
                               v_rot=base.scatter_slots(self.v_rot, vr, pos), lens=lens)

  def kernel_candidates(self, q_shape):
    """The ragged-head Triton kernel for a query [B, N, H], with its fit check (quantized
    K'/V': the kernel reading the store's codes, `quantized_fit`: 2/4 bits, group_size 16)."""
    b, n, _ = q_shape
    def fit():
      g = n // len(self.k_widths)
      if self.quant is not None:
        st = self.quant.store
        return rotated_kernels.quantized_fit((b, g, sum(self.k_widths)), st.keys, st.values,
                                             self.k_widths, self.v_widths,
                                             self.quant.k_res.dtype)
      return rotated_kernels.triton_fit((b, g, sum(self.k_widths)), self.k_widths,
                                        self.v_widths, self.k_rot.dtype, self.capacity)
    return [("triton", "gpu", fit)]

  def _attend_kernel(self, q, q_positions, spec: ModelSpec, impl: str):
    """One decode query per row through the ragged kernel: (out [B,1,N,v_max], lse).
    Quantized K'/V' (`bits`): the kernel reads the inner store's planar codes and
    dequantizes each tile (`ragged_attention_quantized`: the 16-bit values the jnp path
    attends) over the quantized prefix [0, m); the exact ring of the last tokens runs the
    jnp path, and the two merge by their LSE."""
    b, _, n, _ = q.shape
    vmax = max(self.v_widths)
    q_rot = rotate_queries(q, self.rk, self.k_widths)
    kw = dict(k_widths=self.k_widths, v_widths=self.v_widths, scale=spec.head_dim ** -0.5,
              out_dtype=q.dtype, implementation=impl, heads_width=vmax)
    if self.quant is None:
      out, lse = _kernel_attention(q_rot[:, 0].astype(self.k_rot.dtype), self.k_rot,
                                   self.v_rot, self.lens, **kw)      # [B, K, G, v_max]
    else:                        # the quantized prefix [0, m), read as codes by the kernel
      m, _ = self.quant.segments()
      st = self.quant.store
      out, lse = _quantized_attention(q_rot[:, 0].astype(self.quant.k_res.dtype), st.keys,
                                      st.values, m, **kw)
    out, lse = out.reshape(b, 1, n, vmax), lse.reshape(b, 1, n)      # head n = h·G + g
    if self.quant is not None:
      out, lse = combine([(out, lse), self._ring_attention(q_rot, q_positions, spec)],
                         out_dtype=q.dtype)
    return base.mask_padding_queries(out, lse, q_positions, q.dtype)

  def _ring_attention(self, q_rot, q_positions, spec: ModelSpec):
    """Quantized K'/V': the jnp attention over the exact ring of the last tokens."""
    qc = self.quant
    _, w_len = qc.segments()
    ring_pos = qc._ring_positions(qc.lens)  # pylint: disable=protected-access
    ring_ok = jnp.arange(qc.flush_block)[None, :] < w_len[:, None]
    return ragged_attention(q_rot, qc.k_res[:, :, 0], qc.v_res[:, :, 0], q_positions,
                            ring_pos, ring_ok, k_widths=self.k_widths, v_widths=self.v_widths,
                            scale=spec.head_dim ** -0.5, sliding_window=spec.sliding_window)

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    impl = self.decode_implementation(q.shape, implementation)
    if impl != dispatch.REFERENCE:
      return self._attend_kernel(q, q_positions, spec, impl)
    q_rot = rotate_queries(q, self.rk, self.k_widths)
    kw = dict(k_widths=self.k_widths, v_widths=self.v_widths, scale=spec.head_dim ** -0.5,
              sliding_window=spec.sliding_window)
    if self.quant is None:
      k_pos, valid = self.slot_positions()
      out, lse = ragged_attention(q_rot, self.k_rot, self.v_rot, q_positions, k_pos, valid,
                                  **kw)
      return out.astype(q.dtype), lse
    # Quantized: the dequantized prefix [0, m) and the exact ring, merged by their LSE.
    m, _ = self.quant.segments()
    k_hat, v_hat = self.quant.dequantized()
    b, s = k_hat.shape[:2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    prefix = ragged_attention(q_rot, k_hat[:, :, 0], v_hat[:, :, 0], q_positions, s_pos,
                              s_pos < m[:, None], **kw)
    return combine([prefix, self._ring_attention(q_rot, q_positions, spec)], out_dtype=q.dtype)

  def stored(self):
    """(K' [B, S, Σk], V' [B, S, Σv]) fp32 as attention sees them."""
    if self.quant is None:
      return self.k_rot.astype(jnp.float32), self.v_rot.astype(jnp.float32)
    k, v, _ = self.quant.materialize()
    return k[:, :, 0].astype(jnp.float32), v[:, :, 0].astype(jnp.float32)

  def materialize(self):
    """(k [B,S,K,H] = K' R_pᵀ (post-RoPE, projected), v [B,S,K,H] = V' B (+ bias), valid)."""
    kr, vr = self.stored()
    k = jnp.einsum("bskw,khw->bskh", unpack(kr, self.k_widths, self.rk.shape[-1]),
                   self.rk.astype(jnp.float32), precision=_HI)
    v = jnp.einsum("bskw,kwh->bskh", unpack(vr, self.v_widths, self.bv.shape[1]),
                   self.bv.astype(jnp.float32), precision=_HI)
    if self.v_bias is not None:
      v = v + self.v_bias.astype(jnp.float32).reshape(v.shape[2:])
    _, valid = self.slot_positions()
    return k, v, valid

  def nbytes(self) -> int:
    """Bytes of per-sequence storage: K', V' (or the quantized store + window), lengths."""
    leaves = jax.tree.leaves((self.k_rot, self.v_rot, self.quant, self.lens))
    return int(sum(x.size * x.dtype.itemsize for x in leaves))

  def weights_nbytes(self) -> int:
    """Bytes of the weights kept beside the storage, as stored (rk / bv padded per head)."""
    leaves = jax.tree.leaves((self.rk, self.bv, self.v_bias))
    return int(sum(x.size * x.dtype.itemsize for x in leaves))

  def bytes_per_token(self) -> float:
    """Storage per cached token of this layer (K' + V', or codes + amortised scales)."""
    if self.quant is not None:
      return self.quant.bytes_per_token()
    return float(self.k_rot.shape[-1] * self.k_rot.dtype.itemsize
                 + self.v_rot.shape[-1] * self.v_rot.dtype.itemsize)

  def slot_positions(self):
    b, s = self.lens.shape[0], self.capacity
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return k_pos, k_pos < self.lens[:, None]


def _make_rotated(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  """Per-layer RotatedCaches for FDC/ZACK-compressed `params` (widths from the params).
  Registered as "rotated" and under the method names "fdc" and "zack" (the recipes differ
  offline only), so wrappers that build their inner cache by method name find it."""
  if isinstance(method_spec, Mapping):
    method_spec = RotatedSpec(**method_spec)
  if method_spec is not None and not isinstance(method_spec, RotatedSpec):
    raise ValueError(f"rotated cache: method_spec must be a RotatedSpec, got "
                     f"{type(method_spec).__name__}")
  layout_from_params(params, spec.head_dim)   # clear error if params are not compressed
  return tuple(RotatedCache.init(spec, lp, batch=batch, capacity=capacity, dtype=dtype,
                                 rspec=method_spec) for lp in params["layers"])


for _name in ("rotated", "fdc", "zack"):
  base.register_cache(_name)(_make_rotated)
