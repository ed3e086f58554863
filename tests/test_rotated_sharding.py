"""Balancing FDC/ZACK's ragged KV heads for a tensor-parallel mesh
(`kvlowrank.methods.rotated.sharding`), on one device: the round structure, brute-force
optimality, exactness of the balanced model (permutation + zero padding) with a negative
control, the rotated cache's local/global widths and the one-line errors. The sharded runs
on 4 simulated devices are in tests/parallel_worker.py."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import parallel
from kvlowrank.cache import base, init_caches
from kvlowrank.methods import rotated
from kvlowrank.methods.rotated import sharding
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from np_params import np_init_params
from rotated_params import ragged_rotated_params

SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64,
                 ffn_dim=48, qkv_bias=True, max_seq_len=64)
K_WIDTHS = ((16, 48, 32, 64), (64, 16, 16, 32))
V_WIDTHS = ((64, 16, 32, 48), (32, 32, 16, 64))


@functools.lru_cache(maxsize=None)
def _params():
  dense = np_init_params(SPEC, seed=0, scale=0.25)
  dense = dict(dense, layers=[dict(lp, bo=0.1 * lp["bq"][:SPEC.dim]) for lp in dense["layers"]])
  return ragged_rotated_params(dense, SPEC, K_WIDTHS, V_WIDTHS, seed=1)


def _cost(k, v, rounds):
  return sum(max(k[g] for g in r) + max(v[g] for g in r) for r in rounds)


def _brute_force(k, v, tp):
  """The least Σ over slots of (max k + max v) over every assignment of heads to slots."""
  n = len(k)
  return min(_cost(k, v, [p[j:j + tp] for j in range(0, n, tp)])
             for p in itertools.permutations(range(n)))


def _plan_cost(k, v, tp):
  _, ks, vs = sharding.plan(k, v, tp)
  return sum(ks) + sum(vs)


@pytest.mark.parametrize("n,tp", [(4, 2), (6, 2), (6, 3), (8, 4)])
def test_plan_rounds(n, tp):
  """Each slot j holds round j (the j-th tp heads by k + v, descending) on every device,
  its widths the round's maxima, device-major order; every device's widths are equal."""
  rng = np.random.default_rng(n * 10 + tp)
  k, v = 16 * rng.integers(1, 5, n), 16 * rng.integers(1, 5, n)
  perm, ks, vs = sharding.plan(k, v, tp)
  m = n // tp
  assert sorted(perm) == list(range(n)) and len(ks) == len(vs) == m
  order = sorted(range(n), key=lambda g: (-(k[g] + v[g]), g))
  for j in range(m):
    heads = [perm[i * m + j] for i in range(tp)]
    assert sorted(heads) == sorted(order[j * tp:(j + 1) * tp])
    assert ks[j] == max(k[g] for g in heads) and vs[j] == max(v[g] for g in heads)
    assert all(ks[j] >= k[g] and vs[j] >= v[g] for g in heads)
  assert sharding.unbalanced(ks * tp, vs * tp, tp) is None


@pytest.mark.parametrize("n,tp", [(4, 2), (6, 2), (6, 3)])
def test_plan_is_optimal_for_one_cost(n, tp):
  """One cost (values all one width; or keys and values ordering the heads alike): the
  sorted rounds' padding equals the brute-force minimum over every assignment."""
  rng = np.random.default_rng(n + tp)
  for _ in range(5):
    k = 16 * rng.integers(1, 9, n)
    flat = np.full(n, 32)
    assert _plan_cost(k, flat, tp) == _brute_force(k, flat, tp)
    v = 16 * (np.argsort(np.argsort(k, kind="stable"), kind="stable") // 2 + 1)  # same order
    assert _plan_cost(k, v, tp) == _brute_force(k, v, tp)
  # Negative control: the identity assignment of an interleaved layout pads more.
  k = np.array([16, 128, 16, 128])
  assert _cost(k, np.full(4, 16), [(0, 1), (2, 3)]) > _brute_force(k, np.full(4, 16), 2)


def test_plan_with_two_costs_hand_worked():
  """Keys and values ordering the heads differently (layer 0): sums k + v are 80, 64, 64,
  112, so the rounds are (3, 0) and (1, 2), device 0 holds heads 3, 1 and device 1 heads
  0, 2, slots K (64, 48) / V (64, 32); here that is also the brute-force optimum."""
  perm, ks, vs = sharding.plan(K_WIDTHS[0], V_WIDTHS[0], 2)
  assert perm == (3, 1, 0, 2) and ks == (64, 48) and vs == (64, 32)
  assert _plan_cost(K_WIDTHS[0], V_WIDTHS[0], 2) == _brute_force(K_WIDTHS[0], V_WIDTHS[0], 2)


def test_padding_fraction():
  """(tp·Σ slot widths − Σ kept widths) / Σ kept widths over the layers; 0 at tp = 1."""
  p = _params()
  kept = sum(map(sum, K_WIDTHS)) + sum(map(sum, V_WIDTHS))
  padded = 0
  for kw, vw in zip(K_WIDTHS, V_WIDTHS):
    _, ks, vs = sharding.plan(kw, vw, 2)
    padded += 2 * (sum(ks) + sum(vs))
  assert sharding.padding_fraction(p, 2) == pytest.approx(padded / kept - 1)
  assert sharding.padding_fraction(p, 2) > 0
  assert sharding.padding_fraction(p, 1) == 0.0
  b = rotated.balance(p, SPEC, 2)     # the balanced widths are what the cache stores
  layout = rotated.layout_from_params(b, SPEC.head_dim)
  assert layout.kept_dims() == padded


@functools.partial(jax.jit, static_argnames=("spec",))
def _fwd(params, toks, pos, caches, spec):
  return forward(params, toks, pos, caches, spec)


def _run(params, bits=None, t=10):
  """Prefill t tokens (row 1 padded at the end) + 2 decode steps → logits per call."""
  rng = np.random.default_rng(2)
  toks = rng.integers(0, SPEC.vocab_size, (2, t + 2)).astype(np.int32)
  pos = np.broadcast_to(np.arange(t + 2, dtype=np.int32), (2, t + 2)).copy()
  pos[1, t - 3:t] = -1
  caches = init_caches("fdc", rotated.RotatedSpec(bits=bits, group_size=16, residual=0),
                       SPEC, params, batch=2, capacity=t + 2, dtype=jnp.float32)
  out = []
  for lo, hi in ((0, t), (t, t + 1), (t + 1, t + 2)):
    logits, caches = _fwd(params, jnp.asarray(toks[:, lo:hi]), jnp.asarray(pos[:, lo:hi]),
                          caches, SPEC)
    out.append(np.asarray(logits))
  return out


def _diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def test_balanced_model_equals_unbalanced_on_one_device():
  """Permuting heads and zero-padding widths is exact: the balanced model's logits (tp = 2
  and 4) equal the unbalanced model's to fp32 rounding; the identity at tp = 1. Negative
  control: the tp = 2 permutation applied to the keys (and the rest) but not to the query
  heads (wq, bq) changes the logits."""
  p = _params()
  assert rotated.balance(p, SPEC, 1) is p
  ref = _run(p)
  scale = float(np.max(np.abs(ref[0])))
  for tp in (2, 4):
    b = rotated.balance(p, SPEC, tp)
    for lp, lb in zip(p["layers"], b["layers"]):
      assert lb["rot_av"].shape[1] >= lp["rot_av"].shape[1]
      assert lb["wo"].shape == lp["wo"].shape and lb["rot_rk"].shape == lp["rot_rk"].shape
    assert _diff(ref, _run(b)) <= 1e-5 * max(1.0, scale)
  b = rotated.balance(p, SPEC, 2)
  bad = dict(b, layers=[dict(lb, wq=lp["wq"], bq=lp["bq"])
                        for lp, lb in zip(p["layers"], b["layers"])])
  assert _diff(ref, _run(bad)) > 1e-2 * max(1.0, scale)


def test_cache_local_and_global_widths():
  """`for_spec(local)` gives a device its block of the balanced heads' widths (equal on
  every device) and `for_spec(global)` restores them; unbalanced widths and quantized
  K'/V' on a model axis > 1 are one-line errors naming the fix."""
  p = _params()
  b = rotated.balance(p, SPEC, 2)
  local = parallel.local_spec(SPEC, 2)
  [c0, _] = init_caches("fdc", rotated.RotatedSpec(), SPEC, b, batch=1, capacity=16,
                        dtype=jnp.float32)
  kh, h = SPEC.n_kv_heads, SPEC.head_dim   # the padded per-head weights, as stored
  assert c0.weights_nbytes() == 4 * (kh * h * 64 + kh * 64 * h + kh * h)
  lc = c0.for_spec(local)
  assert lc.k_widths == (64, 48) and lc.v_widths == (64, 32) and lc.spec == local
  back = lc.for_spec(SPEC)
  assert back.k_widths == c0.k_widths and back.v_widths == c0.v_widths
  assert c0.for_spec(SPEC) == c0
  specs = parallel.cache_specs((c0,))[0]
  assert specs.k_rot == jax.sharding.PartitionSpec(parallel.DATA, None, parallel.MODEL)
  assert specs.rk == jax.sharding.PartitionSpec(parallel.MODEL, None, None)
  [u0, _] = init_caches("fdc", rotated.RotatedSpec(), SPEC, p, batch=1, capacity=16,
                        dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"rotated.balance\(params, spec, tp=2\)") as e:
    u0.for_spec(local)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"rotated.balance") as e:
    sharding.check_balanced(p, 2)
  assert "\n" not in str(e.value)
  sharding.check_balanced(b, 2)
  [q0, _] = init_caches("fdc", rotated.RotatedSpec(bits=4, group_size=16, residual=16), SPEC,
                        b, batch=1, capacity=16, dtype=jnp.float32)
  assert q0.for_spec(SPEC) == q0        # data-parallel only: fine
  with pytest.raises(ValueError, match=r"RotatedSpec.bits=4") as e:
    q0.for_spec(local)
  assert "\n" not in str(e.value)


