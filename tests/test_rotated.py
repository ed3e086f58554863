"""FDC / ZACK offline pieces: Eq. 1 widths, rotations, folds, the rate search, spec errors."""

import numpy as np
import pytest

from kvlowrank.methods.rotated import calibration, compression, search, widths
from kvlowrank.methods.rotated.spec import RotatedSpec
from kvlowrank.resources import shared_dir
from kvlowrank.spec import ModelSpec
from np_params import np_init_params
from docs_check import cites_results


def np_eq1(theta, r):
  """Independent float64 reading of FDC Eq. 1: the j with
  Σ_{i>j} θ_i / Σθ <= r < Σ_{i>=j} θ_i / Σθ, kept = j + 1 (explicit loop)."""
  t = np.sort(np.asarray(theta, np.float64))[::-1]
  total = t.sum()
  for j in range(len(t)):
    after, from_j = t[j + 1:].sum() / total, t[j:].sum() / total
    if after <= r < from_j or (j == len(t) - 1):
      return j + 1
  raise AssertionError


@pytest.mark.parametrize("seed", range(4))
def test_eq1_width_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  theta = np.exp(-rng.uniform(0, 0.3, 64).cumsum()) * rng.uniform(0.5, 2)
  for r in (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9, 0.999):
    assert widths.kept_width(theta, r) == np_eq1(theta, r), r
  # Order does not matter, rounding goes UP to the multiple and is capped at H.
  assert widths.kept_width(rng.permutation(theta), 0.1) == np_eq1(theta, 0.1)
  k = np_eq1(theta, 0.1)
  assert widths.round_width(k, 16, 64) == min(64, 16 * -(-k // 16))
  assert widths.round_width(63, 16, 64) == 64 and widths.round_width(1, 16, 64) == 16


def test_eq1_uses_singular_values_not_squares():
  """Negative control: the energy (squared) reading keeps fewer dims for a decaying
  spectrum, so a width function using squares would fail the check above."""
  theta = 0.8 ** np.arange(64)
  sums = widths.kept_width(theta, 0.05)
  squares = widths.kept_width(theta ** 2, 0.05)
  assert sums == np_eq1(theta, 0.05) and squares < sums


def test_r0_keeps_every_nonzero_direction():
  theta = np.concatenate([np.linspace(3, 1, 20), np.zeros(12)])
  assert widths.kept_width(theta, 0.0) == 20          # zero singular values drop exactly
  assert widths.kept_width(np.linspace(3, 1e-9, 32), 0.0) == 32


def test_rate_for_target_is_smallest_rate_reaching_the_target():
  rng = np.random.default_rng(0)
  sk = np.sort(rng.exponential(1.0, (3, 2, 64)) ** 3, -1)[..., ::-1]
  sv = np.sort(rng.exponential(1.0, (3, 2, 64)) ** 2, -1)[..., ::-1]
  dense = 2 * 64 * 6

  def removed(r):
    return 1 - (widths.widths_at(sk, r, 16).sum() + widths.widths_at(sv, r, 16).sum()) / dense

  r = widths.rate_for_target(sk, sv, 0.5, 16)
  assert removed(r) >= 0.5 > removed(r - 1e-6)
  kw, vw, used = widths.allocate(sk, sv, rate=0.0, target_ratio=0.5, allocation="adaptive",
                                 multiple=16)
  assert used == r and np.all(kw % 16 == 0) and np.all(vw % 16 == 0)
  assert len(set(kw.ravel()) | set(vw.ravel())) > 1          # ragged: adaptive differs
  kw, vw, used = widths.allocate(sk, sv, rate=0.0, target_ratio=0.5, allocation="uniform",
                                 multiple=16)
  assert used is None and set(kw.ravel()) == set(vw.ravel()) == {32}
  with pytest.raises(ValueError, match="target_ratio 0.9 is out of reach"):
    widths.rate_for_target(sk, sv, 0.9, 16)


SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=32,
                 ffn_dim=48)


def _params(seed=0):
  return np_init_params(SPEC, seed=seed, scale=0.25)


def test_gqa_shared_rotation_exact_at_full_width():
  """One R per KV head from the stacked post-RoPE Q (4 query heads) and K: every query
  head's scores are preserved exactly at full width; R is orthogonal and its singular
  values are those of the explicit stacked matrix (uncentered)."""
  import jax.numpy as jnp  # pylint: disable=C0415
  from kvlowrank.model.transformer import forward, qkv_projections  # pylint: disable=C0415
  params = _params()
  toks = np.random.default_rng(1).integers(0, 64, (2, 24))
  qk, _, n = calibration.gram_statistics(params, SPEC, toks)
  assert n == 48
  rot, sig = calibration.rotation_from_gram(qk)
  pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
  _, _, xs = forward(params, jnp.asarray(toks), pos, None, SPEC, capture_inputs=True)
  q, inp = qkv_projections(params["layers"][1], xs[1], pos, SPEC)
  q, k = np.asarray(q, np.float64), np.asarray(inp.k, np.float64)
  for g in range(2):
    r = rot[1, g]
    assert np.allclose(r.T @ r, np.eye(32), atol=1e-10)
    stack = np.concatenate([q[:, :, 4 * g + j].reshape(-1, 32) for j in range(4)]
                           + [k[:, :, g].reshape(-1, 32)])
    np.testing.assert_allclose(sig[1, g], np.linalg.svd(stack, compute_uv=False),
                               rtol=1e-4, atol=1e-4)
    for j in range(4):
      ref = np.einsum("bth,bsh->bts", q[:, :, 4 * g + j], k[:, :, g])
      got = np.einsum("bth,bsh->bts", q[:, :, 4 * g + j] @ r, k[:, :, g] @ r)
      np.testing.assert_allclose(got, ref, atol=1e-9)
    # Negative control: the other KV head's R on the keys breaks the identity.
    bad = np.einsum("bth,bsh->bts", q[:, :, 4 * g] @ r, k[:, :, g] @ rot[1, 1 - g])
    assert np.max(np.abs(bad - np.einsum("bth,bsh->bts", q[:, :, 4 * g], k[:, :, g]))) > 1e-2


def _fold_check(a, b, wv, wo_rows, x):
  """max |x A B W_O^n - x W_V^g W_O^n| for the n of one KV head."""
  return max(np.max(np.abs(x @ a @ (b @ w) - x @ wv @ w)) for w in wo_rows)


def test_zack_wo_fold_exact_at_full_width():
  params = _params(1)
  lp = params["layers"][0]
  rng = np.random.default_rng(2)
  v_gram = np.einsum("nh,ni->hi", *(2 * [rng.standard_normal((100, 64))]))[None, :32, :32]
  v_gram = np.concatenate([v_gram, v_gram * 2])
  a, b, s = compression.value_factors_zack(lp["wv"], lp["wo"], v_gram, SPEC)
  wv = np.asarray(lp["wv"], np.float64).reshape(64, 2, 32)
  wo = np.asarray(lp["wo"], np.float64).reshape(2, 4, 32, 64)
  x = rng.standard_normal((5, 64))
  for g in range(2):
    assert _fold_check(a[g], b[g], wv[:, g], wo[g], x) < 1e-10
    assert np.all(np.diff(s[g]) <= 1e-12)
    # Negative control: folding R instead of Rᵀ into W_O is wrong.
    assert _fold_check(a[g], b[g].T, wv[:, g], wo[g], x) > 1e-3
  # The whole folded W_O' of a layer at full width reproduces V W_O for every head.
  fo = compression.fold_wo([b[0], b[1]], lp["wo"], SPEC).reshape(8, 32, 64)
  for n in range(8):
    np.testing.assert_allclose(x @ a[n // 4] @ fo[n], x @ wv[:, n // 4] @ wo.reshape(8, 32, 64)[n],
                               atol=1e-10)


def test_fdc_values_reuse_palu_svd_exact_at_full_width():
  params = _params(2)
  lp = params["layers"][1]
  a, b, s = compression.value_factors_fdc(lp["wv"], SPEC)
  wv = np.asarray(lp["wv"], np.float64).reshape(64, 2, 32)
  wo = np.asarray(lp["wo"], np.float64).reshape(2, 4, 32, 64)
  x = np.random.default_rng(3).standard_normal((5, 64))
  for g in range(2):
    assert _fold_check(a[g], b[g], wv[:, g], wo[g], x) < 1e-10
    np.testing.assert_allclose(s[g], np.linalg.svd(wv[:, g], compute_uv=False), rtol=1e-10)
    assert _fold_check(a[g][:, :16], b[g][:16], wv[:, g], wo[g], x) > 1e-3   # truncated


def test_binary_search_terminates_and_respects_tolerance():
  base = 10.0
  f = lambda r: base * (1 + r * r)           # within 1% up to r = 0.1
  calls = []
  res = search.binary_search_rate(lambda r: calls.append(r) or f(r), base, tolerance=0.01,
                                  hi=0.5, steps=8, progress=None)
  assert len(calls) == 10 and res.value <= 1.01 * base == res.bound
  assert 0.1 - 0.5 / 2 ** 8 <= res.rate <= 0.1
  assert f(res.rate + 0.5 / 2 ** 7) > res.bound          # the next step up fails
  # Non-monotone (noisy) perplexity: still terminates; the answer passed when measured.
  noisy = lambda r: base * (1 + r * r + 0.02 * np.sin(300 * r))
  res = search.binary_search_rate(noisy, base, hi=0.9, steps=12, progress=None)
  assert len(res.history) == 14 and noisy(res.rate) <= res.bound
  assert all(ok == (v <= res.bound) for _, v, ok in res.history)
  # hi already passes: returned at once; lo failing: error.
  assert search.binary_search_rate(lambda r: base, base, progress=None).rate == 0.5
  with pytest.raises(ValueError, match="already exceeds the bound"):
    search.binary_search_rate(lambda r: 2 * base, base, progress=None)
  with pytest.raises(ValueError, match="0 <= lo < hi < 1"):
    search.binary_search_rate(f, base, hi=1.0, progress=None)


@pytest.mark.parametrize("kw,match", [
    (dict(rate=1.0), r"RotatedSpec.rate must be in \[0, 1\), got 1.0"),
    (dict(rate=-0.1), r"RotatedSpec.rate must be in \[0, 1\)"),
    (dict(target_ratio=1.0), r"RotatedSpec.target_ratio must be None or in \[0, 1\)"),
    (dict(width_multiple=12), r"RotatedSpec.width_multiple must be a positive multiple of 8"),
    (dict(width_multiple=0), r"RotatedSpec.width_multiple"),
    (dict(allocation="uniform"), r"RotatedSpec.target_ratio must be set for allocation"),
    (dict(allocation="greedy"), r"RotatedSpec.allocation must be one of"),
    (dict(calibration="wiki"), r"RotatedSpec.calibration must be one of"),
    (dict(v_decomposition="qr"), r"RotatedSpec.v_decomposition must be one of"),
    (dict(bits=3), r"RotatedSpec.bits must be None or one of"),
    (dict(bits=4, group_size=32), r"^RotatedSpec.width_multiple \(16\) must be a multiple of "
                                  r"RotatedSpec.group_size \(32\) when bits is set"),
    (dict(bits=4, width_multiple=8), r"^RotatedSpec.width_multiple \(8\) must be a multiple "
                                     r"of RotatedSpec.group_size \(16\) when bits is set"),
    (dict(group_size=0), r"RotatedSpec.group_size must be a positive int"),
    (dict(bits=4, residual=24), r"RotatedSpec.residual must be a multiple of group_size"),
    (dict(implementation="mosaic"), r"RotatedSpec.implementation must be None"),
])
def test_bad_specs_name_the_field(kw, match):
  with pytest.raises(ValueError, match=match) as e:
    RotatedSpec(**kw)
  assert "\n" not in str(e.value)


def test_width_multiple_and_quantizer_group_checked_before_calibration():
  """width_multiple=8 is fine unquantized or with G | 8; with bits and G = 16 a V' group
  would straddle two heads of width 8 + 8k: refused by the spec / the model check, before
  the calibration runs (negative control: the accepted spec does calibrate and cache)."""
  import jax.numpy as jnp  # pylint: disable=C0415
  from kvlowrank.methods import get_method, init_caches  # pylint: disable=C0415
  zack = get_method("zack")
  RotatedSpec(width_multiple=8)
  with pytest.raises(ValueError, match=r"RotatedSpec.width_multiple \(8\) must be a multiple "
                                       r"of RotatedSpec.group_size \(16\)") as e:
    zack.build_spec({"width_multiple": 8, "bits": 4}, SPEC)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"^RotatedSpec.group_size \(16\) must divide the "
                                       r"model's head_dim \(40\) when bits is set") as e:
    zack.build_spec({"bits": 4}, SPEC.replace(head_dim=40))
  assert "\n" not in str(e.value)
  # Before any work: parsing the config file refuses it (no model loaded, no calibration).
  if shared_dir() is not None:
    from test_experiment_configs import config_module  # pylint: disable=C0415
    from kvlowrank.experiment.spec import from_config  # pylint: disable=C0415
    c = config_module("zack").get_config("bits=4")
    c.zack.width_multiple = 8
    with pytest.raises(ValueError, match=r"RotatedSpec.width_multiple \(8\)") as e:
      from_config(c)
    assert "\n" not in str(e.value)
  # Accepted: G = 8 divides width_multiple = 8 and head_dim = 32; every head's width and
  # packed offset is a multiple of G, so no V' group straddles two heads.
  ok = zack.build_spec({"width_multiple": 8, "bits": 4, "group_size": 8, "residual": 16,
                        "target_ratio": 0.4, "calibration": "data"}, SPEC)
  toks = np.random.default_rng(0).integers(0, 64, (2, 24))
  cp = zack.calibrate(_params(), SPEC, ok, toks, workdir=None)
  [c0, _] = init_caches("zack", ok, SPEC, cp, batch=1, capacity=24, dtype=jnp.float32)
  assert c0.quant is not None and all(w % 8 == 0 for w in c0.v_widths)
  assert any(w % 16 for w in c0.k_widths + c0.v_widths)     # the 8-multiples are used


def test_bad_configs_through_the_registry():
  from kvlowrank.methods import get_method  # pylint: disable=C0415
  fdc = get_method("fdc")
  with pytest.raises(ValueError, match=r"config.fdc: .*rate|RotatedSpec.rate"):
    fdc.build_spec({"rate": 1.5})
  with pytest.raises(ValueError, match=r"width_multiple \(64\) must be <= the model's "
                                       r"head_dim \(32\)"):
    fdc.build_spec({"width_multiple": 64}, SPEC)
  with pytest.raises(ValueError, match="not FDC/ZACK-compressed"):
    from kvlowrank.methods import init_caches  # pylint: disable=C0415
    init_caches("rotated", RotatedSpec(), SPEC, _params(), batch=1, capacity=8)


@pytest.mark.skipif(shared_dir() is None,
                    reason="../shared not available (configs check their data paths)")
@pytest.mark.parametrize("name", ["fdc", "zack"])
def test_config_files(name):
  """configs/fdc.py and configs/zack.py: default, smoke and every sweep point validate."""
  from test_experiment_configs import SMOL, config_module  # pylint: disable=C0415
  from kvlowrank.experiment import config as config_lib  # pylint: disable=C0415
  from kvlowrank.experiment.spec import from_config  # pylint: disable=C0415
  module = config_module(name)
  assert "python experiments/" in module.__doc__ and cites_results(module.__doc__)
  c = module.get_config()
  assert from_config(c, SMOL).method == name
  assert from_config(c, SMOL).method_spec.calibration == ("random" if name == "fdc" else "data")
  for point in module.get_sweep():
    from_config(config_lib.apply_overrides(c, point), SMOL)
  assert from_config(module.get_config("smoke")).model.path == "random:tiny"
  with pytest.raises(ValueError, match="unknown config arg 'bitz'"):
    module.get_config("bitz=3")
