"""XQuant-CL (XQuant §3.2, §3.3.2): cross-layer delta quantization of the layer inputs.

Post-norm inputs of consecutive layers are similar (residual stream), so from a base
layer b on each layer caches only the quantized delta against the *running
reconstruction* (closed loop):

  ΔX̂_i = Q(X_i − X̂_{i−1}),   X̂_i = X̂_{i−1} + ΔX̂_i,   X̂_{b−1} := 0,

so X̂_i − X_i = Q(r_i) − r_i with r_i = X_i − X̂_{i−1}: the reconstruction error of
layer i is its own quantization error, earlier errors are folded into r_i and never
accumulate. K_i = X̂_i·W_k (+b_k, RoPE at the key positions), V_i = X̂_i·W_v.

GQA variant (§3.3.2, path "latent"): one thin SVD per layer [W_k|W_v] = U_kv Σ Bᵀ;
the cache holds Q((X_i − X̂_{i−1})·U_kv) (2·kv_dim wide, the KV footprint), the
accumulator is updated in D-space, X̂_i = X̂_{i−1} + deq(·)·U_kvᵀ, and K/V are
rematerialised with the original W_k, W_v. Exact when unquantized because
U_kvᵀ·U_kv = I: (X̂_{i−1} + (X_i − X̂_{i−1})U_kvU_kvᵀ)·U_kvΣBᵀ = X_i·[W_k|W_v].

Layers before the base are plain XQuant layers (XCache) at `high_bits`: the paper's
Table 4 recipe is base_layer=2 with n_high_layers=3 (layers 0-2 at 4 bits, the base
is "the higher-precision base layer which becomes the accumulator").

Cross-layer data flow (the `carry` threaded by kvlowrank.model.transformer.forward,
None at layer 0 of every forward call): XCLCache overrides `KVCache.step`. After
layer i's step the carry is the accumulator X̂_i for *all* S slots of the cache,
[B, S, D] float32 (higher precision than the cache, the paper's e_b accumulator is
never re-quantized here). Layer i+1 then
  1. gathers X̂_i at the new tokens' slots (layer i already wrote them, since every
     layer stores its new tokens before attending), forms r = X_{i+1} − X̂_i for the
     new tokens only, quantizes r (or r·U_kv) and appends it to its own store;
  2. rebuilds X̂_{i+1} = X̂_i + deq(its whole delta store) for every slot, history and
     new tokens alike, rematerialises K/V from it and attends;
  3. hands X̂_{i+1} on as the carry.
The base layer ignores the incoming carry (X̂_{b−1} = 0). The accumulator is thus
rebuilt from the base at every forward call (the paper's decode dataflow, Fig. 4);
it lives only inside the forward pass, the cache stores codes alone. As in XCache,
only K/V see X̂ (queries, residual stream and MLP use the exact activations: the
digest's reading A), and prefill and decode store identical codes (per-token axis).

Memory: the carry is one [B, S, D] fp32 array per forward call and layer, freed layer
by layer. The GPU decode path ("xla") walks the slots `decode_chunk` at a time
(`XCLCache.chunked_step`): per chunk it adds the dequantized deltas into the carry in place,
rematerialises that chunk's K/V and attends to it, and the chunks are merged by their
log-sum-exp, so a layer's temporaries beside the carry are one chunk's (the whole-cache path
held the previous carry, the deltas, the new carry and K/V of every slot at once). The
carry itself stays: a decode step needs X̂_i of every slot at every layer, and X̂_i is
D wide and fp32, so for a GQA model one carry is several layers' worth of a dense KV cache
(Llama-3-8B: 16 KiB per token against 4 KiB of K/V per layer). So the cache bounds the rows
one forward pass runs (`rows_per_pass`, default: a carry of at most `CARRY_BYTES`), and
`kvlowrank.model.forward` runs a larger batch in slices of rows (`kvlowrank.model.row_slices`):
the carry is [rows, S, D], not [B, S, D], and the largest batch is set by the codes again.
The decode-mode perplexity (kvlowrank.model.segments) runs cross-layer caches token-major:
each segment through the whole `forward`, so it gets the same passes of rows.

Choices the paper leaves open: deltas are quantized per token (`delta_axis`) in
groups of `group_size` channels; the base latent of the GQA variant is the delta
against zero (so its footprint equals a KV cache layer, as the paper's Table 4 counts).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base
from kvlowrank.cache import dispatch
from kvlowrank.methods.xquant.cache import (PATHS, XCache, XQuantSpec, as_spec,
                                            attend_in_chunks, choose_path, chunk_plan,
                                            dense_attend, kv_from_rows, remat,
                                            rematerialised_kv_fit)
from kvlowrank.methods.xquant.factors import cached, svd_factors
from kvlowrank.methods.xquant.store import AXES, TokenStore, _rows
from kvlowrank_kernels.quant import packing
from kvlowrank.spec import ModelSpec

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class XQuantCLSpec:
  """XQuant-CL knobs.

  bits: delta bits (2/3/4/8) or None (exact: the oracle).
  base_layer: first layer of the cross-layer chain (the accumulator's base).
  n_high_layers / high_bits: layers i < n_high_layers use high_bits (base included).
  layer_bits: optional explicit bits per layer (length n_layers), overrides both.
  group_size, window, path, scale_dtype, implementation, decode_chunk: as in XQuantSpec
    (decode_chunk: slots per chunk of the "xla" decode path, `XCLCache.chunked_step`).
  delta_axis: quantization axis of the deltas ("token" as XQuant-MHA; "channel").
  key_axis / value_axis: axes of the plain latent layers before the base.
  rows_per_pass: batch rows one forward pass runs (`KVCache.rows_per_pass`): the carry X̂ is
    [rows, S, D] fp32, so it bounds that temporary. None: as many rows as keep it within
    `CARRY_BYTES` (at least one).
  """

  bits: Optional[int] = 2
  base_layer: int = 0
  n_high_layers: int = 0
  high_bits: int = 4
  layer_bits: tuple = ()
  group_size: int = 128
  window: int = 0
  path: str = "auto"
  delta_axis: str = "token"
  key_axis: str = "channel"
  value_axis: str = "token"
  scale_dtype: str = "float16"
  implementation: Optional[str] = None
  decode_chunk: int = 2048
  rows_per_pass: Optional[int] = None

  def __post_init__(self):
    if self.bits is not None:
      packing.check_bits(self.bits, "XQuantCLSpec.bits")
    r = self.rows_per_pass
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1):
      raise ValueError(f"XQuantCLSpec.rows_per_pass must be None or an int >= 1, got {r!r}")
    d = self.decode_chunk
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
      raise ValueError(f"XQuantCLSpec.decode_chunk must be an int >= 0, got {d!r}")
    packing.check_bits(self.high_bits, "XQuantCLSpec.high_bits")
    for i, b in enumerate(self.layer_bits):
      if b is not None:
        packing.check_bits(b, f"XQuantCLSpec.layer_bits[{i}]")
    object.__setattr__(self, "layer_bits", tuple(self.layer_bits))
    b = self.base_layer
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
      raise ValueError(f"XQuantCLSpec.base_layer must be an int >= 0, got {b!r}")
    if self.path not in PATHS:
      raise ValueError(f"XQuantCLSpec.path must be one of {PATHS}, got {self.path!r}")
    for f in ("delta_axis", "key_axis", "value_axis"):
      if getattr(self, f) not in AXES:
        raise ValueError(f"XQuantCLSpec.{f} must be one of {AXES}, got {getattr(self, f)!r}")
    # Shared knobs are validated by the XQuantSpec of the plain layers.
    self.plain_spec()

  def plain_spec(self) -> XQuantSpec:
    """XQuantSpec of the plain layers before the base."""
    return XQuantSpec(bits=self.bits, group_size=self.group_size, window=self.window,
                      path=self.path, key_axis=self.key_axis, value_axis=self.value_axis,
                      n_high_layers=self.n_high_layers, high_bits=self.high_bits,
                      scale_dtype=self.scale_dtype, implementation=self.implementation,
                      decode_chunk=self.decode_chunk)

  def bits_of(self, i: int) -> Optional[int]:
    if self.layer_bits:
      return self.layer_bits[i]
    if self.bits is None:
      return None
    return self.high_bits if i < self.n_high_layers else self.bits


# Default bound of one pass's carry (`XQuantCLSpec.rows_per_pass` None): 2 GiB is 3 rows of a
# 32K Llama-3-8B cache (0.5 GiB each); passes cost a weight read each, small beside the
# rematerialisation of each row's K/V at every step (the arithmetic: `model.row_slices`;
# measured: BENCHMARKS.md, whole-model decode, XQuant-CL-2).
CARRY_BYTES = 2 << 30


def _gather_slots(acc, positions):
  """acc [B, S, D] at slots = positions [B, T] (padding reads slot 0; never stored)."""
  return _rows(acc, jnp.clip(positions, 0, acc.shape[1] - 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class XCLCache(base.KVCache):
  """One cross-layer layer (base or delta) of XQuant-CL; see module docstring."""

  store: TokenStore            # quantized deltas (D wide, or 2·kv_dim latent)
  u: Optional[jax.Array]       # [D, r] U_kv (latent path; weights) or None
  is_base: bool = base.static_field(default=False)
  implementation: Optional[str] = base.static_field(default=None)
  sliding_window: Optional[int] = base.static_field(default=None)
  kv_heads: int = base.static_field(default=1)
  dtype: str = base.static_field(default="bfloat16")   # of K/V rematerialised by "xla"
  decode_chunk: int = base.static_field(default=2048)  # XQuantCLSpec.decode_chunk
  pass_rows: Optional[int] = base.static_field(default=None)  # see rows_per_pass()

  name = "xquant_cl"

  def shard_axes(self) -> dict:
    """As XCache: the quantized (delta) rows and U are kept whole on every device of the
    model axis, which rebuilds its own KV heads from them."""
    return {".store": (0, None), ".u": (None, None)}

  @classmethod
  def init(cls, cspec: XQuantCLSpec, spec: ModelSpec, lp: dict, *, layer: int, batch: int,
           capacity: int, dtype=jnp.bfloat16):
    u = None
    width = spec.dim
    if choose_path(spec, cspec.path) == "latent":
      # the accumulator is fp32, so is its basis
      u_np, = cached((lp["wk"], lp["wv"]), "xquant_cl", lambda: (np.asarray(svd_factors(
          jnp.concatenate([lp["wk"], lp["wv"]], axis=1))[0], np.float32),))
      u = jnp.asarray(u_np)
      width = u.shape[1]
    store = TokenStore.init(batch=batch, capacity=capacity, width=width,
                            bits=cspec.bits_of(layer), axis=cspec.delta_axis,
                            group_size=cspec.group_size, window=cspec.window, dtype=dtype,
                            scale_dtype=cspec.scale_dtype, field="XQuantCLSpec")
    rows = cspec.rows_per_pass or max(1, CARRY_BYTES // (capacity * spec.dim * 4))
    return cls(store=store, u=u, is_base=layer == cspec.base_layer,
               implementation=cspec.implementation, sliding_window=spec.sliding_window,
               kv_heads=spec.n_kv_heads, dtype=jnp.dtype(dtype).name,
               decode_chunk=cspec.decode_chunk, pass_rows=rows)

  def rows_per_pass(self) -> Optional[int]:
    """`XQuantCLSpec.rows_per_pass` (default: as many rows as keep the fp32 carry
    [rows, S, D] within `CARRY_BYTES`)."""
    return self.pass_rows

  @property
  def capacity(self) -> int:
    return self.store.capacity

  @property
  def lengths(self):
    return self.store.lens

  def _zeros_like_acc(self, x):
    return jnp.zeros((x.shape[0], self.capacity, x.shape[-1]), jnp.float32)

  def chunks(self) -> tuple[int, int, int]:
    """(chunk C, full chunks n, remainder r) of the "xla" decode path (`chunk_plan`)."""
    return chunk_plan((self.store,), self.decode_chunk)

  def _residual(self, x, positions, acc_prev):
    """(acc_prev, the store with the new tokens' deltas appended)."""
    if acc_prev is None:
      if not self.is_base:
        raise ValueError("XQuant-CL delta layer got no carry: the previous layer must be an "
                         "XQuant-CL layer of the same forward call (check base_layer)")
      acc_prev = self._zeros_like_acc(x)
      r = x.astype(jnp.float32)                 # X̂_{b−1} = 0
    else:
      r = x.astype(jnp.float32) - _gather_slots(acc_prev, positions)
    if self.u is not None:
      r = jnp.matmul(r, self.u, precision=_HI)
    return acc_prev, self.store.append(r, positions)

  def advance(self, x, positions, acc_prev, implementation=None):
    """Stores the new tokens' deltas and returns (cache, X̂_i [B, S, D] fp32).

    Args:
      x: [B, T, D] exact layer input of the new tokens.
      positions: [B, T] (< 0 padding).
      acc_prev: [B, S, D] fp32 X̂_{i−1} for all slots (None: base layer, zeros).
      implementation: the dequant-matmul op of the latent path's deq(·)·U_kvᵀ (default: the
        cache's own).
    """
    acc_prev, store = self._residual(x, positions, acc_prev)
    if self.u is None:
      delta = store.rows(jnp.float32)
    else:   # deq(·)·U_kvᵀ, through the dequant-matmul op for the quantized rows
      impl = self.implementation if implementation is None else implementation
      delta = remat(store, self.u.T, impl)
    return dataclasses.replace(self, store=store), acc_prev + delta

  def chunked_step(self, inputs: base.AttnInputs, q, lp, acc_prev, spec: ModelSpec):
    """The "xla" decode step with bounded temporaries (module doc, Memory): stores the new
    tokens' deltas, then per chunk of `chunks()` slots (`lax.scan`, the carry updated in
    place) X̂_i = X̂_{i−1} + deq(deltas), its K/V by one 16-bit GEMM with fp32
    accumulation at the cache dtype (as the whole-cache "xla" path), the jnp attention of
    q over them (fp32): `attend_in_chunks`.

    Returns:
      (out [B, T, N, H] q.dtype, lse [B, T, N], cache, X̂_i [B, S, D] fp32).
    """
    acc, store = self._residual(inputs.x, inputs.positions, acc_prev)
    cache = dataclasses.replace(self, store=store)
    dt = jnp.dtype(self.dtype)
    w = jnp.concatenate([lp["wk"], lp["wv"]], axis=1).astype(dt)

    def kv_of(acc, start, size):
      win = store.window(start, size)
      delta = win.rows(jnp.float32) if self.u is None else remat(win, self.u.T, "xla")
      acc = jax.lax.dynamic_update_slice_in_dim(
          acc, jax.lax.dynamic_slice_in_dim(acc, start, size, axis=1) + delta, start, axis=1)
      # Read back from the updated carry: the old one then has a single reader (the
      # update itself), which XLA runs in place (else it copies the carry every chunk).
      a = jax.lax.dynamic_slice_in_dim(acc, start, size, axis=1)
      kv = jnp.matmul(a.astype(dt), w, preferred_element_type=jnp.float32)
      pos = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), a.shape[:2])
      return acc, *kv_from_rows(kv[..., :spec.kv_dim], kv[..., spec.kv_dim:], lp, spec, dt,
                                positions=pos)

    out, lse, acc = attend_in_chunks(q, inputs.positions, store.lens, cache.chunks(), kv_of,
                                     acc, sliding_window=self.sliding_window)
    return out, lse, cache, acc

  def kernel_candidates(self, q_shape):
    """"xla": K/V projected from X̂_i by one 16-bit GEMM with fp32 accumulation at the cache
    dtype, then the dense decode kernel over them (cuDNN, else Triton), as XQuant's "xla"
    path; X̂_i itself is rebuilt in fp32 either way (module doc)."""
    return [("xla", "gpu", lambda: rematerialised_kv_fit(q_shape, self.kv_heads,
                                                          self.capacity, self.dtype))]

  def choose_implementation(self, q_shape, implementation=None, platform=None):
    """The attention path; the names that pick the delta's dequant-matmul op ("auto",
    "triton") leave it to the fastest that fits, "reference_fused" runs the reference."""
    req = self.implementation if implementation is None else implementation
    req = {"auto": None, "triton": None, "reference_fused": dispatch.REFERENCE}.get(req, req)
    return self.choose_requested(q_shape, req, platform)

  def step(self, inputs: base.AttnInputs, q, lp, carry, *, spec: ModelSpec):
    acc_prev = None if self.is_base else carry
    impl = self.decode_implementation(q.shape)
    if impl == "xla" and self.decode_chunk and self.chunks()[0] < self.capacity:
      return self.chunked_step(inputs, q, lp, acc_prev, spec)
    w = jnp.concatenate([lp["wk"], lp["wv"]], axis=1)
    if impl == "xla":
      cache, acc = self.advance(inputs.x, inputs.positions, acc_prev, "xla")
      dt = jnp.dtype(self.dtype)
      kv = jnp.matmul(acc.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)
      k, v = kv_from_rows(kv[..., :spec.kv_dim], kv[..., spec.kv_dim:], lp, spec, dt)
      out, lse = dense_attend(k, v, cache.lengths, q, inputs.positions, lp, spec,
                              self.sliding_window)
      return out, lse, cache, acc
    cache, acc = self.advance(inputs.x, inputs.positions, acc_prev)
    kv = jnp.matmul(acc, w.astype(jnp.float32), precision=_HI)
    k, v = kv_from_rows(kv[..., :spec.kv_dim], kv[..., spec.kv_dim:], lp, spec, q.dtype)
    out, lse = dense_attend(k, v, cache.lengths, q, inputs.positions, lp, spec,
                            self.sliding_window, dispatch.REFERENCE)
    return out, lse, cache, acc

  def _needs_carry(self, what):
    raise NotImplementedError(
        f"XCLCache.{what}: an XQuant-CL layer depends on the previous layer's "
        "reconstruction; run it through forward() (step with carry) or use "
        "xquant_cl.reconstruct_inputs / materialize_all")

  def update(self, inputs, lp):
    self._needs_carry("update")

  def attend(self, q, q_positions, lp, *, spec, implementation=None):
    self._needs_carry("attend")

  def materialize(self):
    self._needs_carry("materialize")

  def nbytes(self) -> int:
    """Bytes of cache storage (delta codes, scales, zeros, exact tail, lengths)."""
    return self.store.nbytes()

  def weights_nbytes(self) -> int:
    return 0 if self.u is None else int(self.u.size * self.u.dtype.itemsize)

  def bytes_per_token(self) -> float:
    return self.store.bytes_per_token()


