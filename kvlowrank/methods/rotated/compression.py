"""FDC / ZACK offline: rotations and value factors per KV head → widths → folded parameters.

Per layer and KV head g (H = head dim, D = model width, query heads n of the group):
  keys (both recipes): R_g, θ_g from the uncentered Q-K stack (`calibration`); the cache
    stores K'_g = RoPE(K_g) R_g[:, :k_g] and the query is rotated the same way online
    (RoPE blocks folding R into W_Q/W_K; both papers do this matmul after RoPE).
  values, as a down-projection A_g [D, H] and a reconstruction B_g [H, H] with V_g = x A_g B_g:
    FDC  (Palu's decomposition code, `palu.decompose`): SVD of W_V^g (or Palu's whitened
         SVD), A = U√Σ, B = √Σ Vᵀ; θ = the (whitened) weight's singular values.
    ZACK: R_v from the Gram of [V_g; W_O^{n ᵀ} of the group's query heads], A = W_V^g R_v
         (R folded into W_V), B = R_vᵀ (Rᵀ folded into the W_O row blocks); θ = its
         singular values.
  The cache stores V'_g = x A_g[:, :v_g]; B_g[:v_g] is folded into W_O: head n's row block
  becomes B_g[:v_g] W_O^n. A value bias b_v leaves the cache (Palu's `fold_value_bias`:
  softmax rows sum to 1, so p (V + 1 b_vᵀ) W_O = p V W_O + b_v W_O).

Ragged heads in the attention block: the cache returns head n's output in its group's
value space, zero-padded to v_max = max over the layer's KV heads of v_g, so the block's
out.reshape(B, T, N·v_max) @ W_O' works unchanged; the folded W_O' is [N·v_max, D] with
zero rows in each head's padding (the padding is in the transient output, never stored).

Each compressed layer dict gains (K = KV heads, k_max / v_max = the layer's widest head)
  rot_rk [K, H, k_max] key rotations per KV head (head g's first k_g columns R_g[:, :k_g],
    the rest zero), rot_av [D, ΣV] value down-projections (heads concatenated, no padding),
  rot_bv [K, v_max, H] value reconstructions per KV head (first v_g rows B_g[:v_g], the rest
    zero; materialize only), rot_kw / rot_vw int32 [K] widths,
and `wo` is replaced by the folded [N·v_max, D] matrix (value bias folded into `bo`).
Per-head padded weights (rather than one block-diagonal [K·H, Σk] matrix) split over a
tensor-parallel mesh on their head axis (`kvlowrank.parallel`, `sharding.balance`); the
cache slices each head's k_g / v_g columns statically, so K', V' and the kernels' operands
stay packed [.., Σk] without padding. The padded weights cost K·H·(k_max + v_max) values
per layer (the block-diagonal matrices they replace: K·H·(Σk + Σv));
`RotatedCache.weights_nbytes` counts them as stored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvlowrank.methods.palu import decompose, fold
from kvlowrank.methods.rotated import calibration, widths
from kvlowrank.methods.rotated.spec import RECIPES, RotatedLayout, RotatedSpec
from kvlowrank.spec import ModelSpec

ROT_KEYS = ("rot_rk", "rot_av", "rot_bv", "rot_kw", "rot_vw")


@dataclasses.dataclass(frozen=True)
class RotatedCalibration:
  """Grams of the dense model reused by every compression point of a sweep."""

  qk_grams: np.ndarray                  # [L, K, H, H] float64, Σ over the Q-K stacks
  v_grams: np.ndarray                   # [L, K, H, H] float64, VᵀV
  n_tokens: int
  x_grams: Optional[np.ndarray] = None  # [L, D, D] XᵀX (FDC v_decomposition="whiten")


@dataclasses.dataclass(frozen=True)
class Factors:
  """Full-width factors of every (layer, KV head), before truncation."""

  rk: np.ndarray       # [L, K, H, H] key rotations (columns by descending θ)
  sk: np.ndarray       # [L, K, H]
  av: np.ndarray       # [L, K, D, H] value down-projections
  bv: np.ndarray       # [L, K, H, H] value reconstructions
  sv: np.ndarray       # [L, K, H]


def value_factors_fdc(wv, spec: ModelSpec, s_upper=None):
  """FDC values through Palu's decomposition: per KV head (M-LRD) SVD of W_V^g, whitened
  when `s_upper` is given. Returns (A [K, D, H], B [K, H, H], θ [K, H])."""
  w = np.asarray(wv, np.float64)
  h = spec.head_dim
  a, b, s = decompose.decompose_grouped(w, spec.n_kv_heads, min(h, w.shape[0]), s_upper)
  a = a.reshape(w.shape[0], spec.n_kv_heads, -1).transpose(1, 0, 2)
  if a.shape[-1] < h:   # D < H: pad with zero directions (never kept at r < 1 anyway)
    pad = h - a.shape[-1]
    a = np.pad(a, ((0, 0), (0, 0), (0, pad)))
    b = np.pad(b, ((0, 0), (0, pad), (0, 0)))
    s = np.pad(s, ((0, 0), (0, pad)))
  return a, b, s


def value_factors_zack(wv, wo, v_gram, spec: ModelSpec):
  """ZACK values: R_v from VᵀV + Σ_n W_O^n W_O^nᵀ per KV head; A = W_V^g R_v, B = R_vᵀ."""
  h, kh, g = spec.head_dim, spec.n_kv_heads, spec.group_size
  wv = np.asarray(wv, np.float64).reshape(-1, kh, h).transpose(1, 0, 2)      # [K, D, H]
  wo_h = np.asarray(wo, np.float64).reshape(kh, g, h, -1)                   # [K, G, H, D]
  gram = np.asarray(v_gram, np.float64) + np.einsum("kghd,kgid->khi", wo_h, wo_h)
  r, s = calibration.rotation_from_gram(gram)                               # [K, H, H]
  return wv @ r, np.swapaxes(r, -1, -2), s


def factorise(params, spec: ModelSpec, rspec: RotatedSpec, calib: RotatedCalibration,
              recipe: str) -> Factors:
  """Full-width factors of every layer (the SVDs; seconds, once per calibration)."""
  if recipe not in RECIPES:
    raise ValueError(f"rotated recipe must be one of {RECIPES}, got {recipe!r}")
  rk, sk = calibration.rotation_from_gram(calib.qk_grams)
  av, bv, sv = [], [], []
  for i, lp in enumerate(params["layers"]):
    if recipe == "zack":
      a, b, s = value_factors_zack(lp["wv"], lp["wo"], calib.v_grams[i], spec)
    else:
      s_upper = None
      if rspec.v_decomposition == "whiten":
        if calib.x_grams is None:
          raise ValueError("RotatedSpec.v_decomposition='whiten' needs the layer inputs' "
                           "XᵀX (calibrate with data windows)")
        s_upper, _ = decompose.whitening_factor(calib.x_grams[i])
      a, b, s = value_factors_fdc(lp["wv"], spec, s_upper)
    av.append(a)
    bv.append(b)
    sv.append(s)
  return Factors(rk=rk, sk=sk, av=np.stack(av), bv=np.stack(bv), sv=np.stack(sv))


def plan_layout(spec: ModelSpec, rspec: RotatedSpec, factors: Factors):
  """(RotatedLayout, rate used) for `rspec` from the factors' spectra."""
  kw, vw, rate = widths.allocate(factors.sk, factors.sv, rate=rspec.rate,
                                 target_ratio=rspec.target_ratio,
                                 allocation=rspec.allocation, multiple=rspec.width_multiple)
  to_t = lambda a: tuple(tuple(int(x) for x in row) for row in a)
  return RotatedLayout(head_dim=spec.head_dim, k_widths=to_t(kw), v_widths=to_t(vw)), rate


