"""Stacking (issue 22 item 5): rotation + KIVI-style 4-bit + SnapKV eviction in one config;
eviction's invariants with an FDC / ZACK inner cache through prefill and decode (the recent
window is never evicted, the budget holds, an evicted token never comes back, ragged rows),
transparency when the budget covers the sequence, and negative controls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.cache import caches_nbytes, init_caches
from kvlowrank.methods import EvictSpec, get_method, rotated
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from decode_steps import prefill_then_decode
from np_params import np_init_params
from docs_check import cites_results

# One layer (CI time: the stacked cache's programs are large to compile and grow with the
# depth): every check here is per layer, and none is about the layer stack.
SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32,
                 ffn_dim=48)


@functools.partial(jax.jit, static_argnames=("spec",))
def _fwd(params, toks, pos, caches, spec):
  return forward(params, toks, pos, caches, spec)


def test_rotation_quantization_eviction_compose():
  params = np_init_params(SPEC, seed=0, scale=0.25)
  toks = np.random.default_rng(0).integers(0, 64, (2, 48))
  es = EvictSpec(inner="zack", budget=40, window=8,
                 inner_specs={"zack": dict(target_ratio=0.5, bits=4, group_size=16,
                                           residual=16, calibration="data")})
  method = get_method("evict")
  cp = method.calibrate(params, SPEC, es, toks, workdir=None)    # zack's, through evict
  assert rotated.layout_from_params(cp, 32).compression_ratio() == 0.5
  pos = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32), (2, 48))
  t = jnp.asarray(toks)
  # Budget >= length: nothing is evicted and the wrapper is transparent.
  big = EvictSpec(inner="zack", budget=64, window=8, inner_specs=dict(es.inner_specs))
  wrapped = init_caches("evict", big, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32)
  plain = init_caches("rotated", es.inner_spec, SPEC, cp, batch=2, capacity=48,
                      dtype=jnp.float32)
  lw, _ = _fwd(cp, t, pos, wrapped, SPEC)
  lp_, _ = _fwd(cp, t, pos, plain, SPEC)
  np.testing.assert_allclose(np.asarray(lw), np.asarray(lp_), atol=2e-4)
  # Budget 40 < 48 tokens: 8 evicted; the stacked cache stores fewer bytes, runs finite and
  # differs from the unevicted one (negative control: eviction really happened).
  ev = init_caches("evict", es, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32)
  le, ev = _fwd(cp, t, pos, ev, SPEC)
  assert np.all(np.isfinite(np.asarray(le)))
  assert np.max(np.abs(np.asarray(le) - np.asarray(lp_))) > 1e-4
  assert caches_nbytes(ev) < caches_nbytes(
      init_caches("evict", big, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32))
  assert isinstance(ev[0].inner, rotated.RotatedCache) and ev[0].inner.quant is not None
  # A prompt longer than the inner store (window + prompt candidates > its slots, the
  # evicted ones as padding) goes through the quantized inner cache too.
  long_t = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 96)))
  long_pos = jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96))
  small = init_caches("evict", es, SPEC, cp, batch=2, capacity=96, dtype=jnp.float32)
  assert 8 + 96 > small[0].inner.capacity
  ll, small = _fwd(cp, long_t, long_pos, small, SPEC)
  assert np.all(np.isfinite(np.asarray(ll)))
  assert np.all(np.asarray(small[0].stored_tokens()) == 40)
  # nbytes() counts storage, not the rotations the inner cache and its scratch copy keep:
  # every array leaf = storage + weights, and the weights are the two copies' rk / bv.
  c = ev[0]
  leaves = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(c))
  assert c.nbytes() + c.weights_nbytes() == leaves
  assert c.weights_nbytes() == c.inner.weights_nbytes() + c.scratch.weights_nbytes() > 0
  assert c.nbytes() == (c.inner.nbytes() + c.scratch.nbytes() + c.pos_map.nbytes
                        + c.ring_pos.nbytes + c.lens.nbytes + sum(
                            a.nbytes for a in (c.ring_k, c.ring_v, c.ring_x, c.ring_kpre)
                            if a is not None))


# ------------------------------------------- eviction invariants, rotated inner cache

T, PROMPT, PAD = 40, 20, 3          # row 1 is left-padded by PAD prompt tokens (ragged)
_materialize = jax.jit(lambda cache: cache.materialize())


@functools.lru_cache(maxsize=None)
def _compressed(recipe):
  """FDC / ZACK params of SPEC at 50% of the KV dims (rotation fitted on data tokens)."""
  params = np_init_params(SPEC, seed=0, scale=0.25)
  toks = np.random.default_rng(0).integers(0, 64, (2, 48))
  rs = rotated.RotatedSpec(target_ratio=0.5, calibration="data")
  cp = get_method(recipe).calibrate(params, SPEC, rs, toks, workdir=None)
  assert rotated.layout_from_params(cp, 32).compression_ratio() == 0.5
  return cp


def _positions():
  pos = np.tile(np.arange(T, dtype=np.int32), (2, 1))
  pos[1] = np.arange(T) - PAD
  pos[1, :PAD] = -1
  return jnp.asarray(pos)


def _run(cp, method, mspec):
  """Prefill PROMPT tokens in one call, then one token per call: (logits [2, T, V], the
  caches after every call)."""
  toks = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, T)))
  caches = init_caches(method, mspec, SPEC, cp, batch=2, capacity=T, dtype=jnp.float32)
  logits, states = prefill_then_decode(cp, SPEC, caches, toks, _positions(), PROMPT)
  return np.asarray(logits), states


def _evict(recipe, budget, window=6, bits=None):
  section = dict(target_ratio=0.5, calibration="data")
  if bits:
    section.update(bits=bits, group_size=16, residual=16)
  return EvictSpec(inner=recipe, budget=budget, window=window, inner_specs={recipe: section})


@pytest.mark.parametrize("recipe", ["fdc", "zack"])
def test_window_kept_and_budget_respected_with_rotated_inner(recipe):
  budget, window = 18, 6
  cp = _compressed(recipe)
  _, states = _run(cp, "evict", _evict(recipe, budget, window))
  seen = np.asarray(_positions())
  prev = None
  for i, caches in enumerate(states):
    n_call = PROMPT if i == 0 else PROMPT + i          # tokens fed so far
    for layer, cache in enumerate(caches):
      assert isinstance(cache.inner, rotated.RotatedCache)
      _, _, valid = _materialize(cache)
      v = np.array(valid)
      stored = np.asarray(cache.stored_tokens())
      assert np.all(stored <= budget) and np.all(v.sum(1) == stored)
      assert np.all(np.asarray(cache.inner.lengths) <= budget - window)
      for r in range(2):
        fed = seen[r, :n_call]
        fed = fed[fed >= 0]
        # The recent window: the row's last `window` positions are all held.
        assert v[r, fed[-window:]].all(), f"layer {layer} row {r}: window token evicted"
        # Stored = min(fed, budget): the budget is used, never exceeded.
        assert stored[r] == min(len(fed), budget)
        if prev is not None:   # an evicted token never comes back
          back = v[r] & ~prev[layer][r]
          assert np.flatnonzero(back).tolist() == [fed[-1]]
    prev = [np.asarray(_materialize(c)[2]) for c in caches]
  # Negative controls: the plain rotated cache holds every token (so the budget check above
  # can fail), and a window with a hole would be caught.
  _, plain = _run(cp, "rotated", _evict(recipe, budget).inner_spec)
  assert np.asarray(plain[-1][0].lengths).tolist() == [T, T - PAD]
  v[0, T - 1] = False
  assert not v[0, T - window:T].all()


@pytest.mark.parametrize("recipe,bits", [("fdc", None), ("zack", None), ("zack", 4)])
def test_budget_covering_sequence_is_the_plain_rotated_cache(recipe, bits):
  """budget >= T: the wrapper evicts nothing and its logits (prefill, then decode, ragged
  rows) equal the plain rotated cache's; negative control: a budget below T changes them."""
  cp = _compressed(recipe)
  es = _evict(recipe, 64, bits=bits)
  got, states = _run(cp, "evict", es)
  ref, _ = _run(cp, "rotated", es.inner_spec)
  ok = np.asarray(_positions()) >= 0
  np.testing.assert_allclose(got[ok], ref[ok], atol=2e-5, rtol=0)
  assert np.asarray(states[-1][0].stored_tokens()).tolist() == [T, T - PAD]
  small, _ = _run(cp, "evict", _evict(recipe, 18, bits=bits))
  assert np.abs(small[ok] - ref[ok]).max() > 1e-3