def reconstruct_inputs(caches):
  """X̂_i [B, S, D] fp32 for every XQuant-CL layer (None for plain layers), rebuilt
  from the stored deltas exactly as the forward pass does."""
  out, acc = [], None
  for c in caches:
    if isinstance(c, XCLCache):
      if c.is_base:
        acc = jnp.zeros((c.lengths.shape[0], c.capacity,
                         c.store.width if c.u is None else c.u.shape[0]), jnp.float32)
      delta = c.store.rows(jnp.float32)
      acc = acc + (delta if c.u is None else jnp.matmul(delta, c.u.T, precision=_HI))
      out.append(acc)
    else:
      out.append(None)
  return out


def materialize_all(caches, params, spec: ModelSpec, dtype=jnp.float32):
  """Per-layer (k post-RoPE, v, valid) for an XQuant-CL model cache — test oracle."""
  xs = reconstruct_inputs(caches)
  out = []
  for c, lp, xh in zip(caches, params["layers"], xs):
    if xh is None:
      k, v = c.rematerialize(lp, spec, dtype)
    else:
      w = jnp.concatenate([lp["wk"], lp["wv"]], axis=1).astype(jnp.float32)
      kv = jnp.matmul(xh, w, precision=_HI)
      k, v = kv_from_rows(kv[..., :spec.kv_dim], kv[..., spec.kv_dim:], lp, spec, dtype)
    s = k.shape[1]
    out.append((k, v, jnp.arange(s)[None, :] < c.lengths[:, None]))
  return out


@base.register_cache("xquant_cl")
def _make_xquant_cl(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  cspec = as_spec(method_spec, XQuantCLSpec, "xquant_cl")
  if cspec.base_layer >= spec.n_layers:
    raise ValueError(f"XQuantCLSpec.base_layer ({cspec.base_layer}) must be < n_layers "
                     f"({spec.n_layers})")
  if cspec.layer_bits and len(cspec.layer_bits) != spec.n_layers:
    raise ValueError(f"XQuantCLSpec.layer_bits has {len(cspec.layer_bits)} entries, the model "
                     f"has {spec.n_layers} layers")
  plain = cspec.plain_spec()
  caches = []
  for i, lp in enumerate(params["layers"]):
    if i < cspec.base_layer:
      if cspec.layer_bits:
        plain = dataclasses.replace(plain, bits=cspec.layer_bits[i], n_high_layers=0)
      caches.append(XCache.init(plain, spec, lp, layer=i, batch=batch, capacity=capacity,
                                dtype=dtype))
    else:
      caches.append(XCLCache.init(cspec, spec, lp, layer=i, batch=batch, capacity=capacity,
                                  dtype=dtype))
  return tuple(caches)
