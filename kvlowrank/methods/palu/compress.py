"""Palu end to end, offline: calibrate → allocate ranks → factorise → fold.

`calibrate` runs the model (Grams XᵀX, Fisher scores) once; `compress` turns a
calibration plus a `PaluSpec` into new parameters, so a sweep over granularity /
ratio / Hadamard / bits reuses one calibration.

Each compressed layer dict gains:
  palu_ak [D, G·r_k], palu_av [D, G·r_v]   down-projections (latent h = x A)
  palu_bk [G, r_k, gs·H]                     key reconstruction (used by the cache)
  palu_bv [G, r_v, gs·H]                     value reconstruction
and, where `PaluSpec.value_fold` folds (r_v <= head_dim by default), `wo` is replaced by
the value-folded [N·r_v, D] matrix; elsewhere `wo` stays and the cache applies B_v after
attention. The value bias is folded into `bo` either way. `wk`/`wv`/`bk`/`bv` stay: the
attention block still forms the dense projections (XLA removes them under jit when the cache
ignores them) and the key bias is added after reconstruction, before RoPE.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvlowrank.methods.palu import calibration, decompose, fold, rank_search
from kvlowrank.methods.palu.spec import (PaluLayout, PaluSpec, folds_value,
                                         resolve_group_size)
from kvlowrank.methods.palu.hadamard import hadamard_matrix
from kvlowrank.spec import ModelSpec

PALU_KEYS = ("palu_ak", "palu_av", "palu_bk", "palu_bv")


def hadamard_rotation(rank: int) -> np.ndarray:
  """Orthonormal [r, r] Walsh–Hadamard matrix (float64) for a group rank r.

  Raises:
    ValueError: no Hadamard construction for r (e.g. 184 = 8·23); the message says
      how to avoid it (a rank multiple of 16/32, or hadamard=False).
  """
  try:
    signs = np.sign(np.asarray(hadamard_matrix(rank, jnp.float32)))
  except ValueError as e:
    raise ValueError(f"PaluSpec.hadamard: no Hadamard matrix of order {rank} (a group "
                     f"rank); use rank_multiple=16 or 32, or hadamard=False ({e})") from None
  # Entries are exactly ±1/√r: rebuild them in float64 from the signs.
  return signs / np.sqrt(rank)


@dataclasses.dataclass(frozen=True)
class PaluCalibration:
  """Statistics of the dense model reused by every compression point."""

  grams: np.ndarray                   # [L, D, D] float64 XᵀX of the attention inputs
  n_tokens: int
  fisher: Optional[np.ndarray] = None  # [L, 2] (K, V) importance, None if not computed
  fisher_reduce: Optional[str] = None


def calibrate(params, spec: ModelSpec, windows, *, fisher_windows=None,
              fisher_reduce: str = "rms", batch_size: int = 4) -> PaluCalibration:
  """Collects Palu's calibration statistics on the dense model.

  Args:
    params: dense parameters.
    spec: model spec.
    windows: [n, T] token windows for the whitening Grams.
    fisher_windows: [m, T'] windows for the Fisher scores; None skips Fisher
      (uniform rank search only).
    fisher_reduce: "rms" | "sum_sq" (see `calibration.fisher_scores`).
    batch_size: windows per forward.
  Returns:
    PaluCalibration.
  """
  grams, n = calibration.gram_statistics(params, spec, windows, batch_size=batch_size)
  fisher = None
  if fisher_windows is not None:
    fisher = calibration.fisher_scores(params, spec, fisher_windows, reduce=fisher_reduce,
                                       batch_size=max(1, batch_size // 2))
  return PaluCalibration(grams=grams, n_tokens=n, fisher=fisher,
                         fisher_reduce=None if fisher is None else fisher_reduce)


def plan_layout(spec: ModelSpec, pspec: PaluSpec,
                fisher: Optional[np.ndarray] = None) -> PaluLayout:
  """Group size and per-layer ranks for `pspec` (no weights touched)."""
  gs = resolve_group_size(pspec, spec)
  n_groups = spec.n_kv_heads // gs
  group_dim = gs * spec.head_dim
  full_rank = min(spec.dim, group_dim)
  if pspec.rank_search == "fisher" and fisher is None and pspec.target_ratio > 0:
    raise ValueError("PaluSpec.rank_search='fisher' needs Fisher scores: calibrate with "
                     "fisher_windows")
  scores = fisher if pspec.rank_search == "fisher" else None
  rk, rv = rank_search.allocate_ranks(spec.n_layers, n_groups, group_dim, full_rank,
                                      target_ratio=pspec.target_ratio,
                                      multiple=pspec.rank_multiple, scores=scores)
  return PaluLayout(group_size=gs, n_groups=n_groups, group_dim=group_dim,
                    ranks_k=rk, ranks_v=rv)


def compress_layer(lp: dict, gram: Optional[np.ndarray], spec: ModelSpec, pspec: PaluSpec,
                   n_groups: int, rank_k: int, rank_v: int) -> dict:
  """Factorises one layer's K/V projections and applies the offline folds.

  Args:
    lp: dense layer dict.
    gram: [D, D] XᵀX of this layer's attention input (required for "whiten").
    spec, pspec: model and Palu specs.
    n_groups, rank_k, rank_v: layout of this layer.
  Returns:
    New layer dict (see module docstring); dtype of the original weights.
  """
  dtype = lp["wk"].dtype
  s_upper = None
  if pspec.decomposition == "whiten":
    if gram is None:
      raise ValueError("Palu whitened SVD needs the layer's XᵀX gram")
    s_upper, _ = decompose.whitening_factor(gram, damping=pspec.damping)
  ak, bk, _ = decompose.decompose_grouped(np.asarray(lp["wk"], np.float64), n_groups,
                                          rank_k, s_upper)
  av, bv, _ = decompose.decompose_grouped(np.asarray(lp["wv"], np.float64), n_groups,
                                          rank_v, s_upper)
  if pspec.hadamard:
    # Fold before fusing B_v into W_o (digest checklist 7), so the fused matrix
    # already sees the rotated latent.
    ak, bk = fold.hadamard_fold(ak, bk, hadamard_rotation(rank_k))
    av, bv = fold.hadamard_fold(av, bv, hadamard_rotation(rank_v))
  wo = np.asarray(lp["wo"], np.float64)
  out = dict(lp)
  out.update(palu_ak=jnp.asarray(ak, dtype), palu_av=jnp.asarray(av, dtype),
             palu_bk=jnp.asarray(bk, dtype), palu_bv=jnp.asarray(bv, dtype))
  if folds_value(pspec, rank_v, spec):
    out["wo"] = jnp.asarray(fold.fold_value_into_wo(bv, wo, spec), dtype)
  bo = fold.folded_output_bias(lp, wo, spec)
  if bo is not None:
    out["bo"] = jnp.asarray(bo, dtype)
  return out


def compress(params, spec: ModelSpec, pspec: PaluSpec,
             calib: Optional[PaluCalibration] = None):
  """Returns (compressed params, PaluLayout) for `pspec`.

  Args:
    params: dense parameters (not modified).
    spec: model spec.
    pspec: Palu spec.
    calib: statistics from `calibrate` (needed for "whiten" and "fisher").
  Returns:
    (params with Palu factors and folded W_o, layout with the exact ranks).
  Raises:
    ValueError: missing calibration for the requested decomposition/rank search, or
      params already compressed.
  """
  if any(k in params["layers"][0] for k in PALU_KEYS):
    raise ValueError("compress: params are already Palu-compressed")
  if pspec.decomposition == "whiten" and calib is None:
    raise ValueError("PaluSpec.decomposition='whiten' needs a calibration (calibrate())")
  layout = plan_layout(spec, pspec, None if calib is None else calib.fisher)
  if pspec.hadamard:  # fail before any factorisation work
    for r in sorted(set(layout.ranks_k + layout.ranks_v)):
      hadamard_rotation(r)
  layers = []
  for i, lp in enumerate(params["layers"]):
    gram = None if calib is None else calib.grams[i]
    layers.append(compress_layer(lp, gram, spec, pspec, layout.n_groups,
                                 layout.ranks_k[i], layout.ranks_v[i]))
  return dict(params, layers=layers), layout