def test_quantized_balanced_model_equals_unbalanced():
  """Balancing is exact for the quantized store too (per-channel key groups and per-token
  value groups of 16 never mix heads; zero channels quantize to zero): 26 prompt tokens, no
  exact window, so one 16-token key group and every value token are 4-bit codes (their
  error against the unquantized cache is the check that they are)."""
  p = _params()
  ref, got = _run(p, bits=4, t=26), _run(rotated.balance(p, SPEC, 2), bits=4, t=26)
  scale = max(1.0, float(np.max(np.abs(ref[0]))))
  assert _diff(ref, got) <= 1e-4 * scale
  assert _diff(ref, _run(p, t=26)) > 1e-3 * scale


@pytest.mark.parametrize("case,needle", [
    ("tp", "ModelSpec.n_kv_heads=4 does not split over mesh model=3"),
    ("dense", "params are not FDC/ZACK-compressed"),
    ("unknown", "params['layers'][0]['palu_bk']: balance does not know"),
    ("old_layout", "old block-diagonal layout"),
])
def test_one_line_errors(case, needle):
  p = _params()
  with pytest.raises(ValueError) as e:
    if case == "tp":
      rotated.balance(p, SPEC, 3)
    elif case == "dense":
      rotated.balance(np_init_params(SPEC), SPEC, 2)
    elif case == "unknown":
      rotated.balance(dict(p, layers=[dict(lp, palu_bk=lp["wk"]) for lp in p["layers"]]),
                      SPEC, 2)
    else:
      old = dict(p, layers=[dict(lp, rot_rk=lp["rot_rk"].reshape(-1, lp["rot_rk"].shape[-1]))
                            for lp in p["layers"]])
      init_caches("fdc", rotated.RotatedSpec(), SPEC, old, batch=1, capacity=16)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_kernel_operands_on_balanced_heads():
  """The decode kernel's path (its jnp reference here: `_attend_kernel` packs q_rot from the
  per-head rotations and unpacks the [B, G, Σv] output) equals the cache's attention on a
  balanced layer, globally and on one device's block of heads (`for_spec(local)` with the
  arrays of its heads); negative control: the other device's arrays give other outputs."""
  b = rotated.balance(_params(), SPEC, 2)
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 12, SPEC.dim)), jnp.float32)
  caches = init_caches("fdc", rotated.RotatedSpec(), SPEC, b, batch=2, capacity=16,
                       dtype=jnp.float32)
  c, lp = caches[0], b["layers"][0]
  k = jnp.asarray(rng.standard_normal((2, 12, SPEC.n_kv_heads, SPEC.head_dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  c = c.update(base.AttnInputs(x=x, k=k, k_pre=k, v=k, positions=pos), lp)
  q = jnp.asarray(rng.standard_normal((2, 1, SPEC.n_heads, SPEC.head_dim)), jnp.float32)
  qpos = jnp.full((2, 1), 11, jnp.int32)
  want = c.attend(q, qpos, lp, spec=SPEC, implementation="reference")[0]
  got = c._attend_kernel(q, qpos, SPEC, "reference")[0]  # pylint: disable=protected-access
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  local = parallel.local_spec(SPEC, 2)
  half_k, half_v = c.k_rot.shape[-1] // 2, c.v_rot.shape[-1] // 2
  outs = []
  for d in range(2):
    cd = dataclasses.replace(
        c, k_rot=c.k_rot[..., d * half_k:(d + 1) * half_k],
        v_rot=c.v_rot[..., d * half_v:(d + 1) * half_v], rk=c.rk[2 * d:2 * d + 2],
        bv=c.bv[2 * d:2 * d + 2], v_bias=c.v_bias[d * 128:(d + 1) * 128]).for_spec(local)
    outs.append(cd._attend_kernel(q[:, :, 4 * d:4 * d + 4], qpos, local, "reference")[0])
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=2)), np.asarray(want),
                             atol=1e-5)
  swapped = dataclasses.replace(
      c, k_rot=c.k_rot[..., half_k:], v_rot=c.v_rot[..., half_v:], rk=c.rk[2:], bv=c.bv[2:],
      v_bias=c.v_bias[128:]).for_spec(local)
  bad = swapped._attend_kernel(q[:, :, :4], qpos, local, "reference")[0]
  assert float(jnp.max(jnp.abs(bad - want[:, :, :4]))) > 1e-2


def test_balance_calibrated_zack_model():
  """A ZACK-compressed model from the real offline path (value bias folded into bo; rate
  0.45 gives this random model ragged value widths): balanced for 2 and 4 devices, the
  same logits on one device as unbalanced."""
  dense = np_init_params(SPEC, seed=0, scale=0.25)
  toks = np.random.default_rng(0).integers(0, SPEC.vocab_size, (4, 48))
  rs = rotated.RotatedSpec(rate=0.45, calibration="data")
  stats = rotated.statistics(dense, SPEC, rs, toks, recipe="zack")
  cp, layout, _ = rotated.compress(dense, SPEC, rs, stats, "zack")
  assert any(len(set(w)) > 1 for w in layout.k_widths + layout.v_widths), layout
  assert sharding.padding_fraction(cp, 2) > 0
  ref = _run(cp)
  scale = max(1.0, float(np.max(np.abs(ref[0]))))
  for tp in (2, 4):
    assert _diff(ref, _run(rotated.balance(cp, SPEC, tp))) <= 1e-5 * scale