def test_stack_config_file_points():
  """configs/stack.py: default and smoke configs and every sweep point validate; the
  stacked point's budget is floor(2T/3) and its inner ZACK keeps 75% (equal-bytes design)."""
  import sys  # pylint: disable=C0415
  from pathlib import Path  # pylint: disable=C0415
  sys.path.insert(0, str(Path(__file__).parent))
  from test_experiment_configs import SMOL, config_module  # pylint: disable=C0415
  from kvlowrank.experiment.config import apply_overrides  # pylint: disable=C0415
  from kvlowrank.experiment.spec import from_config  # pylint: disable=C0415
  module = config_module("stack")
  assert "python experiments/sweep.py" in module.__doc__ and cites_results(module.__doc__)
  for arg, t in ((None, 512), ("smoke", 256)):
    c = module.get_config(arg)
    assert c.eval.seq_len == t and c.eval.modes == ("decode",) and c.evict.bytes_context == t
    exps = [from_config(apply_overrides(c, p), None if arg else SMOL)
            for p in module.get_sweep(arg)]
    assert [e.method for e in exps] == ["dense", "zack", "evict", "evict", "zack", "evict",
                                        "evict", "evict"]
    assert exps[1].method_spec.calibration == "data" and exps[1].method_spec.target_ratio == 0.5
    assert (exps[2].method_spec.inner, exps[2].method_spec.budget) == ("dense", t // 2)
    stacked = exps[3].method_spec
    assert (stacked.inner, stacked.budget) == ("zack", 2 * t // 3)
    assert stacked.inner_spec.target_ratio == 0.25 and stacked.inner_spec.calibration == "data"
    assert stacked.inner_spec.bits is None and exps[4].method_spec == stacked.inner_spec
    assert [(e.method_spec.inner, e.method_spec.budget) for e in exps[5:]] == [
        ("dense", 2 * t // 3), ("dense", t // 4), ("zack", t // 2)]
    assert exps[7].method_spec.inner_spec == exps[1].method_spec
  with pytest.raises(ValueError, match="unknown config arg 'budget'"):
    module.get_config("budget=3")
