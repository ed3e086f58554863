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
  * Quantizer: `kvlowrank.quant` (asymmetric min/max, scale/zero in `scale_dtype`,
    fp16 by default like KIVI; codes really bit-packed into uint32).

Storage (preallocated, per layer; S = capacity rounded up to a multiple of G):
  k_codes [B,S,K,words(H)] uint32, k_scale/k_zero [B,S/G,K,H],
  v_codes [B,S,K,words(H)] uint32, v_scale/v_zero [B,S,K,H/G],
  k_res/v_res [B,F,K,H] exact ring buffers (cache dtype) holding the last F tokens
  (F = R, or F = G when R = 0: keys always need an exact buffer until a group of G
  tokens completes; the value ring is then allocated but never read), lens [B].
  Slot s of the quantized store holds position s; ring slot i holds the position
  p = i (mod F) among the last F.

`update` handles prefill (T > 1) and decode (T = 1) with one traced code path:
it assembles the exact values of positions [L0 - F, L0 + T) (ring + new tokens),
quantizes every candidate key group / value token of that window, and scatters only
those whose quantization KIVI's rules make due (masked writes, no Python branching
on traced lengths). Rows are ragged: each row's new tokens must continue its own
sequence (positions lens[b], lens[b]+1, ...; -1 = padding anywhere; positions >=
capacity are dropped like padding).

Attention reads the post-update cache: tokens [0, m) (m = min of the two quantized
prefixes) from the dequantized store, the last F tokens from the ring with each
token's K/V taken dequantized or exact per the rules above; the two segments are
merged with `combine` (LSE).

