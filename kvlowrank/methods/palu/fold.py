"""Offline matrix fusions of Palu: Hadamard rotation, value→W_o, key→W_q, bias folds.

Shapes (input-major, y = x @ W): A [D, G·r] (group-major latent), B [G, r, gs·H],
W_o [N·H, D], W_q [D, N·H]. Query head n uses KV head n // (N/K), which sits in
group (n // (N/K)) // gs at slot (n // (N/K)) % gs of that group's B columns.
"""

from __future__ import annotations

import numpy as np

from kvlowrank.spec import ModelSpec


def per_head_b(b, spec: ModelSpec) -> np.ndarray:
  """[G, r, gs·H] group reconstruction → [K, r, H] per-KV-head slices B_{g,j}."""
  b = np.asarray(b)
  g, r, cols = b.shape
  gs = cols // spec.head_dim
  return b.reshape(g, r, gs, spec.head_dim).transpose(0, 2, 1, 3).reshape(
      g * gs, r, spec.head_dim)


def hadamard_fold(a, b, rot):
  """Folds an orthonormal rotation R into every group [Palu Eq. 8]: Â = A R, B̂ = Rᵀ B.

  Â B̂ = A R Rᵀ B = A B, so unquantized outputs are unchanged, while the latent
  ĥ = x Â = h R spreads SVD's leading-channel outliers over all r channels (what
  makes per-token low-bit quantization work). Zero run-time cost.

  Args:
    a: [D, G·r] down-projection.
    b: [G, r, n] reconstruction.
    rot: [r, r] orthonormal (normalised Walsh–Hadamard).
  Returns:
    (a_rot [D, G·r], b_rot [G, r, n]).
  """
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  rot = np.asarray(rot, np.float64)
  g, r, _ = b.shape
  if rot.shape != (r, r):
    raise ValueError(f"hadamard_fold: rotation must be [{r}, {r}], got {rot.shape}")
  if not np.allclose(rot @ rot.T, np.eye(r), atol=1e-8):
    raise ValueError("hadamard_fold: rotation is not orthonormal")
  a_rot = (a.reshape(a.shape[0], g, r) @ rot).reshape(a.shape)
  b_rot = np.einsum("sr,grn->gsn", rot.T, b)
  return a_rot, b_rot


def fold_value_into_wo(bv, wo, spec: ModelSpec) -> np.ndarray:
  """Eq. 6: a_n W^o_n = p_n H^v B^v_n W^o_n, so W^o'_n = B^v_n W^o_n ∈ R^{r×D}.

  The attention output of head n becomes p_n H^v_{group(n)} ∈ R^{r_v}; concatenated
  over heads it is [N·r_v] and multiplies the returned [N·r_v, D] matrix. When
  r_v > head_dim (G/J-LRD) this matrix is larger than W_o (digest §1.4 note).

  Args:
    bv: [G, r_v, gs·H] value reconstruction (after any Hadamard fold).
    wo: [N·H, D] original output projection.
    spec: model spec (N, K, H).
  Returns:
    [N·r_v, D] float64.
  """
  bh = per_head_b(bv, spec)                                # [K, r, H]
  wo = np.asarray(wo, np.float64).reshape(spec.n_heads, spec.head_dim, -1)
  kv_of = np.arange(spec.n_heads) // spec.group_size
  fused = np.einsum("nrh,nhd->nrd", bh[kv_of], wo)         # [N, r, D]
  return fused.reshape(-1, fused.shape[-1])


def fold_value_bias(bv_bias, wo, spec: ModelSpec) -> np.ndarray:
  """b_o' = Σ_n b^v_{kv(n)} W^o_n: since each softmax row sums to 1,
  p_n (H B + 1 b_vᵀ) = p_n H B + b_v, so the value bias leaves the cache entirely.

  (Padding queries, whose probabilities are all 0, get this constant instead of 0;
  their outputs are never used.)

  Returns:
    [D] float64 to add to (or use as) the o_proj bias.
  """
  bvb = np.asarray(bv_bias, np.float64).reshape(spec.n_kv_heads, spec.head_dim)
  wo = np.asarray(wo, np.float64).reshape(spec.n_heads, spec.head_dim, -1)
  kv_of = np.arange(spec.n_heads) // spec.group_size
  return np.einsum("nh,nhd->d", bvb[kv_of], wo)


def folded_output_bias(lp: dict, wo, spec: ModelSpec):
  """The layer's o_proj bias once its value bias `lp["bv"]` leaves the cache
  (`fold_value_bias`, plus `lp["bo"]` if any), [D] float64; None without a value bias."""
  if "bv" not in lp:
    return None
  bo = fold_value_bias(lp["bv"], wo, spec)
  if "bo" in lp:
    bo = bo + np.asarray(lp["bo"], np.float64)
  return bo


def fold_key_into_wq(wq, bk, spec: ModelSpec) -> np.ndarray:
  """Eq. 7 (models without RoPE): q_n K_nᵀ = x [W^q_n (B^k_n)ᵀ] (H^k)ᵀ.

  Returns W^q'  [D, N·r_k]: the query projected straight into the key latent space.
  The attention block of this framework always forms q = x W_q in head space (core
  contract), so `LatentCache.attend` applies the same product as q (B^k_n)ᵀ at run
  time; by associativity (x W_q) B_kᵀ = x (W_q B_kᵀ) this is the same fold, and its
  cost is per query token, independent of the cache length. This function is the
  offline form, used to verify that equivalence.
  """
  bh = per_head_b(bk, spec)                                # [K, r, H]
  wq = np.asarray(wq, np.float64).reshape(-1, spec.n_heads, spec.head_dim)
  kv_of = np.arange(spec.n_heads) // spec.group_size
  fused = np.einsum("dnh,nrh->dnr", wq, bh[kv_of])
  return fused.reshape(fused.shape[0], -1)
