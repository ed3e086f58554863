"""Palu offline math in float64 numpy: whitening, whitened-SVD optimality, folds, rank search."""

import numpy as np
import pytest

from kvlowrank.methods.palu import decompose, fold, rank_search
from kvlowrank.methods.palu.compress import hadamard_rotation
from kvlowrank.methods.palu.spec import PaluSpec, default_group_size, resolve_group_size
from kvlowrank.spec import ModelSpec


def _calib(rng, n=400, d=24):
  # Anisotropic, correlated activations (like post-norm hidden states).
  mix = rng.standard_normal((d, d)) * np.geomspace(3.0, 0.05, d)[None, :]
  return rng.standard_normal((n, d)) @ mix.T


def test_whitening_identity():
  rng = np.random.default_rng(0)
  x = _calib(rng)
  gram = x.T @ x
  s, lam = decompose.whitening_factor(gram)
  assert lam == 0.0
  assert np.allclose(s, np.triu(s))                                    # upper triangular
  np.testing.assert_allclose(s.T @ s, gram, rtol=1e-10, atol=1e-9 * np.abs(gram).max())
  xw = np.linalg.solve(s.T, x.T).T                                      # X S⁻¹
  np.testing.assert_allclose(xw.T @ xw, np.eye(x.shape[1]), atol=1e-8)


def test_whitening_damping_fallback():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((5, 12))            # 5 tokens, D = 12: XᵀX has rank 5
  gram = x.T @ x
  s, lam = decompose.whitening_factor(gram, damping=1e-6)
  assert lam > 0
  np.testing.assert_allclose(s.T @ s, gram + lam * np.eye(12), rtol=1e-9, atol=1e-9)
  with pytest.raises(ValueError, match="square"):
    decompose.whitening_factor(np.ones((3, 4)))


@pytest.mark.parametrize("rank", [1, 5, 11, 16])
def test_whitened_svd_truncation_loss_is_discarded_energy(rank):
  """App. K.2: ‖XW − XAB‖_F² = Σ_{i>r} σ_i² exactly (no damping), and it beats plain SVD."""
  rng = np.random.default_rng(2)
  x = _calib(rng)
  w = rng.standard_normal((24, 16))
  s, _ = decompose.whitening_factor(x.T @ x)
  a, b, sig = decompose.whitened_svd(w, s, rank)
  assert a.shape == (24, rank) and b.shape == (rank, 16)
  loss = np.sum((x @ w - x @ a @ b) ** 2)
  np.testing.assert_allclose(loss, np.sum(sig[rank:] ** 2), rtol=1e-7, atol=1e-9)
  # Optimality against an independent rank-r alternative: plain SVD of W.
  pa, pb, _ = decompose.plain_svd(w, rank)
  plain_loss = np.sum((x @ w - x @ pa @ pb) ** 2)
  if rank < 16:
    assert loss < plain_loss
    # Negative control: a perturbed factor must lose more than the optimum.
    bad = np.sum((x @ w - x @ (a + 1e-3 * rng.standard_normal(a.shape)) @ b) ** 2)
    assert bad > loss
  else:
    assert loss < 1e-12 * np.sum((x @ w) ** 2)       # full rank is exact


def test_plain_svd_is_eckart_young():
  rng = np.random.default_rng(3)
  w = rng.standard_normal((20, 12))
  a, b, sig = decompose.plain_svd(w, 4)
  np.testing.assert_allclose(np.sum((w - a @ b) ** 2), np.sum(sig[4:] ** 2), rtol=1e-10)
  # the √Σ split is symmetric: column norms of A equal row norms of B
  np.testing.assert_allclose(np.linalg.norm(a, axis=0), np.linalg.norm(b, axis=1))


def test_rank_errors():
  w = np.zeros((8, 6))
  with pytest.raises(ValueError, match="rank 7"):
    decompose.plain_svd(w, 7)
  with pytest.raises(ValueError, match="rank 0"):
    decompose.whitened_svd(w, np.eye(8), 0)
  with pytest.raises(ValueError, match="groups do not divide"):
    decompose.decompose_grouped(w, 4, 1)


