"""XQuant cache (Tomar, Hooper et al. 2025): cache the quantized layer input X and
rematerialise K and V at every attention call.

Two storage paths, picked per model (`XQuantSpec.path`):

* "x" (XQuant §3.1, MHA): store X = rmsnorm(h) (AttnInputs.x, the q/k/v_proj input)
  quantized per token (groups of `group_size` channels). At attention time
  K = X̂·W_k (+b_k), then RoPE at the *key* positions (the cache is pre-RoPE), and
  V = X̂·W_v (+b_v). One D-wide tensor instead of K and V: 2× fewer bytes than KV
  quantization at equal bits for MHA.
* "latent" (XQuant §3.3, GQA): offline thin SVD per layer W_k = U_k Σ_k B_kᵀ,
  W_v = U_v Σ_v B_vᵀ (exact: rank W <= kv_dim, no truncation). Cache X·U_k quantized
  per channel and X·U_v per token (the paper's best axes; Σ is *not* applied to the
  cached latent, App. B), rematerialise K = (X̂U_k)·(Σ_kB_kᵀ), V = (X̂U_v)·(Σ_vB_vᵀ).
  Same footprint as the KV cache; the gain is accuracy.
* "auto": the smaller per-token footprint, D vs 2·kv_dim (ties go to "x", the
  plain method). Llama-2-7B: x (4096 < 8192); Llama-3.1-8B: latent (2048 < 4096);
  SmolLM2-135M (9q/3kv heads of 64): latent (384 < 576).

Choices the paper leaves open (digest §3, §12):
  * The current tokens' own K/V are also rematerialised from the stored (quantized)
    representation: `update` runs before `attend`, as for every cache here, so
    one-pass (prefill) perplexity and token-by-token decode store identical codes.
    Queries, the residual stream and the MLP stay exact (digest "reading A").
  * Per-channel latents keep the incomplete last token group exact (it cannot be
    quantized per channel before it completes, KIVI's residual); per-token stores
    keep an exact `window` only when asked (0 by default, as in the paper's PPL runs;
    the paper's generation runs use 128).
  * Scale and zero point are fp16 (one pair per group: +0.25 bit/element at group 128,
    which reproduces the paper's memory numbers).
  * A per-token group must divide the quantized width; it is clamped to the width
    (SmolLM2's 576 and 192 are not multiples of 128: use group_size=64 there).

`nbytes()` counts what grows with the cache (codes, scales, zero points, exact tails,
lengths). The SVD factors are model weights kept on the cache (`weights_nbytes()`).

Attention dispatch (`XCache.attend`; `implementation` in CACHE_IMPLEMENTATIONS). A decode
step (T == 1, no sliding window) on a GPU takes the first path that fits
(`kernel_candidates`, `cache.dispatch`), fastest first as BENCHMARKS.md's XQuant section
measured them:
  * "xla": rematerialise K/V with the XLA dequantization and one 16-bit GEMM with fp32
    accumulation (cuBLAS), at the cache dtype, `XQuantSpec.decode_chunk` tokens at a time,
    each chunk attended by the jnp attention and the chunks merged by their log-sum-exp
    (`XCache.chunked_attend`): the step's temporary K/V are one chunk's, not the whole
    cache's. With decode_chunk = 0 (or a cache no longer than a chunk): all slots at once,
    then the dense decode kernel over them (`dense_attend`: cuDNN, else Triton), as a dense
    cache of those K/V would.
  * "triton" (fused): keys [0, n) with n = min(positions held as codes by every store,
    q_pos + 1) go through `kvlowrank_kernels.xquant.remat_decode_attention` (the fused
    Triton kernel: K/V are rematerialised tile by tile in registers and never written to
    HBM, but its GEMM is compute-bound); the remaining keys [n, L), the exact tails of the
    stores (at most their flush block F, e.g. the incomplete token group of a per-channel
    latent), are rematerialised from `TokenStore.rows_at` and attended densely; both parts
    are merged by their log-sum-exp (`model.attention.combine`). Interleaved-RoPE models run
    the fused op on W_k / b_k / q permuted to the half-rotation layout (q·k is invariant
    under a common permutation); RoPE-free models use cos = 1, sin = 0 tables. It needs
    quantized stores, a power-of-2 head dim >= 16 and quantized widths that are multiples of
    16. "reference_fused" is the same path with the op's jnp reference (CPU tests).
  * Everything else (no GPU, prefill chunks, sliding windows, "reference"): materialise
    K/V for all slots with `dequant_matmul` at the op implementation the request names
    (None/"auto": the Triton dequant-matmul kernel on a GPU, else "reference": fp32 jnp;
    "xla"), then the jnp reference attention.
"auto" is an alias of None. XQuant-CL (`xquant_cl`) does not share the fused path: its
delta layers rebuild the dense fp32 accumulator X̂_i for every slot anyway (the
cross-layer carry) and project it with one dense matmul, then attend as "xla" does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base, dispatch
from kvlowrank.methods.dense.cache import DenseCache
from kvlowrank.methods.xquant.factors import cached, svd_factors
from kvlowrank.methods.xquant.store import AXES, TokenStore
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank.model.rope import apply_rope, interleaved_to_half_perm, rope_cos_sin
from kvlowrank_kernels.quant import packing
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import dense as dense_kernels
from kvlowrank_kernels import xquant as dm

PATHS = ("auto", "x", "latent")
CACHE_IMPLEMENTATIONS = dm.IMPLEMENTATIONS + ("reference_fused",)
_HI = jax.lax.Precision.HIGHEST


def _check_bits(bits, field):
  return None if bits is None else packing.check_bits(bits, field)


@dataclasses.dataclass(frozen=True)
class XQuantSpec:
  """XQuant knobs (defaults: the paper's 4-bit, group 128, no window).

  bits: 2/3/4/8, or None (store exact rows: the unquantized oracle).
  group_size: channels per group (per-token stores, clamped to the width) and tokens
    per group (per-channel stores).
  window: exact recent tokens of per-token stores, flushed in blocks (0 = none).
  path: "auto" | "x" | "latent" (module doc).
  key_axis / value_axis: quantization axis of X·U_k / X·U_v on the latent path.
  n_high_layers / high_bits: the first n layers use high_bits (paper Table 4: 3, 4).
  scale_dtype: dtype of scales and zero points.
  implementation: None (the fastest that fits) | "reference" | "xla" | "triton" | "auto"
    (= None) | "reference_fused" (the module doc's attention dispatch).
  decode_chunk: tokens rematerialised at a time by the "xla" decode path (rounded down to
    a multiple of the stores' token groups and flush blocks), which bounds its temporary
    K/V to one chunk; 0 = the whole cache at once.
  """

  bits: Optional[int] = 4
  group_size: int = 128
  window: int = 0
  path: str = "auto"
  key_axis: str = "channel"
  value_axis: str = "token"
  n_high_layers: int = 0
  high_bits: int = 4
  scale_dtype: str = "float16"
  implementation: Optional[str] = None
  decode_chunk: int = 2048

  def __post_init__(self):
    _check_bits(self.bits, "XQuantSpec.bits")
    packing.check_bits(self.high_bits, "XQuantSpec.high_bits")
    if self.path not in PATHS:
      raise ValueError(f"XQuantSpec.path must be one of {PATHS}, got {self.path!r}")
    for f in ("key_axis", "value_axis"):
      if getattr(self, f) not in AXES:
        raise ValueError(f"XQuantSpec.{f} must be one of {AXES}, got {getattr(self, f)!r}")
    for f in ("group_size", "window", "n_high_layers", "decode_chunk"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (f == "group_size"):
        raise ValueError(f"XQuantSpec.{f} must be an int >= {int(f == 'group_size')}, got {v!r}")
    if self.implementation is not None and self.implementation not in CACHE_IMPLEMENTATIONS:
      raise ValueError(f"XQuantSpec.implementation must be None or one of "
                       f"{CACHE_IMPLEMENTATIONS}, got {self.implementation!r}")

  def layer_bits(self, i: int) -> Optional[int]:
    """Bits of layer i (None: exact)."""
    if self.bits is None:
      return None
    return self.high_bits if i < self.n_high_layers else self.bits


def choose_path(spec: ModelSpec, path: str = "auto") -> str:
  """"x" or "latent": the smaller per-token footprint (D vs 2·kv_dim) for "auto"."""
  if path not in PATHS:
    raise ValueError(f"path must be one of {PATHS}, got {path!r}")
  if path != "auto":
    return path
  return "latent" if 2 * spec.kv_dim < spec.dim else "x"


def op_implementation(implementation: Optional[str]) -> str:
  """The dequant-matmul op implementation behind a cache implementation name."""
  if implementation is None:
    return "auto"
  return "reference" if implementation == "reference_fused" else implementation


def fused_fit(head_dim: int, stores) -> Optional[str]:
  """None when the fused Triton op takes these stores, else why not (one line; pure)."""
  if any(s.bits is None for s in stores):
    return "exact (bits=None) stores"
  if head_dim < 16 or head_dim & (head_dim - 1):
    return f"head dim {head_dim} is not a power of 2 >= 16"
  if any(s.width % 16 for s in stores):
    return f"quantized widths {[s.width for s in stores]} are not multiples of 16"
  return None


def fused_decode_choice(implementation: Optional[str], stores, sliding_window,
                        n_query: int) -> tuple[Optional[str], Optional[str]]:
  """("reference" when `implementation` is "reference_fused" and the fused path applies to
  this attend call, else None; the reason when None): the CPU tests' route through the
  fused op's jnp reference."""
  if implementation != "reference_fused":
    return None, None
  if n_query != 1:
    return None, "prefill (T > 1): the kernels are decode kernels"
  if sliding_window is not None:
    return None, "sliding-window attention"
  if any(s.bits is None for s in stores):
    return None, "exact (bits=None) stores"
  return "reference", None


def dense_attend(k, v, lens, q, q_positions, lp, spec: ModelSpec, sliding_window,
                 implementation: Optional[str] = None):
  """Attention of q over rematerialised k, v [B, S, K, H] (slot s = position s) as a dense
  cache of them attends (`DenseCache.attend`): its decode kernel (cuDNN, else Triton) at
  T = 1 on a GPU, else the jnp reference; implementation "reference" forces the latter."""
  view = DenseCache(k=k, v=v, lens=lens, sliding_window=sliding_window,
                    implementation=implementation)
  return view.attend(q, q_positions, lp, spec=spec)


def rematerialised_kv_fit(q_shape, kv_heads: int, capacity: int, dtype) -> Optional[str]:
  """None when a dense decode kernel takes K/V [B, capacity, kv_heads, H] of `dtype` for
  queries [B, N, H] (the "xla" path), else why not."""
  b, n, h = q_shape
  q = jax.ShapeDtypeStruct((b, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, capacity, kv_heads, h), dtype)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  whys = [dense_kernels.kernel_fit(q, kv, kv, lens, name) for name in ("cudnn", "triton")]
  return None if None in whys else "; ".join(whys)


def remat(store: TokenStore, w, implementation: str):
  """Rematerialises store rows times w: [B, S, C] x [C, N] -> [B, S, N] fp32.

  Quantized rows go through the dequant-matmul op; exact tail rows are multiplied
  directly and overlaid (they are at most F rows).
  """
  implementation = op_implementation(implementation)
  wf = w.astype(jnp.float32)
  if store.bits is None:
    return jnp.matmul(store.raw.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
  b, s, nw = store.codes.shape
  sc, zr = store.scale, store.zero
  out = dm.dequant_matmul(store.codes.reshape(b * s, nw), sc.reshape(-1, sc.shape[-1]),
                          zr.reshape(-1, zr.shape[-1]), w, bits=store.bits, axis=store.axis,
                          group=store.group, out_dtype=jnp.float32,
                          implementation=implementation).reshape(b, s, -1)
  if store.flush:
    tail = jnp.matmul(store.tail.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
    out = store.merge_tail(out, tail)
  return out[:, :store.capacity]


def chunk_plan(stores, decode_chunk: int) -> tuple[int, int, int]:
  """(chunk C, full chunks n, remainder r) of the "xla" decode path over `stores` (same
  capacity): it rematerialises slots [jC, (j+1)C) for j < n, then [nC, nC + r)
  (`XQuantSpec.decode_chunk`); C is a multiple of every store's flush block and per-channel
  token group, so a chunk's start is one (`TokenStore.window`)."""
  step = 1
  for st in stores:
    for m in (st.flush, st.group if st.axis == "channel" and st.bits is not None else 0):
      step = step * m // math.gcd(step, m) if m else step
  c = max(step, decode_chunk // step * step)
  cap = stores[0].capacity
  return c, cap // c, cap % c


def attend_in_chunks(q, q_positions, lengths, plan, kv_of, carry=None, sliding_window=None):
  """Attention of q over slots walked in the chunks of `plan` (`chunk_plan`), one after
  another (`lax.scan`, then the remainder chunk), each by the jnp attention (fp32) over
  that chunk's K/V with slots >= lengths masked (and keys outside `sliding_window` of a
  query, as the whole-cache path); the chunks are merged by their log-sum-exp
  (`model.attention.combine`). The "xla" decode paths of XQuant and XQuant-CL.

  Args:
    kv_of: (carry, start, size) -> (carry, k, v [B, size, K, H]) of slots
      [start, start + size), threading `carry` from chunk to chunk.
  Returns:
    (out [B, T, N, H] q.dtype, lse [B, T, N], the final carry).
  """
  c, n, r = plan

  def part(carry, start, size):
    carry, k, v = kv_of(carry, start, size)
    pos = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), k.shape[:2])
    return carry, dot_product_attention(q, k, v, q_positions, pos, pos < lengths[:, None],
                                        sliding_window=sliding_window, out_dtype=jnp.float32)

  carry, (outs, lses) = jax.lax.scan(lambda a, j: part(a, j * c, c), carry,
                                     jnp.arange(n, dtype=jnp.int32))
  parts = [(outs[j], lses[j]) for j in range(n)]
  if r:
    carry, last = part(carry, n * c, r)
    parts.append(last)
  out, lse = combine(parts, out_dtype=q.dtype)
  return out, lse, carry


def kv_from_rows(k_pre, v, lp, spec: ModelSpec, dtype, positions=None):
  """[B,S,kv_dim] pre-bias K and V -> (k post-RoPE, v) [B,S,K,H] at `positions` [B,S]
  (default: slot positions 0..S-1)."""
  if spec.qkv_bias:
    k_pre, v = k_pre + lp["bk"].astype(jnp.float32), v + lp["bv"].astype(jnp.float32)
  b, s, _ = k_pre.shape
  k_pre = k_pre.reshape(b, s, spec.n_kv_heads, spec.head_dim)
  v = v.reshape(b, s, spec.n_kv_heads, spec.head_dim)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)) if positions is None \
      else positions
  k = apply_rope(k_pre, pos, spec)   # rotate in fp32 at the key positions, then cast
  return k.astype(dtype), v.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class XCache(base.KVCache):
  """One layer of XQuant (see module docstring)."""

  stores: tuple                # ("x" path) (X,); ("latent") (X·U_k, X·U_v)
  proj: tuple                  # () or (U_k, Σ_kB_kᵀ, U_v, Σ_vB_vᵀ) (weights)
  path: str = base.static_field(default="x")
  implementation: Optional[str] = base.static_field(default=None)
  sliding_window: Optional[int] = base.static_field(default=None)
  kv_heads: int = base.static_field(default=1)
  dtype: str = base.static_field(default="bfloat16")   # of K/V rematerialised by "xla"
  decode_chunk: int = base.static_field(default=2048)  # XQuantSpec.decode_chunk

  name = "xquant"

  def shard_axes(self) -> dict:
    """X (or its latents X·U_k, X·U_v) is not per head: every device of the model axis
    keeps the whole quantized rows (split over the batch only) and rematerialises its own
    KV heads from them, with its column block of W_k / W_v (or of Σ_kB_kᵀ, Σ_vB_vᵀ). So the
    cache's bytes per device do not shrink with the model axis; the rematerialisation work
    does. Splitting X over its D channels would need an all-reduce of K and V over the
    whole context at every step."""
    return {".stores": (0, None), ".proj[0]": (None, None), ".proj[1]": (None, 1),
            ".proj[2]": (None, None), ".proj[3]": (None, 1)}

  @classmethod
  def init(cls, xspec: XQuantSpec, spec: ModelSpec, lp: dict, *, layer: int, batch: int,
           capacity: int, dtype=jnp.bfloat16):
    """Empty cache for layer `layer` (lp: its params; the latent path factorises them)."""
    path = choose_path(spec, xspec.path)
    bits = xspec.layer_bits(layer)
    mk = lambda width, axis: TokenStore.init(
        batch=batch, capacity=capacity, width=width, bits=bits, axis=axis,
        group_size=xspec.group_size, window=xspec.window, dtype=dtype,
        scale_dtype=xspec.scale_dtype)
    if path == "x":
      stores, proj = (mk(spec.dim, "token"),), ()
    else:
      wdt = lp["wk"].dtype

      def factors():
        uk, rk = svd_factors(lp["wk"])
        uv, rv = svd_factors(lp["wv"])
        return tuple(np.asarray(a, wdt) for a in (uk, rk, uv, rv))

      proj = tuple(jnp.asarray(a) for a in cached((lp["wk"], lp["wv"]), "xquant", factors))
      uk, uv = proj[0], proj[2]
      stores = (mk(uk.shape[1], xspec.key_axis), mk(uv.shape[1], xspec.value_axis))
    return cls(stores=stores, proj=proj, path=path, implementation=xspec.implementation,
               sliding_window=spec.sliding_window, kv_heads=spec.n_kv_heads,
               dtype=jnp.dtype(dtype).name, decode_chunk=xspec.decode_chunk)

  @property
  def capacity(self) -> int:
    return self.stores[0].capacity

  @property
  def lengths(self):
    return self.stores[0].lens

  def update(self, inputs: base.AttnInputs, lp):
    pos, x = inputs.positions, inputs.x
    if self.path == "x":
      return dataclasses.replace(self, stores=(self.stores[0].append(x, pos),))
    uk, _, uv, _ = self.proj
    xk = jnp.matmul(x.astype(jnp.float32), uk.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    xv = jnp.matmul(x.astype(jnp.float32), uv.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
    return dataclasses.replace(self, stores=(self.stores[0].append(xk, pos),
                                             self.stores[1].append(xv, pos)))

  def rematerialize(self, lp, spec: ModelSpec, dtype, implementation=None, start=0):
    """(k post-RoPE, v) [B,S,K,H] for every slot, from the stored representation (slot s
    at position start + s: `start` is set for a window of the stores, `chunked_attend`)."""
    impl = self.implementation if implementation is None else implementation
    if self.path == "x":
      kv = remat(self.stores[0], jnp.concatenate([lp["wk"], lp["wv"]], axis=1), impl)
      k_pre, v = kv[..., :spec.kv_dim], kv[..., spec.kv_dim:]
    else:
      _, rk, _, rv = self.proj
      k_pre = remat(self.stores[0], rk, impl)
      v = remat(self.stores[1], rv, impl)
    b, s = k_pre.shape[:2]
    pos = start + jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return kv_from_rows(k_pre, v, lp, spec, dtype, positions=pos)

  def chunks(self) -> tuple[int, int, int]:
    """`chunk_plan` of this cache's stores (the "xla" decode path's chunks)."""
    return chunk_plan(self.stores, self.decode_chunk)

  def chunked_attend(self, q, q_positions, lp, spec: ModelSpec):
    """The "xla" decode path with bounded temporaries: per chunk of `chunks()` slots,
    rematerialise its K/V (XLA dequantization + cuBLAS GEMM, at the cache dtype) and attend
    to it with the jnp attention (fp32), one chunk after another (`attend_in_chunks`).

    Returns:
      (out [B, T, N, H] q.dtype, lse [B, T, N]).
    """
    def kv_of(carry, start, size):
      view = dataclasses.replace(self, stores=tuple(st.window(start, size)
                                                    for st in self.stores))
      return carry, *view.rematerialize(lp, spec, self.dtype, "xla", start=start)

    out, lse, _ = attend_in_chunks(q, q_positions, self.lengths, self.chunks(), kv_of,
                                   sliding_window=self.sliding_window)
    return out, lse

  def kernel_candidates(self, q_shape):
    """The decode paths for queries [B, N, H], fastest first (module doc)."""
    return [("xla", "gpu", lambda: rematerialised_kv_fit(q_shape, self.kv_heads,
                                                          self.capacity, self.dtype)),
            ("triton", "gpu", lambda: fused_fit(q_shape[-1], self.stores))]

  def choose_implementation(self, q_shape, implementation=None, platform=None):
    req = self.implementation if implementation is None else implementation
    if req == "reference_fused":
      fused, reason = fused_decode_choice(req, self.stores, self.sliding_window, q_shape[1])
      return ("reference_fused" if fused else dispatch.REFERENCE), reason
    return self.choose_requested(q_shape, None if req == "auto" else req, platform)

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    req = self.implementation if implementation is None else implementation
    impl = self.decode_implementation(q.shape, req)
    if impl == "reference_fused":
      return fused_decode(self, q, q_positions, lp, spec, "reference")
    if impl == "triton":
      return fused_decode(self, q, q_positions, lp, spec, "triton")
    if impl == "xla":
      if self.decode_chunk and self.chunks()[0] < self.capacity:
        return self.chunked_attend(q, q_positions, lp, spec)
      k, v = self.rematerialize(lp, spec, self.dtype, "xla")
      return dense_attend(k, v, self.lengths, q, q_positions, lp, spec, self.sliding_window)
    k, v = self.rematerialize(lp, spec, q.dtype, req)
    return dense_attend(k, v, self.lengths, q, q_positions, lp, spec, self.sliding_window,
                        dispatch.REFERENCE)

  def fused_operands(self, lp):
    """(k_rows, v_rows, wk, wv) of the fused op: X and [W_k, W_v] ("x": shared rows), or
    the latents and Σ_kB_kᵀ, Σ_vB_vᵀ ("latent")."""
    if self.path == "x":
      return self.stores[0].packed(), None, lp["wk"], lp["wv"]
    _, rk, _, rv = self.proj
    return self.stores[0].packed(), self.stores[1].packed(), rk, rv

  def rows_kv(self, positions, lp):
    """Pre-bias K, V [B, W, kv_dim] fp32 of the rows at positions [B, W] (as stored)."""
    _, _, wk, wv = self.fused_operands(lp)
    xk = self.stores[0].rows_at(positions)
    xv = xk if self.path == "x" else self.stores[1].rows_at(positions)
    f32 = lambda a: a.astype(jnp.float32)
    return (jnp.matmul(xk, f32(wk), precision=_HI), jnp.matmul(xv, f32(wv), precision=_HI))

  def materialize(self):
    raise NotImplementedError(
        "XCache rematerialises K/V from the layer weights: use "
        "cache.rematerialize(lp, spec, dtype) or xquant.materialize_all(caches, params, spec)")

  def nbytes(self) -> int:
    """Bytes of cache storage (codes, scales, zeros, exact tails, lengths)."""
    return int(sum(s.nbytes() for s in self.stores))

  def weights_nbytes(self) -> int:
    """Bytes of the SVD factors kept on the cache (model weights, not cache storage)."""
    return int(sum(a.size * a.dtype.itemsize for a in self.proj))

  def bytes_per_token(self) -> float:
    return float(sum(s.bytes_per_token() for s in self.stores))


def fused_decode(cache: XCache, q, q_positions, lp, spec: ModelSpec, backend: str):
  """Decode attention (q [B, 1, N, H], q_positions [B, 1]) without materialising K/V for
  the quantized prefix (module doc): the fused op (`backend`: "triton" | "reference") over
  keys [0, n), the exact tail keys [n, L) densely, LSE-merged.

  Returns:
    (out [B, 1, N, H] q.dtype, lse [B, 1, N]).
  """
  lengths, qpos = cache.lengths, q_positions[:, 0]
  n_codes = jnp.min(jnp.stack([st.n_quantized() for st in cache.stores]), axis=0)
  n_fused = jnp.clip(jnp.minimum(n_codes, qpos + 1), 0).astype(jnp.int32)
  k_rows, v_rows, wk, wv = cache.fused_operands(lp)
  zeros = jnp.zeros((spec.kv_dim,), jnp.float32)
  bk, bv = (lp["bk"], lp["bv"]) if spec.qkv_bias else (zeros, zeros)
  qh, h, s = q[:, 0], spec.head_dim, k_rows.codes.shape[1]
  if spec.rope_layout == "interleaved":   # to the half-rotation layout (common permutation)
    perm = interleaved_to_half_perm(h)
    cols = (np.arange(spec.n_kv_heads)[:, None] * h + perm[None, :]).reshape(-1)
    qh, wk, bk = qh[..., perm], wk[:, cols], bk[cols]
  if spec.rope_layout == "none":
    cos, sin = jnp.ones((s, h // 2), jnp.float32), jnp.zeros((s, h // 2), jnp.float32)
  else:
    cos, sin = rope_cos_sin(jnp.arange(s, dtype=jnp.int32), spec)
  out, lse = dm.remat_decode_attention(qh, k_rows, v_rows, wk, wv, bk, bv, cos, sin, n_fused,
                                       n_kv_heads=spec.n_kv_heads, implementation=backend,
                                       return_lse=True)
  parts = [(out[:, None], lse[:, None])]
  w = max(st.flush for st in cache.stores)
  if w:   # the rows no store holds as codes yet: at most the largest flush block
    pos = n_fused[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    k_pre, v = cache.rows_kv(pos, lp)
    k, v = kv_from_rows(k_pre, v, lp, spec, jnp.float32, positions=pos)
    parts.append(dot_product_attention(q, k, v, q_positions, pos, pos < lengths[:, None],
                                       out_dtype=jnp.float32))
  return combine(parts, out_dtype=q.dtype)


def materialize_all(caches, params, spec: ModelSpec, dtype=jnp.float32):
  """Per-layer (k post-RoPE, v, valid) for a tuple of XCaches — test oracle."""
  out = []
  for c, lp in zip(caches, params["layers"]):
    k, v = c.rematerialize(lp, spec, dtype)
    b, s = k.shape[:2]
    out.append((k, v, jnp.arange(s)[None, :] < c.lengths[:, None]))
  return out


def as_spec(method_spec: Any, cls, name: str):
  """None -> cls(); Mapping -> cls(**m); cls instance -> itself; else ValueError."""
  if method_spec is None:
    return cls()
  if isinstance(method_spec, Mapping):
    return cls(**method_spec)
  if not isinstance(method_spec, cls):
    raise ValueError(f"{name} cache needs a {cls.__name__}, got {type(method_spec).__name__}")
  return method_spec


@base.register_cache("xquant")
def _make_xquant(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  xspec = as_spec(method_spec, XQuantSpec, "xquant")
  return tuple(XCache.init(xspec, spec, lp, layer=i, batch=batch, capacity=capacity,
                           dtype=dtype) for i, lp in enumerate(params["layers"]))