Deviations from the KIVI code (documented, deliberate):
  1. Prefill: KIVI runs exact flash attention over the prompt; here prompt queries
     attend to the compressed cache (quantized older tokens + exact window), so a
     one-pass perplexity measures the quantization error (as XQuant's KIVI*).
  2. Decode: KIVI attends *before* flushing (the query sees R+1 exact values, and on a
     flush step R exact keys); here attention follows the update, so the value leaving
     the window and, on a flush step, the block's keys are already quantized.
  3. Dequantization is computed in fp32 (code * scale + zero from the stored
     fp16 scale/zero) and cast to the cache dtype; KIVI's kernels work in fp16.
  4. R = 0 is allowed (KIVI divides by R): values are quantized immediately, keys
     once a G-group completes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base
from kvlowrank.model.attention import combine, dot_product_attention
from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import canonical_scale_dtype, dequantize_codes, quantize_codes
from kvlowrank.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class KiviSpec:
  """KIVI knobs (defaults: README / LongBench scripts of jy-yuan/KIVI: 2-bit, G=32, R=128).

  bits: key bits (2/3/4/8); v_bits: value bits (None = same as bits);
  group_size G: tokens per key group and channels per value group;
  residual R: exact window length (multiple of G, may be 0);
  scale_dtype: dtype of scales and zero points (float16 | bfloat16 | float32).
  """

  bits: int = 2
  group_size: int = 32
  residual: int = 128
  v_bits: Optional[int] = None
  scale_dtype: str = "float16"

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

  @property
  def value_bits(self) -> int:
    return self.bits if self.v_bits is None else self.v_bits

  @property
  def flush_block(self) -> int:
    """F: key flush block and ring length (R, or G when R = 0)."""
    return self.residual if self.residual > 0 else self.group_size


def _rows(a, idx):
  """a [B,N,...], idx [B,M] int -> a[b, idx[b, m]] : [B,M,...]."""
  return a[jnp.arange(a.shape[0])[:, None], idx]


def _scatter_rows(buf, idx, ok, vals):
  """buf[b, idx[b,m]] = vals[b,m] where ok; other writes dropped (index out of range)."""
  idx = jnp.where(ok, idx, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(vals.astype(buf.dtype),
                                                             mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviCache(base.KVCache):
  k_codes: jax.Array   # [B, S, K, Wk] uint32, packed along H
  k_scale: jax.Array   # [B, S/G, K, H]
  k_zero: jax.Array    # [B, S/G, K, H]
  v_codes: jax.Array   # [B, S, K, Wv] uint32
  v_scale: jax.Array   # [B, S, K, H/G]
  v_zero: jax.Array    # [B, S, K, H/G]
  k_res: jax.Array     # [B, F, K, H] exact post-RoPE keys of the last F tokens (ring)
  v_res: jax.Array     # [B, F, K, H]
  lens: jax.Array      # [B] int32
  k_bits: int = base.static_field(default=2)
  v_bits: int = base.static_field(default=2)
  group_size: int = base.static_field(default=32)
  residual: int = base.static_field(default=128)
  sliding_window: Optional[int] = base.static_field(default=None)

  name = "kivi"

  @classmethod
  def init(cls, kspec: KiviSpec, spec: ModelSpec, *, batch: int, capacity: int,
           dtype=jnp.bfloat16):
    """Allocates an empty cache for `capacity` positions (rounded up to a multiple of G)."""
    g, h, kh = kspec.group_size, spec.head_dim, spec.n_kv_heads
    if h % g:
      raise ValueError(f"KiviSpec.group_size ({g}) must divide head_dim ({h}): values are "
                       f"quantized per token in groups of group_size channels")
    s = -(-capacity // g) * g
    f = kspec.flush_block
    sd = jnp.dtype(kspec.scale_dtype)
    wk = packing.packed_words(h, kspec.bits)
    wv = packing.packed_words(h, kspec.value_bits)
    z = jnp.zeros
    return cls(
        k_codes=z((batch, s, kh, wk), jnp.uint32), k_scale=z((batch, s // g, kh, h), sd),
        k_zero=z((batch, s // g, kh, h), sd), v_codes=z((batch, s, kh, wv), jnp.uint32),
        v_scale=z((batch, s, kh, h // g), sd), v_zero=z((batch, s, kh, h // g), sd),
        k_res=z((batch, f, kh, h), dtype), v_res=z((batch, f, kh, h), dtype),
        lens=z((batch,), jnp.int32), k_bits=kspec.bits, v_bits=kspec.value_bits,
        group_size=g, residual=kspec.residual, sliding_window=spec.sliding_window)

  @property
  def capacity(self) -> int:
    return self.k_codes.shape[1]

  @property
  def lengths(self):
    return self.lens

  @property
  def flush_block(self) -> int:
    return self.k_res.shape[1]

  def _n_quantized(self, lens):
    """(keys quantized [0, nqk), values quantized [0, nqv)) at lengths `lens`."""
    f = self.flush_block
    return (lens // f) * f, jnp.maximum(lens - self.residual, 0)

  def update(self, inputs: base.AttnInputs, lp):
    g, f, r, cap = self.group_size, self.flush_block, self.residual, self.capacity
    b, t = inputs.positions.shape
    pos = jnp.where((inputs.positions >= 0) & (inputs.positions < cap), inputs.positions, -1)
    l0 = self.lens
    l1 = base.new_lengths(l0, pos)
    nqk0, nqv0 = self._n_quantized(l0)
    nqk1, nqv1 = self._n_quantized(l1)
    # Exact window E: slot j holds position l0 - f + j (ring for j < f, then new tokens).
    lw = -(-(f + t) // g) * g           # key-window length: covers [nqk0, l0 + t)
    e_len = f + lw
    e_pos = l0[:, None] - f + jnp.arange(e_len)[None, :]
    in_ring = (jnp.arange(e_len)[None, :] < f) & (e_pos >= 0)
    new_slot = jnp.where(pos >= 0, pos - l0[:, None] + f, e_len)

    def window(ring, new):
      e = jnp.where(in_ring[..., None, None], _rows(ring, jnp.mod(e_pos, f)), 0)
      return _scatter_rows(e.astype(ring.dtype), new_slot, pos >= 0, new)

    ek, ev = window(self.k_res, inputs.k), window(self.v_res, inputs.v)
    sd = self.k_scale.dtype
    # Keys: per-channel groups of G tokens over window positions [nqk0, nqk0 + lw);
    # only the groups inside the newly flushed blocks [nqk0, nqk1) are written.
    kw_idx = (nqk0 - l0 + f)[:, None] + jnp.arange(lw)[None, :]
    kc, ks, kz = quantize_codes(_rows(ek, kw_idx), bits=self.k_bits, axis=1, group_size=g,
                                scale_dtype=sd)
    tok = nqk0[:, None] + jnp.arange(lw)[None, :]
    grp = nqk0[:, None] // g + jnp.arange(lw // g)[None, :]
    tok_ok, grp_ok = tok < nqk1[:, None], (grp + 1) * g <= nqk1[:, None]
    k_codes = _scatter_rows(self.k_codes, tok, tok_ok, packing.pack(kc, self.k_bits))
    k_scale = _scatter_rows(self.k_scale, grp, grp_ok, ks)
    k_zero = _scatter_rows(self.k_zero, grp, grp_ok, kz)
    # Values: per-token groups of G channels; positions [l0 - r, l0 - r + t) may leave
    # the window in this step; those in [nqv0, nqv1) are written.
    vc, vs, vz = quantize_codes(ev[:, f - r:f - r + t], bits=self.v_bits, axis=-1,
                                group_size=g, scale_dtype=sd)
    vpos = (l0 - r)[:, None] + jnp.arange(t)[None, :]
    v_ok = (vpos >= nqv0[:, None]) & (vpos < nqv1[:, None])
    v_codes = _scatter_rows(self.v_codes, vpos, v_ok, packing.pack(vc, self.v_bits))
    v_scale = _scatter_rows(self.v_scale, vpos, v_ok, vs)
    v_zero = _scatter_rows(self.v_zero, vpos, v_ok, vz)
    # Ring: slot i <- position p_i = i (mod f) among [l1 - f, l1), read from E.
    p = self._ring_positions(l1)
    e_idx = p - l0[:, None] + f
    return dataclasses.replace(
        self, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes,
        v_scale=v_scale, v_zero=v_zero, k_res=_rows(ek, e_idx), v_res=_rows(ev, e_idx),
        lens=l1)

  def _ring_positions(self, lens):
    """[B, F]: position held by each ring slot at lengths `lens` (may be < 0: empty)."""
    f = self.flush_block
    start = (lens - f)[:, None]
    return start + jnp.mod(jnp.arange(f)[None, :] - start, f)

  def dequantized(self):
    """Dequantized store (K_hat, V_hat) [B,S,K,H] in the cache dtype (fp32 math)."""
    h, dt, g = self.k_res.shape[-1], self.k_res.dtype, self.group_size
    kc = packing.unpack(self.k_codes, self.k_bits, h)
    vc = packing.unpack(self.v_codes, self.v_bits, h)
    k = dequantize_codes(kc, self.k_scale, self.k_zero, axis=1, group_size=g, dtype=dt)
    v = dequantize_codes(vc, self.v_scale, self.v_zero, axis=3, group_size=g, dtype=dt)
    return k, v

  def _ring_segment(self, k_hat, v_hat):
    """Ring tokens with each K/V dequantized or exact per the KIVI rules."""
    nqk, nqv = self._n_quantized(self.lens)
    p = self._ring_positions(self.lens)
    safe = jnp.clip(p, 0, self.capacity - 1)
    k = jnp.where((p < nqk[:, None])[..., None, None], _rows(k_hat, safe), self.k_res)
    v = jnp.where((p < nqv[:, None])[..., None, None], _rows(v_hat, safe), self.v_res)
    return p, k, v

  def attend(self, q, q_positions, lp, *, spec: ModelSpec):
    nqk, nqv = self._n_quantized(self.lens)
    m = jnp.minimum(nqk, nqv)   # [0, m): both K and V quantized
    k_hat, v_hat = self.dequantized()
    b, s = k_hat.shape[:2]
    s_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    quant = dot_product_attention(q, k_hat, v_hat, q_positions, s_pos, s_pos < m[:, None],
                                  sliding_window=self.sliding_window, out_dtype=jnp.float32)
    p, k_r, v_r = self._ring_segment(k_hat, v_hat)
    ring_valid = (p >= m[:, None]) & (p >= 0)
    exact = dot_product_attention(q, k_r, v_r, q_positions, p, ring_valid,
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
    return {"codes": size(self.k_codes, self.v_codes), "scales": size(self.k_scale, self.v_scale),
            "zeros": size(self.k_zero, self.v_zero), "residual": size(self.k_res, self.v_res),
            "lengths": size(self.lens)}

  def bytes_per_token(self) -> float:
    """Asymptotic bytes per cached token (this layer): packed codes + amortised scales
    and zero points of K (2H per G tokens) and V (2H/G per token); the O(R) exact
    window and the per-row lengths are excluded."""
    kh, h = self.k_res.shape[2], self.k_res.shape[3]
    sd = self.k_scale.dtype.itemsize
    codes = 4 * (self.k_codes.shape[-1] + self.v_codes.shape[-1])
    return float(kh * (codes + 2 * sd * h / self.group_size + 2 * sd * h / self.group_size))


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