def test_grouped_decomposition_concatenates_groups():
  rng = np.random.default_rng(4)
  x = _calib(rng)
  w = rng.standard_normal((24, 12))
  s, _ = decompose.whitening_factor(x.T @ x)
  a, b, _ = decompose.decompose_grouped(w, 3, 4, s)   # full rank per 4-column group
  assert a.shape == (24, 12) and b.shape == (3, 4, 4)
  recon = np.concatenate([a[:, 4 * g:4 * g + 4] @ b[g] for g in range(3)], axis=1)
  np.testing.assert_allclose(recon, w, atol=1e-9)


@pytest.mark.parametrize("r", [8, 12, 16, 24, 48])
def test_hadamard_fold_preserves_product(r):
  rng = np.random.default_rng(5)
  a = rng.standard_normal((10, 2 * r))
  b = rng.standard_normal((2, r, 6))
  rot = hadamard_rotation(r)
  np.testing.assert_allclose(rot @ rot.T, np.eye(r), atol=1e-12)
  a2, b2 = fold.hadamard_fold(a, b, rot)
  for g in range(2):
    np.testing.assert_allclose(a2[:, g * r:(g + 1) * r] @ b2[g],
                               a[:, g * r:(g + 1) * r] @ b[g], atol=1e-10)
  # the latent really is rotated (not the identity)
  assert not np.allclose(a2, a)
  # negative control: folding a non-orthonormal matrix is rejected
  with pytest.raises(ValueError, match="orthonormal"):
    fold.hadamard_fold(a, b, 2 * rot)


def test_hadamard_unsupported_rank_is_clear():
  with pytest.raises(ValueError, match="rank_multiple=16"):
    hadamard_rotation(184)


def _gqa_spec(n, k, h=4):
  return ModelSpec(vocab_size=16, dim=12, n_layers=1, n_heads=n, n_kv_heads=k, head_dim=h,
                   ffn_dim=8)


@pytest.mark.parametrize("n,k,gs", [(4, 4, 2), (6, 2, 1), (8, 2, 2), (8, 1, 1)])
def test_value_and_key_folds_equal_explicit_reconstruction(n, k, gs):
  """Eq. 6/7 against per-head explicit reconstruction in float64 (GQA ratios 1,3,4,8)."""
  spec = _gqa_spec(n, k)
  h, g, r, s_len = spec.head_dim, k // gs, 3, 5
  rng = np.random.default_rng(n * 10 + k)
  bv = rng.standard_normal((g, r, gs * h))
  bk = rng.standard_normal((g, r, gs * h))
  wo = rng.standard_normal((n * h, spec.dim))
  wq = rng.standard_normal((spec.dim, n * h))
  bias_v = rng.standard_normal(k * h)
  hv = rng.standard_normal((s_len, g, r))                 # value latents of S tokens
  hk = rng.standard_normal((s_len, g, r))
  p = rng.dirichlet(np.ones(s_len), size=n)              # [N, S], rows sum to 1
  x = rng.standard_normal(spec.dim)
  # explicit: V = h B + b per KV head, attention, W_o
  v_full = np.einsum("sgr,grc->sgc", hv, bv).reshape(s_len, k, h) + bias_v.reshape(k, h)
  kv_of = np.arange(n) // (n // k)
  out = np.concatenate([p[i] @ v_full[:, kv_of[i]] for i in range(n)]) @ wo
  # folded: p h per head (latent width r), W_o' and b_o'
  grp = kv_of // gs
  lat = np.concatenate([p[i] @ hv[:, grp[i]] for i in range(n)])
  folded = lat @ fold.fold_value_into_wo(bv, wo, spec) + fold.fold_value_bias(bias_v, wo, spec)
  np.testing.assert_allclose(folded, out, rtol=1e-10, atol=1e-10)
  # key fold: q_n · k_n(s) == (x W_q') · h_k(s)
  k_full = np.einsum("sgr,grc->sgc", hk, bk).reshape(s_len, k, h)
  q = (x @ wq).reshape(n, h)
  scores = np.stack([k_full[:, kv_of[i]] @ q[i] for i in range(n)])
  q_lat = (x @ fold.fold_key_into_wq(wq, bk, spec)).reshape(n, r)
  scores_f = np.stack([hk[:, grp[i]] @ q_lat[i] for i in range(n)])
  np.testing.assert_allclose(scores_f, scores, rtol=1e-10, atol=1e-10)
  # negative control: the wrong head→group map breaks the fold
  if g > 1:
    bad = fold.fold_value_into_wo(bv[::-1], wo, spec)
    assert not np.allclose(lat @ bad + fold.fold_value_bias(bias_v, wo, spec), out)


