"""KIVI cache (Liu et al., ICML'24): 2/4-bit K per-channel, V per-token, exact residual.

Algorithm (KIVI §3.3-3.4 / Alg. 1, following jy-yuan/KIVI `models/llama_kivi.py`):
  * Keys are stored post-RoPE (as KIVI does) and quantized PER CHANNEL: each of the
    H channels of a kv head gets one (scale, zero) per group of G consecutive tokens.
    Keys stay exact in a buffer until R tokens accumulate, then the whole R-token
    block is quantized at once and the buffer is cleared (R % G == 0). Hence at
    length L the quantized keys are positions [0, floor(L/R)*R) — KIVI's prefill
    quantizes floor(T/R)*R tokens and keeps T mod R exact; decode flushes whenever
    the buffer reaches R.
  * Values are quantized PER TOKEN in groups of G channels and kept in a sliding
    window: the last R tokens stay exact; a token leaving the window is quantized.
    At length L the quantized values are positions [0, max(0, L - R)).
  * Quantizer: the project's one quantizer (`kvlowrank_kernels.quant`: asymmetric
    min/max, scale/zero in `scale_dtype`, fp16 by default like KIVI).

Storage (preallocated, per layer): the quantized store is kept in its decode kernel's
layout (`kvlowrank_kernels.kivi.store`), so a decode step hands the cache's arrays to the
kernel as they are:
  * "warp" (2-bit keys and values, G = 32, head dim 128, fp16/bf16 scales): the Mosaic
    warp kernel's fragment order, capacity rounded up to a multiple of 128;
  * "planar" (everything else): the Triton kernel's head-major planar rows, capacity
    rounded up to a multiple of lcm(G, 32).
  k_res/v_res [B,F,K,H] ring buffers (cache dtype) hold the last F tokens (F = R, or F = G
  when R = 0: keys always need an exact buffer until a group of G tokens completes) AS
  ATTENTION SEES THEM: exact, or dequantized once a token's key (value) is quantized; lens
  [B]; k_stage [B,F,K,H] (cache dtype): the staged key flush's dequantized keys.
  Staged key flush: a key group's codes depend only on its own G tokens, so the groups of
  the block in progress are quantized as they fill, not all at once when the block
  completes. Each decode step re-quantizes the one group its token belongs to (G tokens of
  the ring), writes its codes and scales into the store at their final slots (which
  attention does not read before the block completes: the store is read over [0, m)) and
  its dequantized keys into k_stage; when a row's block completes, its ring keys become
  k_stage. The codes are exactly KIVI's block flush (the last write of each group sees its
  G tokens), at 1/(F/G) of the block's quantization work per step and without a
  `lax.cond`, which would stop the GPU stream while the host reads its predicate.
  Slot s of the quantized store holds position s; ring slot i holds the position
  p = i (mod F) among the last F. With the KIVI rules below, the tokens that are not in
  the quantized prefix [0, m) (m = min of the two quantized prefixes) are exactly ring
  slots [0, L - m): the kernels' exact window is the ring as stored.

`update` of T > 1 tokens (prefill) assembles the exact values of positions
[L0 - F, L0 + T) (ring + new tokens), quantizes every candidate key group / value token
of that window, and scatters only those whose quantization KIVI's rules make due (masked
writes, no Python branching on traced lengths). A decode token (T = 1) takes a shorter
path with the same result (`_decode_update`, the jnp reference): it writes its ring slot,
quantizes the one value that leaves the window and the one key group that the token belongs
to (staged key flush, below), with no `lax.cond`. On a GPU that path is one Triton launch per
layer (`kvlowrank_kernels.kivi.triton_update` on the warp layout, `triton_update_planar` on
the planar one at 2, 4 or 8 bits; the same codes; the jnp version runs some twenty small XLA
ops), unless the spec's implementation is "reference". Rows are ragged: each row's new
tokens must continue its own sequence (positions lens[b], lens[b]+1, ...; -1 = padding
anywhere; positions >= capacity are dropped like padding).

Attention reads the post-update cache: tokens [0, m) from the quantized store and ring
slots [0, L - m); the two segments are merged by their log-sum-exp. A decode step (T = 1)
on a GPU runs the fused kernel (`kvlowrank_kernels.kivi.kivi_attention`: Mosaic warp
kernel on the warp layout, Triton on planar 2/4-bit); anything else runs the jnp
reference below (prefill attends the dequantized store in query chunks, see
`model.attention`), with the reason logged once (`cache.dispatch`).

Deviations from the KIVI code (documented, deliberate):
  1. Prefill: KIVI runs exact flash attention over the prompt; here prompt queries
     attend to the compressed cache (quantized older tokens + exact window), so a
     one-pass perplexity measures the quantization error (as XQuant's KIVI*).
  2. Decode: KIVI attends *before* flushing (the query sees R+1 exact values, and on a
     flush step R exact keys); here attention follows the update, so the value leaving
     the window and, on a flush step, the block's keys are already quantized.
  3. The jnp reference dequantizes in fp32 (code * scale + zero from the stored fp16
     scale/zero) and casts to the cache dtype; the kernels dequantize in fp16/bf16, as
     KIVI's own kernels do.
  4. R = 0 is allowed (KIVI divides by R): values are quantized immediately, keys
     once a G-group completes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base, dispatch
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import kivi as kivi_kernels
from kvlowrank_kernels.kivi import store as kstore
from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import (canonical_scale_dtype, dequantize_codes,
                                               quantize_codes)

IMPLEMENTATIONS = ("mosaic", "triton")   # the kernels, fastest first (besides "reference")
# Jitted so that the layers' identical kernel calls are lowered (and the Mosaic kernel
# compiled) once per model, not once per layer.
_kernel_attention = jax.jit(kivi_kernels.kivi_attention,
                            static_argnames=("scale", "out_dtype", "implementation"))
LAYOUTS = ("auto",) + kstore.LAYOUTS


@dataclasses.dataclass(frozen=True)
class KiviSpec:
  """KIVI knobs (defaults: README / LongBench scripts of jy-yuan/KIVI: 2-bit, G=32, R=128).

  bits: key bits (2/3/4/8); v_bits: value bits (None = same as bits);
  group_size G: tokens per key group and channels per value group;
  residual R: exact window length (multiple of G, may be 0);
  scale_dtype: dtype of scales and zero points (float16 | bfloat16 | float32);
  layout: storage layout of the quantized store, "auto" (the warp layout where it applies
    and a Hopper GPU runs the Mosaic kernel that reads it, else planar: the Triton kernel's),
    "warp" or "planar" (`kvlowrank_kernels.kivi.store`; both hold the same codes);
  implementation: None (the fastest that fits: `cache.dispatch`), "reference", "mosaic" or
    "triton".
  """

  bits: int = 2
  group_size: int = 32
  residual: int = 128
  v_bits: Optional[int] = None
  scale_dtype: str = "float16"
  layout: str = "auto"
  implementation: Optional[str] = None

  def __post_init__(self):
    packing.check_bits(self.bits, "KiviSpec.bits")
    if self.v_bits is not None:
      packing.check_bits(self.v_bits, "KiviSpec.v_bits")
    g = self.group_size
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0:
      raise ValueError(f"KiviSpec.group_size must be a positive int, got {g!r}")
    r = self.residual
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
      raise ValueError(f"KiviSpec.residual must be an int >= 0, got {r!r}")
    if r % g:
      raise ValueError(f"KiviSpec.residual ({r}) must be a multiple of KiviSpec.group_size "
                       f"({g}): keys are flushed in R-token blocks of whole G-token groups")
    object.__setattr__(self, "scale_dtype",
                       canonical_scale_dtype(self.scale_dtype, "KiviSpec.scale_dtype"))
    if self.layout not in LAYOUTS:
      raise ValueError(f"KiviSpec.layout must be one of {LAYOUTS}, got {self.layout!r}")
    if self.implementation not in (None, dispatch.REFERENCE) + IMPLEMENTATIONS:
      raise ValueError(f"KiviSpec.implementation must be None, 'reference' or one of "
                       f"{IMPLEMENTATIONS}, got {self.implementation!r}")

  @property
  def value_bits(self) -> int:
    return self.bits if self.v_bits is None else self.v_bits

  @property
  def flush_block(self) -> int:
    """F: key flush block and ring length (R, or G when R = 0)."""
    return self.residual if self.residual > 0 else self.group_size

  def store_layout(self, head_dim: int) -> str:
    """The quantized store's layout for a model of this head dim (ValueError naming
    KiviSpec.layout when "warp" is asked for where it does not apply)."""
    cfg = dict(k_bits=self.bits, v_bits=self.value_bits, group=self.group_size,
               head_dim=head_dim, scale_dtype=self.scale_dtype)
    if self.layout == "auto":
      return "warp" if (kstore.warp_fit(**cfg) is None
                        and dispatch.Platform.detect().hopper) else "planar"
    if self.layout == "warp":
      why = kstore.warp_fit(**cfg)
      if why is not None:
        raise ValueError(f"KiviSpec.layout='warp' does not hold {why}")
    return self.layout


_rows, _scatter_rows = base.gather_rows, base.scatter_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviCache(base.KVCache):
  store: Any           # kvlowrank_kernels.kivi.store: KiviMosaic ("warp") or PlanarStore
  k_res: jax.Array     # [B, F, K, H] keys of the last F tokens as attention sees them (ring)
  v_res: jax.Array     # [B, F, K, H]
  lens: jax.Array      # [B] int32
  k_stage: jax.Array   # [B, F, K, H] staged key flush: dequantized keys of the block's groups
  k_bits: int = base.static_field(default=2)
  v_bits: int = base.static_field(default=2)
  group_size: int = base.static_field(default=32)
  residual: int = base.static_field(default=128)
  sliding_window: Optional[int] = base.static_field(default=None)
  implementation: Optional[str] = base.static_field(default=None)

  name = "kivi"

  def shard_axes(self) -> dict:
    """Codes and scales of both layouts ([B, K, ...]) and the ring split by KV head."""
    return {".store": (0, 1), ".k_res": (0, 2), ".v_res": (0, 2), ".lens": (0, None),
            ".k_stage": (0, 2)}

  @classmethod
  def init(cls, kspec: KiviSpec, spec: ModelSpec, *, batch: int, capacity: int,
           dtype=jnp.bfloat16, v_head_dim: Optional[int] = None):
    """Allocates an empty cache for `capacity` positions (rounded up to the store's
    capacity multiple). `v_head_dim`: values narrower/wider than the keys (planar layout;
    the FDC/ZACK rotated cache stores its K' and V' through this class)."""
    g, h, kh = kspec.group_size, spec.head_dim, spec.n_kv_heads
    hv = h if v_head_dim is None else v_head_dim
    if h % g or hv % g:
      raise ValueError(f"KiviSpec.group_size ({g}) must divide head_dim ({h}, values {hv}): "
                       f"values are quantized per token in groups of group_size channels")
    layout = kspec.store_layout(h) if hv == h else "planar"
    m = kstore.capacity_multiple(layout, g)
    s = -(-capacity // m) * m
    f = kspec.flush_block
    store = kstore.empty(layout, batch=batch, kv_heads=kh, capacity=s, head_dim=h,
                         k_bits=kspec.bits, v_bits=kspec.value_bits, group=g,
                         scale_dtype=kspec.scale_dtype, v_head_dim=hv)
    z = jnp.zeros
    return cls(store=store, k_res=z((batch, f, kh, h), dtype), v_res=z((batch, f, kh, hv), dtype),
               lens=z((batch,), jnp.int32), k_stage=z((batch, f, kh, h), dtype),
               k_bits=kspec.bits, v_bits=kspec.value_bits,
               group_size=g, residual=kspec.residual, sliding_window=spec.sliding_window,
               implementation=kspec.implementation)

  @property
  def capacity(self) -> int:
    return kstore.capacity(self.store)

  @property
  def lengths(self):
    return self.lens

  @property
  def flush_block(self) -> int:
    return self.k_res.shape[1]

  @property
  def layout(self) -> str:
    return "planar" if isinstance(self.store, kstore.PlanarStore) else "warp"

  def _n_quantized(self, lens):
    """(keys quantized [0, nqk), values quantized [0, nqv)) at lengths `lens`."""
    f = self.flush_block
    return (lens // f) * f, jnp.maximum(lens - self.residual, 0)

  def update(self, inputs: base.AttnInputs, lp):
    g, f, r, cap = self.group_size, self.flush_block, self.residual, self.capacity
    b, t = inputs.positions.shape
    pos = jnp.where((inputs.positions >= 0) & (inputs.positions < cap), inputs.positions, -1)
    if t == 1:
      impl, why = self.update_implementation()
      dispatch.log_once(self.name, impl, why, what="decode update")
      if impl == "triton":
        return self._fused_decode_update(inputs, pos[:, 0])
      return self._decode_update(inputs, pos[:, 0])
    l0 = self.lens
    l1 = base.new_lengths(l0, pos)
    nqk0, nqv0 = self._n_quantized(l0)
    nqk1, nqv1 = self._n_quantized(l1)
    # Window E: slot j holds position l0 - f + j (ring for j < f, then new tokens), each
    # as attention sees it (the ring already is; new tokens are exact until quantized).
    lw = -(-(f + t) // g) * g           # key-window length: covers [nqk0, l0 + t)
    e_len = f + lw
    e_pos = l0[:, None] - f + jnp.arange(e_len)[None, :]
    in_ring = (jnp.arange(e_len)[None, :] < f) & (e_pos >= 0)
    new_slot = jnp.where(pos >= 0, pos - l0[:, None] + f, e_len)

    def window(ring, new):
      e = jnp.where(in_ring[..., None, None], _rows(ring, jnp.mod(e_pos, f)), 0)
      return _scatter_rows(e.astype(ring.dtype), new_slot, pos >= 0, new)

    ek, ev = window(self.k_res, inputs.k), window(self.v_res, inputs.v)
    sd = jnp.dtype(self._scale_dtype())
    dt = self.k_res.dtype
    # Keys: per-channel groups of G tokens over window positions [nqk0, nqk0 + lw); only
    # the groups inside the newly flushed blocks [nqk0, nqk1) are written.
    kw_idx = (nqk0 - l0 + f)[:, None] + jnp.arange(lw)[None, :]

    def flush(store, ek):
      kc, ks, kz = quantize_codes(_rows(ek, kw_idx), bits=self.k_bits, axis=1, group_size=g,
                                  scale_dtype=sd)
      tok = nqk0[:, None] + jnp.arange(lw)[None, :]
      grp = nqk0[:, None] // g + jnp.arange(lw // g)[None, :]
      tok_ok, grp_ok = tok < nqk1[:, None], (grp + 1) * g <= nqk1[:, None]
      store = kstore.write_keys(store, grp, grp_ok, kc, ks, kz)
      k_seen = dequantize_codes(kc, ks, kz, axis=1, group_size=g, dtype=dt)
      return store, _scatter_rows(ek, kw_idx, tok_ok, k_seen)

    # Calls that complete no key block (short chunks of a chunked prefill) skip the work.
    store, ek = jax.lax.cond(jnp.any(nqk1 > nqk0), flush, lambda st, e: (st, e), self.store, ek)
    # Values: per-token groups of G channels; positions [l0 - r, l0 - r + t) may leave
    # the window in this step; those in [nqv0, nqv1) are written.
    v_idx = (f - r) + jnp.arange(t)[None, :]
    vc, vs, vz = quantize_codes(ev[:, f - r:f - r + t], bits=self.v_bits, axis=-1,
                                group_size=g, scale_dtype=sd)
    vpos = (l0 - r)[:, None] + jnp.arange(t)[None, :]
    v_ok = (vpos >= nqv0[:, None]) & (vpos < nqv1[:, None])
    store = kstore.write_values(store, jnp.maximum(vpos, 0), v_ok, vc, vs, vz)
    v_seen = dequantize_codes(vc, vs, vz, axis=-1, group_size=g, dtype=dt)
    ev = _scatter_rows(ev, jnp.broadcast_to(v_idx, (b, t)), v_ok, v_seen)
    # Ring: slot i <- position p_i = i (mod f) among [l1 - f, l1), read from E.
    p = self._ring_positions(l1)
    e_idx = p - l0[:, None] + f
    k_res = _rows(ek, e_idx)
    # Staged flush (module docstring): the block in progress, positions [nqk1, l1), is ring
    # slots [0, l1 - nqk1); its complete groups are written now, the decode steps write
    # the rest as they fill. k_stage takes every slot's dequantized group (a group that is
    # incomplete, or of the previous block, is re-staged before its block completes).
    kc, ks, kz = quantize_codes(k_res, bits=self.k_bits, axis=1, group_size=g, scale_dtype=sd)
    grp = (nqk1 // g)[:, None] + jnp.arange(f // g)[None, :]
    done = (jnp.arange(1, f // g + 1)[None, :] * g <= (l1 - nqk1)[:, None])
    store = kstore.write_keys(store, grp, done, kc, ks, kz)
    k_stage = dequantize_codes(kc, ks, kz, axis=1, group_size=g, dtype=dt)
    return dataclasses.replace(self, store=store, k_res=k_res, v_res=_rows(ev, e_idx),
                               lens=l1, k_stage=k_stage)

  def update_implementation(self, platform=None) -> tuple[str, Optional[str]]:
    """What a decode step's update runs: "triton" (`kivi.triton_update`, one launch) or the
    jnp "reference" (`_decode_update`), with the reason when it is the reference on a GPU.
    The cache's `implementation` "reference" keeps the jnp update; otherwise the fused update
    runs wherever it fits (warp layout, or planar at 2/4/8 bits; R > 0, a bf16/fp16 ring;
    `store.fused_update_fit`)."""
    if self.implementation == dispatch.REFERENCE:
      return dispatch.REFERENCE, None
    platform = dispatch.Platform.detect() if platform is None else platform
    if not platform.gpu:
      return dispatch.REFERENCE, None
    why = kstore.fused_update_fit(self.store, self.k_res, self.residual)
    if why is None and not platform.triton:
      why = "jax-triton is not installed"
    return (dispatch.REFERENCE, f"triton: {why}") if why else ("triton", None)

  def _fused_decode_update(self, inputs: base.AttnInputs, pos):
    """`_decode_update` in one Triton launch, in place (`kivi.triton_update`). The new
    lengths are computed here, from the step's inputs, not by the launch: so XLA runs them
    (and the attention's segments from them) inside its CUDA graph before the launch; as the
    launch's output they took a copy into the loop's buffer and a segments fusion after it,
    two more launches outside the graphs per layer (results/decode_ablations.md). The launch
    reads these new lengths, not the old ones: while it read the old ones, XLA copied them
    before the new ones took their loop buffer (results/decode_ablations.md)."""
    from kvlowrank_kernels.kivi.triton_update import decode_update_triton  # pylint: disable=C0415
    l1 = base.new_lengths(self.lens, pos[:, None])
    store, k_res, v_res, k_stage = decode_update_triton(
        self.store, self.k_res, self.v_res, self.k_stage, l1, pos, inputs.k[:, 0],
        inputs.v[:, 0], residual=self.residual)
    return dataclasses.replace(self, store=store, k_res=k_res, v_res=v_res, lens=l1,
                               k_stage=k_stage)

  def _decode_update(self, inputs: base.AttnInputs, pos):
    """`update` for one new token per row (pos [B], -1 = padding): the same result as the
    windowed path above, touching only the ring slot the token takes, the value leaving the
    window and the key group the token belongs to.

    With the ring's invariant (slot i holds position i mod F), the new token at position
    l0 takes slot l0 mod F, whose old occupant l0 - F is the value that leaves the window
    now (R > 0, so F = R; with R = 0 the new value itself is quantized at once). Its key
    group is ring slots [G j, G j + G) for j = (l0 mod F) // G: re-quantized, written to
    the store and staged (module docstring). When l0 + 1 is a multiple of F the block is
    complete and every one of its groups was staged when its last token came: the ring's
    keys become the staged ones. The step's quantization work is one group per row,
    whatever the ring's size, and nothing waits on the host (no `lax.cond`)."""
    g, f, r = self.group_size, self.flush_block, self.residual
    valid = pos >= 0
    l1 = base.new_lengths(self.lens, pos[:, None])
    due = valid & (jnp.mod(l1, f) == 0)           # this token completes a key block
    sd = jnp.dtype(self._scale_dtype())
    dt = self.k_res.dtype
    slot = jnp.mod(pos, f)[:, None]                            # [B, 1]
    k_new, v_new = inputs.k.astype(dt), inputs.v.astype(dt)    # [B, 1, K, H]
    # The value quantized now: position pos - R (the slot's old occupant; R = 0: the new one).
    vpos = pos - r
    v_out = _rows(self.v_res, slot) if r > 0 else v_new
    vc, vs, vz = quantize_codes(v_out, bits=self.v_bits, axis=-1, group_size=g,
                                scale_dtype=sd)
    v_ok = valid & (vpos >= 0)
    store = kstore.write_values(self.store, jnp.maximum(vpos, 0)[:, None], v_ok[:, None],
                                vc, vs, vz)
    if r == 0:
      v_new = dequantize_codes(vc, vs, vz, axis=-1, group_size=g, dtype=dt)
    k_res = _scatter_rows(self.k_res, slot, valid[:, None], k_new)
    v_res = _scatter_rows(self.v_res, slot, valid[:, None], v_new)
    # The token's key group: quantized from the ring, written at its final slots, staged.
    g_idx = (slot // g) * g + jnp.arange(g)[None, :]          # [B, G] ring slots
    kc, ks, kz = quantize_codes(_rows(k_res, g_idx), bits=self.k_bits, axis=1, group_size=g,
                                scale_dtype=sd)
    store = kstore.write_keys(store, (pos // g)[:, None], valid[:, None], kc, ks, kz)
    k_seen = dequantize_codes(kc, ks, kz, axis=1, group_size=g, dtype=dt)
    k_stage = _scatter_rows(self.k_stage, g_idx, jnp.broadcast_to(valid[:, None], g_idx.shape),
                            k_seen)
    k_res = jnp.where(due[:, None, None, None], k_stage, k_res)
    return dataclasses.replace(self, store=store, k_res=k_res, v_res=v_res, lens=l1,
                               k_stage=k_stage)

  def _scale_dtype(self):
    if isinstance(self.store, kstore.PlanarStore):
      return self.store.keys.scale.dtype
    return self.store.ks.dtype

  def _ring_positions(self, lens):
    """[B, F]: position held by each ring slot at lengths `lens` (may be < 0: empty)."""
    f = self.flush_block
    start = (lens - f)[:, None]
    return start + jnp.mod(jnp.arange(f)[None, :] - start, f)

  def dequantized(self):
    """Dequantized store (K_hat, V_hat) [B,S,K,H] in the cache dtype (fp32 math)."""
    k, v = kstore.dequantize(self.store, self.k_res.shape[-1], self.v_res.shape[-1])
    return k.astype(self.k_res.dtype), v.astype(self.k_res.dtype)

  def segments(self):
    """(m [B], w_len [B]): the quantized prefix [0, m) and the ring slots [0, w_len) that
    hold the other tokens (module docstring)."""
    nqk, nqv = self._n_quantized(self.lens)
    m = jnp.minimum(nqk, nqv)
    return m, self.lens - m

  def kernel_candidates(self, q_shape):
    """The decode kernels for a query [B, N, H] (fastest first) with their fit checks."""
    k_win = self.k_res
    if isinstance(self.store, kstore.PlanarStore):
      mosaic_fit = lambda: "the cache is stored in the planar layout"
      triton_fit = lambda: kivi_kernels.triton_fit(q_shape, self.store.keys, self.store.values,
                                                   k_win.shape[1])
    else:
      mosaic_fit = lambda: kivi_kernels.mosaic_fit(q_shape, self.store)
      triton_fit = lambda: "the cache is stored in the warp layout"

    def fit(check):
      def go():
        if k_win.dtype not in (jnp.bfloat16, jnp.float16):
          return f"{jnp.dtype(k_win.dtype).name} cache (the kernels take bf16/fp16)"
        return check()
      return go

    return [("mosaic", "hopper", fit(mosaic_fit)), ("triton", "gpu", fit(triton_fit))]

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    impl = self.decode_implementation(q.shape, implementation)
    m, w_len = self.segments()
    if impl != dispatch.REFERENCE:
      kw = dict(keys=self.store) if impl == "mosaic" else dict(keys=self.store.keys,
                                                             values=self.store.values)
      out, lse = _kernel_attention(
          q[:, 0], **kw, k_win=self.k_res, v_win=self.v_res, q_len=m, w_len=w_len,
          out_dtype=q.dtype, implementation=impl)
      return base.mask_padding_queries(out[:, None], lse[:, None], q_positions, q.dtype)
    k_hat, v_hat = self.dequantized()
    b, s = k_hat.shape[:2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    quant = dot_product_attention(q, k_hat, v_hat, q_positions, s_pos, s_pos < m[:, None],
                                  sliding_window=self.sliding_window, out_dtype=jnp.float32)
    p = self._ring_positions(self.lens)
    ring_valid = jnp.arange(self.flush_block)[None, :] < w_len[:, None]
    exact = dot_product_attention(q, self.k_res, self.v_res, q_positions, p, ring_valid,
                                  sliding_window=self.sliding_window, out_dtype=jnp.float32)
    return combine([quant, exact], out_dtype=q.dtype)

  def materialize(self):
    """(k, v [B,S,K,H] as attention sees them, valid [B,S]) — test oracle."""
    nqk, nqv = self._n_quantized(self.lens)
    k_hat, v_hat = self.dequantized()
    b, s = k_hat.shape[:2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ring_slot = jnp.mod(s_pos, self.flush_block)
    k = jnp.where((s_pos < nqk[:, None])[..., None, None], k_hat, _rows(self.k_res, ring_slot))
    v = jnp.where((s_pos < nqv[:, None])[..., None, None], v_hat, _rows(self.v_res, ring_slot))
    valid = s_pos < self.lens[:, None]
    return k, v, valid

  def nbytes_breakdown(self) -> dict[str, int]:
    """Allocated bytes by role (sums to `nbytes()`)."""
    size = lambda *xs: int(sum(x.size * x.dtype.itemsize for x in xs))
    st = self.store
    if isinstance(st, kstore.PlanarStore):
      codes, scales = (st.keys.codes, st.values.codes), (st.keys.scale, st.values.scale,
                                                         st.keys.zero, st.values.zero)
    else:
      codes, scales = (st.kc, st.vc), (st.ks, st.vs)
    half = size(*scales) // 2
    return {"codes": size(*codes), "scales": half, "zeros": half,
            "residual": size(self.k_res, self.v_res), "stage": size(self.k_stage),
            "lengths": size(self.lens)}

  def bytes_per_token(self) -> float:
    """Asymptotic bytes per cached token (this layer): packed codes + amortised scales
    and zero points of K (2H per G tokens) and V (2H/G per token); the O(R) exact
    window, the staged keys and the per-row lengths are excluded."""
    parts = self.nbytes_breakdown()
    return (parts["codes"] + parts["scales"] + parts["zeros"]) / (self.k_res.shape[0]
                                                                  * self.capacity)


@base.register_cache("kivi")
def _make_kivi(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  if method_spec is None:
    method_spec = KiviSpec()
  elif isinstance(method_spec, Mapping):
    method_spec = KiviSpec(**method_spec)
  elif not isinstance(method_spec, KiviSpec):
    raise ValueError(f"kivi cache needs a KiviSpec, got {type(method_spec).__name__}")
  return tuple(KiviCache.init(method_spec, spec, batch=batch, capacity=capacity, dtype=dtype)
               for _ in range(spec.n_layers))
