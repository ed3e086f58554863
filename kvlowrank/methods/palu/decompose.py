"""Low-rank factorisation of K/V projections: SVD-LLM whitened SVD and plain SVD.

Layout. Our weights are input-major (y = x @ W, W ∈ R^{D×n}), which matches the
paper's row-vector convention directly, so the paper's formulas apply without the
transposes of the official (torch, out×in) code:

  whitening  SᵀS = XᵀX (+ damping),  S upper triangular  (S = Lᵀ, L = chol(XᵀX))
  SVD        S W = U Σ Vᵀ
  factors    A = S⁻¹ U_r √Σ_r  ∈ R^{D×r}   (down-projection: the cached latent is h = x A)
             B = √Σ_r V_rᵀ     ∈ R^{r×n}   (reconstruction: y ≈ h B)

[Palu App. K.1/K.2] Because (X S⁻¹)ᵀ(X S⁻¹) = S⁻ᵀ XᵀX S⁻¹ = I, the calibration-set
truncation loss is exactly ‖XW − XAB‖_F² = Σ_{i>r} σ_i² (the paper writes "≈" because
of the damping λ; with λ = 0 it is an identity). The official code adds damping only
when Cholesky fails; we do the same (see `whitening_factor`).

All of this runs once, offline, in float64 numpy (Cholesky and SVD of D×D / D×n
matrices); the factors are cast to the model dtype by the caller.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import scipy.linalg


def whitening_factor(gram, *, damping: float = 1e-6, max_tries: int = 8):
  """Upper-triangular S with SᵀS = XᵀX (+ λI only if needed).

  The official code adds (−λ_min + 1e-3)·I after a failed Cholesky; we add
  λ = max(−λ_min, 0) + damping·mean(diag) (relative, so scale-free), growing ×10 on
  each retry.

  Args:
    gram: [D, D] symmetric XᵀX (any float dtype; computed in float64).
    damping: relative damping for the fallback.
    max_tries: number of damped retries before giving up.
  Returns:
    (S [D, D] float64 upper triangular, lam) with SᵀS = gram + lam·I; lam = 0.0 when
    the plain Cholesky succeeded.
  Raises:
    ValueError: gram is not square/symmetric or stays non-PD after all retries.
  """
  c = np.asarray(gram, np.float64)
  if c.ndim != 2 or c.shape[0] != c.shape[1]:
    raise ValueError(f"whitening: gram must be square [D, D], got {c.shape}")
  if not np.allclose(c, c.T, rtol=1e-6, atol=1e-8 * max(1.0, np.abs(c).max())):
    raise ValueError("whitening: gram matrix is not symmetric")
  c = 0.5 * (c + c.T)
  try:
    return np.linalg.cholesky(c).T, 0.0
  except np.linalg.LinAlgError:
    pass
  lam_min = float(np.linalg.eigvalsh(c)[0])
  scale = float(np.mean(np.diag(c))) or 1.0
  lam = max(-lam_min, 0.0) + damping * scale
  for _ in range(max_tries):
    try:
      return np.linalg.cholesky(c + lam * np.eye(c.shape[0])).T, lam
    except np.linalg.LinAlgError:
      lam *= 10.0
  raise ValueError("whitening: XᵀX is not positive definite even after damping "
                   f"(last λ = {lam:.3g}); use more calibration tokens")


def _check_rank(rank: int, w: np.ndarray, who: str) -> None:
  full = min(w.shape)
  if not 1 <= rank <= full:
    raise ValueError(f"{who}: rank {rank} must be in [1, min(D, n) = {full}] for a "
                     f"{w.shape[0]}x{w.shape[1]} weight")


def whitened_svd(w, s_upper, rank: int):
  """Truncation-aware SVD (SVD-LLM) of an input-major weight.

  Args:
    w: [D, n] weight (y = x @ w).
    s_upper: [D, D] upper-triangular whitening factor from `whitening_factor`.
    rank: kept rank r, 1 <= r <= min(D, n).
  Returns:
    (a [D, r], b [r, n], sigma [min(D, n)]) float64, with a @ b the rank-r
    approximation minimising ‖X(W − AB)‖_F on the calibration data.
  """
  w = np.asarray(w, np.float64)
  _check_rank(rank, w, "whitened_svd")
  u, sig, vt = np.linalg.svd(s_upper @ w, full_matrices=False)
  root = np.sqrt(sig[:rank])
  # A = S⁻¹ U_r √Σ_r via a triangular solve (never form S⁻¹ explicitly).
  a = scipy.linalg.solve_triangular(s_upper, u[:, :rank] * root, lower=False)
  b = root[:, None] * vt[:rank]
  return a, b, sig


def plain_svd(w, rank: int):
  """Data-free SVD [Palu Eq. 4]: A = U_r √Σ_r, B = √Σ_r V_rᵀ (ablation baseline)."""
  w = np.asarray(w, np.float64)
  _check_rank(rank, w, "plain_svd")
  u, sig, vt = np.linalg.svd(w, full_matrices=False)
  root = np.sqrt(sig[:rank])
  return u[:, :rank] * root, root[:, None] * vt[:rank], sig


def decompose_grouped(w, n_groups: int, rank: int, s_upper: Optional[np.ndarray] = None):
  """Factorises W = [W_1 … W_G] group by group (G-LRD; G = n_kv_heads/gs).

  Args:
    w: [D, K*H] projection; group g owns the contiguous columns of KV heads
      [g*gs, (g+1)*gs).
    n_groups: number of groups (must divide the column count).
    rank: rank per group.
    s_upper: whitening factor (shared by all groups: same input X); None = plain SVD.
  Returns:
    (a [D, n_groups*rank], b [n_groups, rank, K*H/n_groups], sigmas [n_groups, m]).
    The latent of a token is h = x @ a, laid out group-major ([G, r] flattened).
  """
  w = np.asarray(w, np.float64)
  if w.shape[1] % n_groups:
    raise ValueError(f"decompose_grouped: {n_groups} groups do not divide {w.shape[1]} "
                     "output columns")
  cols = w.shape[1] // n_groups
  a_list, b_list, s_list = [], [], []
  for g in range(n_groups):
    wg = w[:, g * cols:(g + 1) * cols]
    if s_upper is None:
      a, b, s = plain_svd(wg, rank)
    else:
      a, b, s = whitened_svd(wg, s_upper, rank)
    a_list.append(a)
    b_list.append(b)
    s_list.append(s)
  return np.concatenate(a_list, axis=1), np.stack(b_list), np.stack(s_list)