def test_group_size_resolution():
  assert default_group_size(8) == 4 and default_group_size(3) == 3
  assert default_group_size(6) == 3 and default_group_size(5) == 1
  spec = _gqa_spec(8, 8)
  assert resolve_group_size(PaluSpec(granularity="m"), spec) == 1
  assert resolve_group_size(PaluSpec(granularity="j"), spec) == 8
  assert resolve_group_size(PaluSpec(granularity="g"), spec) == 4
  with pytest.raises(ValueError, match="group_size .3. must divide"):
    resolve_group_size(PaluSpec(granularity="g", group_size=3), spec)


def test_spec_errors():
  with pytest.raises(ValueError, match="bits"):
    PaluSpec(bits=5)
  with pytest.raises(ValueError, match="granularity"):
    PaluSpec(granularity="x")
  with pytest.raises(ValueError, match="target_ratio"):
    PaluSpec(target_ratio=1.0)
  with pytest.raises(ValueError, match="PaluSpec.value_fold"):
    PaluSpec(value_fold="never")


@pytest.mark.parametrize("target", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("fisher", [False, True])
def test_rank_search_hits_target(target, fisher):
  rng = np.random.default_rng(6)
  n_layers, n_groups, gdim, mult = 12, 2, 64, 8
  scores = rng.gamma(2.0, 1.0, (n_layers, 2)) if fisher else None
  rk, rv = rank_search.allocate_ranks(n_layers, n_groups, gdim, gdim, target_ratio=target,
                                      multiple=mult, scores=scores)
  ranks = np.array([rk, rv]).T
  assert np.all(ranks % mult == 0) and np.all(ranks >= mult) and np.all(ranks <= gdim)
  achieved = 1 - n_groups * ranks.sum() / (2 * n_layers * n_groups * gdim)
  # within half a step of one target (n_groups * multiple dims) of the budget
  step = n_groups * mult / (2 * n_layers * n_groups * gdim)
  assert abs(achieved - target) <= step / 2 + 1e-12
  if fisher:  # more important projections never get a smaller rank (up to one step)
    order = np.argsort(scores.reshape(-1))
    r = ranks.reshape(-1)[order]
    assert np.all(np.diff(r) >= -mult)
    assert r[-1] > r[0]
  else:
    assert ranks.max() - ranks.min() <= mult


def test_rank_search_caps_and_water_fills():
  # one projection dominates: it is capped at full rank and the rest is redistributed
  scores = np.array([[100.0, 1.0], [1.0, 1.0]])
  rk, rv = rank_search.allocate_ranks(2, 1, 32, 32, target_ratio=0.25, multiple=8,
                                      scores=scores)
  assert rk[0] == 32
  assert sum(rk) + sum(rv) == 96
  with pytest.raises(ValueError, match="minimum rank"):
    rank_search.allocate_ranks(2, 1, 32, 32, target_ratio=0.9, multiple=8)
  with pytest.raises(ValueError, match="scores must be"):
    rank_search.allocate_ranks(2, 1, 32, 32, target_ratio=0.5, multiple=8,
                               scores=np.ones((3, 2)))