def pad_heads(blocks, axis: int) -> np.ndarray:
  """Stacks per-head blocks, zero-padded along `axis` (of a block) to the widest: [K, ...]."""
  width = max(b.shape[axis] for b in blocks)
  out = []
  for b in blocks:
    pad = [(0, 0)] * b.ndim
    pad[axis] = (0, width - b.shape[axis])
    out.append(np.pad(b, pad))
  return np.stack(out)


def fold_wo(bv_blocks, wo, spec: ModelSpec) -> np.ndarray:
  """W_O' [N·v_max, D]: head n's rows are B_g[:v_g] W_O^n, then zero rows up to v_max."""
  h, g = spec.head_dim, spec.group_size
  wo = np.asarray(wo, np.float64).reshape(spec.n_heads, h, -1)
  vmax = max(b.shape[0] for b in bv_blocks)
  out = np.zeros((spec.n_heads, vmax, wo.shape[-1]))
  for n in range(spec.n_heads):
    b = bv_blocks[n // g]
    out[n, :b.shape[0]] = b @ wo[n]
  return out.reshape(-1, wo.shape[-1])


def compress_layer(lp: dict, spec: ModelSpec, factors: Factors, i: int, k_widths,
                   v_widths) -> dict:
  """One layer's rotated entries and folded W_O (module docstring); weights' dtype."""
  dtype = lp["wk"].dtype
  rk = [factors.rk[i, g][:, :w] for g, w in enumerate(k_widths)]
  av = [factors.av[i, g][:, :w] for g, w in enumerate(v_widths)]
  bv = [factors.bv[i, g][:w] for g, w in enumerate(v_widths)]
  wo = np.asarray(lp["wo"], np.float64)
  out = dict(lp)
  out.update(rot_rk=jnp.asarray(pad_heads(rk, 1), dtype),
             rot_av=jnp.asarray(np.concatenate(av, axis=1), dtype),
             rot_bv=jnp.asarray(pad_heads(bv, 0), dtype),
             rot_kw=jnp.asarray(np.asarray(k_widths), jnp.int32),
             rot_vw=jnp.asarray(np.asarray(v_widths), jnp.int32),
             wo=jnp.asarray(fold_wo(bv, wo, spec), dtype))
  bo = fold.folded_output_bias(lp, wo, spec)
  if bo is not None:
    out["bo"] = jnp.asarray(bo, dtype)
  return out


def compress(params, spec: ModelSpec, rspec: RotatedSpec, calib: RotatedCalibration,
             recipe: str, factors: Optional[Factors] = None):
  """Returns (compressed params, RotatedLayout, rate used or None) for `rspec`.

  Args:
    params: dense parameters (not modified).
    spec: model spec.
    rspec: the method spec.
    calib: Grams from `calibration.gram_statistics` (+ XᵀX for whitened FDC values).
    recipe: "fdc" | "zack".
    factors: `factorise(...)` output to reuse across points (None: computed here).
  """
  if any(k in params["layers"][0] for k in ROT_KEYS):
    raise ValueError("compress: params are already FDC/ZACK-compressed")
  if factors is None:
    factors = factorise(params, spec, rspec, calib, recipe)
  layout, rate = plan_layout(spec, rspec, factors)
  layers = [compress_layer(lp, spec, factors, i, layout.k_widths[i], layout.v_widths[i])
            for i, lp in enumerate(params["layers"])]
  return dict(params, layers=layers), layout, rate
