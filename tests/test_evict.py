"""Eviction wrapper (kvlowrank.methods.evict): the SnapKV policy vs a float64 numpy
transcription, the window and budget invariants through the model, transparency when
nothing is evicted (dense attention / the plain inner cache), dense, KIVI and GEAR inner
caches in forward, decode-mode perplexity and greedy generation, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.cache import base
from kvlowrank.eval.perplexity import window_nll
from kvlowrank.generate import generate
from kvlowrank.methods import EvictSpec, KiviSpec, get_method, init_caches
from kvlowrank.methods.evict import select
from kvlowrank.model.params import init_params
from kvlowrank.model.transformer import forward, qkv_projections, rms_norm
from kvlowrank.spec import ModelSpec
from decode_steps import prefill_then_decode
from docs_check import cites_results

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_dim=64, max_seq_len=128)
KIVI = {"bits": 2, "group_size": 8, "residual": 16}
# GEAR over 2-bit KIVI (g = 4), n_b = 8, s = 20 %, r_p = 4, r_g = 2.
GEAR = {"bits": 2, "group_size": 4, "buffer": 8, "sparsity": 20.0, "rank_prefill": 4,
        "rank_chunk": 2}
_forward = jax.jit(forward, static_argnums=(4,))
_materialize = jax.jit(lambda cache: cache.materialize())


@pytest.fixture(scope="module")
def params():
  return init_params(SPEC, jax.random.PRNGKey(0), scale=0.3)


def _spec(inner="dense", **kw):
  return EvictSpec(inner=inner, inner_specs={"kivi": KIVI, "gear": GEAR}, **kw)


def _run(params, es, tokens, prompt, method="evict", dtype=jnp.float32, capacity=None):
  """Prefill `prompt` tokens in one call, then decode one by one; logits and the caches
  after every call."""
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  caches = init_caches(method, es, SPEC, params, batch=b, capacity=capacity or t, dtype=dtype)
  return prefill_then_decode(params, SPEC, caches, tokens, pos, prompt)


def _tokens(b, t, seed=1):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, SPEC.vocab_size)


# ------------------------------------------------------------ the policy vs numpy


def np_policy(q, q_pos, k, k_pos, n_in, limit, window, pool, causal=True, pooled=True):
  """float64 SnapKV selection for one row (SnapKVCluster.update_kv, shared over heads)."""
  valid = k_pos >= 0
  vi = np.flatnonzero(valid)
  if n_in + len(vi) <= limit:
    return valid.copy(), np.zeros_like(valid)
  recent = np.zeros_like(valid)
  recent[vi[len(vi) - window:] if window else []] = True
  eligible = valid & ~recent
  o, n, h = q.shape
  g = n // k.shape[1]
  score = np.zeros(len(k_pos))
  for i in range(o):
    if q_pos[i] < 0:
      continue
    for head in range(n):
      s = k[:, head // g] @ q[i, head] / np.sqrt(h)
      ok = valid & ((k_pos <= q_pos[i]) if causal else True)
      p = np.where(ok, np.exp(s - s[ok].max()), 0)
      score += p / p.sum()
  score = np.where(eligible, score, 0)
  if pooled:
    pad = np.pad(score, pool // 2)
    score = np.array([pad[j:j + pool].mean() for j in range(len(score))])
  order = sorted(np.flatnonzero(eligible), key=lambda j: (-score[j], j))
  admitted = np.zeros_like(valid)
  admitted[order[:max(0, limit - n_in)]] = True
  return admitted, recent


def _policy_case(seed):
  rng = np.random.default_rng(seed)
  b, o, n, kh, h, m = 2, 3, 4, 2, 8, 24
  q = rng.normal(size=(b, o, n, h))
  k = rng.normal(size=(b, m, kh, h)) * 1.5
  k_pos = np.tile(np.arange(m), (b, 1))
  k_pos[1, :5] = -1                                       # ragged row: left padding
  q_pos = np.tile(np.arange(m - o, m), (b, 1))
  n_in = np.array([2, 0])
  return q, q_pos, k, k_pos, n_in


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_matches_numpy_reference(seed):
  q, q_pos, k, k_pos, n_in = _policy_case(seed)
  limit, window, pool = 10, 4, 5
  valid = jnp.asarray(k_pos >= 0)
  eligible = valid & ~select.recent_mask(valid, window)
  scores = select.snapkv_scores(jnp.asarray(q, jnp.float32), jnp.asarray(q_pos),
                                jnp.asarray(k, jnp.float32), jnp.asarray(k_pos), valid,
                                pool=pool, eligible=eligible)
  admitted, recent = select.admit(valid, scores, jnp.asarray(n_in), limit, window)
  for r in range(2):
    want_a, want_r = np_policy(q[r], q_pos[r], k[r], k_pos[r], n_in[r], limit, window, pool)
    np.testing.assert_array_equal(np.asarray(admitted[r]), want_a)
    np.testing.assert_array_equal(np.asarray(recent[r]), want_r)
    assert want_a.sum() == limit - n_in[r] and want_r.sum() == window
    # Negative control: the same reference without pooling or without the causal mask
    # keeps a different set on these inputs, so the comparison above can fail.
  bad = [np_policy(q[0], q_pos[0], k[0], k_pos[0], n_in[0], limit, window, pool,
                   pooled=False)[0],
         np_policy(q[0], q_pos[0], k[0], k_pos[0], n_in[0], limit, window, pool,
                   causal=False)[0]]
  assert any(not np.array_equal(np.asarray(admitted[0]), x) for x in bad)


def test_everything_fits_admits_all():
  valid = jnp.asarray([[False, True, True, True]])
  a, r = select.admit(valid, jnp.zeros((1, 4)), jnp.asarray([3]), 6, 2)
  assert np.asarray(a).tolist() == [[False, True, True, True]] and not np.asarray(r).any()


# ------------------------------------------------ the selection inside the model


def test_prefill_selection_equals_snapkv_on_the_layer_inputs(params):
  """After a one-call prefill, layer 0 keeps exactly numpy-SnapKV's set computed from that
  layer's own queries and keys (observation = the last `window` prompt queries)."""
  b, t, budget, window = 2, 40, 20, 6
  tokens = _tokens(b, t)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  pos[1, :7] = -1                                        # ragged: row 1 left-padded
  es = _spec(budget=budget, window=window, pool=3)
  caches = init_caches("evict", es, SPEC, params, batch=b, capacity=t, dtype=jnp.float32)
  _, caches = _forward(params, tokens, jnp.asarray(pos), caches, SPEC)
  lp = params["layers"][0]
  h = rms_norm(params["embed"][tokens], lp["attn_norm"], SPEC.norm_eps)
  q, inputs = qkv_projections(lp, h, jnp.asarray(pos), SPEC)
  _, _, valid = caches[0].materialize()
  for r in range(b):
    kp = pos[r]
    obs = np.flatnonzero(kp >= 0)[-window:]
    adm, rec = np_policy(np.asarray(q[r, obs], np.float64), kp[obs],
                         np.asarray(inputs.k[r], np.float64), kp, 0, budget - window,
                         window, 3)
    kept = np.zeros(t, bool)
    kept[kp[adm | rec]] = True
    np.testing.assert_array_equal(np.asarray(valid[r]), kept)
  # Negative control: a keep-the-first-tokens set differs.
  first = np.zeros(t, bool)
  first[:budget - window] = True
  first[t - window:] = True
  assert not np.array_equal(np.asarray(valid[0]), first)


@pytest.mark.parametrize("inner", ["kivi", "gear"])
def test_window_kept_and_budget_respected_through_decode(params, inner):
  b, t, prompt, budget, window = 2, 48, 24, 20, 6
  _, states = _run(params, _spec(inner, budget=budget, window=window), _tokens(b, t), prompt)
  if inner == "gear":   # 14 inner tokens: one compressed 8-token chunk (prefill factor) + 6
    assert np.asarray(states[-1][0].inner.lens).tolist() == [14, 14]
    assert np.asarray(states[-1][0].inner.n_pchunks).tolist() == [1, 1]
  for caches in states:
    for cache in caches:
      n = int(cache.lens[0])
      assert np.all(np.asarray(cache.stored_tokens()) <= budget)
      _, _, valid = _materialize(cache)
      v = np.array(valid)
      assert v[:, n - window:n].all(), "a token of the recent window was evicted"
      assert np.all(v.sum(1) <= budget)
  assert np.all(np.asarray(states[-1][0].stored_tokens()) == budget)
  # Negative control: the recent-window check fails on a window with a hole.
  v[0, n - 1] = False
  assert not v[:, n - window:n].all()


# -------------------------------------------------------- transparency / exactness


@pytest.mark.parametrize("window", [8])
def test_dense_inner_with_budget_covering_sequence_is_dense_attention(params, window):
  b, t = 2, 32
  tokens = _tokens(b, t)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  ref, _ = _forward(params, tokens, pos, None, SPEC)       # uncached causal attention
  got, _ = _run(params, _spec(budget=t, window=window), tokens, 12)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=0)
  small, _ = _run(params, _spec(budget=16, window=window or 4), tokens, 12)  # negative control
  assert np.abs(np.asarray(small) - np.asarray(ref)).max() > 1e-2


@pytest.mark.parametrize("window", [8])
def test_kivi_inner_with_budget_covering_sequence_equals_kivi(params, window):
  b, t = 2, 40
  tokens = _tokens(b, t)
  got, _ = _run(params, _spec("kivi", budget=64, window=window), tokens, 20,
                dtype=jnp.bfloat16)
  ref, _ = _run(params, KiviSpec(**KIVI), tokens, 20, method="kivi", dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  # Negative control: KIVI's 2-bit quantization is active here (exact attention differs).
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  exact, _ = _forward(params, tokens, pos, None, SPEC)
  assert np.abs(np.asarray(exact) - np.asarray(ref)).max() > 1e-2


@pytest.mark.parametrize("prompt", [20, 5])
def test_gear_inner_with_budget_covering_sequence_equals_gear(params, prompt):
  """prompt 20: two chunks get GEAR's prefill factor; prompt 5 < n_b: the first chunk
  completes in a decode step, which the wrapper pads to W + 1 candidates (one valid), and
  must get a streaming (r_g) factor as in plain GEAR."""
  from kvlowrank.methods import GearSpec  # pylint: disable=import-outside-toplevel
  b, t = 2, 40
  tokens = _tokens(b, t)
  got, states = _run(params, _spec("gear", budget=64, window=8), tokens, prompt)
  ref, ref_states = _run(params, GearSpec(**GEAR), tokens, prompt, method="gear")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert states[-1][0].ring == "exact"
  np.testing.assert_array_equal(np.asarray(states[-1][0].inner.n_pchunks),
                                np.asarray(ref_states[-1][0].n_pchunks))
  # Negative controls: GEAR's compression is active (exact attention differs), and with
  # eviction active the wrapper's output is not plain GEAR's.
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  exact, _ = _forward(params, tokens, pos, None, SPEC)
  assert np.abs(np.asarray(exact) - np.asarray(ref)).max() > 1e-2
  small, _ = _run(params, _spec("gear", budget=16, window=6), tokens, prompt)
  assert np.abs(np.asarray(small) - np.asarray(ref)).max() > 1e-2


def test_gear_inner_holds_the_kept_tokens_as_plain_gear_would(params):
  """After an evicting one-call prefill, layer 0's inner GEAR cache equals a plain GEAR
  cache fed only the kept tokens' keys and values (that layer's own), in position order
  at consecutive slots: the padding of the evicted candidates leaves no trace."""
  from kvlowrank.methods import GearCache, GearSpec  # pylint: disable=import-outside-toplevel
  b, t, budget, window = 2, 40, 20, 6
  tokens = _tokens(b, t, seed=4)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  pos[1, :3] = -1                                        # ragged: row 1 left-padded
  caches = init_caches("evict", _spec("gear", budget=budget, window=window), SPEC, params,
                       batch=b, capacity=t, dtype=jnp.float32)
  _, caches = _forward(params, tokens, jnp.asarray(pos), caches, SPEC)
  inner, pos_map = caches[0].inner, np.asarray(caches[0].pos_map)
  lp = params["layers"][0]
  h = rms_norm(params["embed"][tokens], lp["attn_norm"], SPEC.norm_eps)
  _, inputs = qkv_projections(lp, h, jnp.asarray(pos), SPEC)
  n = budget - window
  assert np.all(pos_map < t) and np.all(np.diff(pos_map, axis=1) > 0)   # full, in order

  def plain(kept):
    k, v = (jnp.asarray(np.stack([np.asarray(a[r])[kept[r]] for r in range(b)]))
            for a in (inputs.k, inputs.v))
    cache = GearCache.init(GearSpec(**GEAR), SPEC, batch=b, capacity=n, dtype=jnp.float32)
    return cache.update(base.AttnInputs(x=None, k=k, k_pre=k, v=v, positions=jnp.asarray(
        np.tile(np.arange(n, dtype=np.int32), (b, 1)))), {})

  ref = plain(pos_map)
  for a, r in zip(jax.tree.leaves(inner), jax.tree.leaves(ref)):
    a, r = np.asarray(a), np.asarray(r)
    if not np.issubdtype(r.dtype, np.floating):   # codes, outlier indices, lengths
      np.testing.assert_array_equal(a, r)
    else:   # K recomputed outside the jitted forward: fp16 factors may round 1 ulp apart
      r = r.astype(np.float32)
      np.testing.assert_allclose(a.astype(np.float32), r, rtol=0,
                                 atol=2 ** -10 * max(1.0, np.abs(r).max()))
  # Negative control: the first n valid tokens (no selection) give another cache.
  first = np.stack([np.flatnonzero(pos[r] >= 0)[:n] for r in range(b)])
  assert not np.array_equal(first, pos_map)
  assert np.abs(np.asarray(_materialize(plain(first))[0]) -
                np.asarray(_materialize(inner)[0])).max() > 1e-2


def test_ring_through_a_scratch_inner_cache_matches_exact_ring(params):
  """ring="inner" (a scratch dense cache over the window) == ring="exact" on one layer fed
  random inputs call by call (prefill with eviction, then decode steps)."""
  rng = np.random.default_rng(3)
  b, t, kh, h = 2, 30, SPEC.n_kv_heads, SPEC.head_dim
  lp = params["layers"][0]
  feed = lambda a: jnp.asarray(a, jnp.float32)
  x, k, v = (feed(rng.normal(size=s)) for s in ((b, t, SPEC.dim), (b, t, kh, h), (b, t, kh, h)))
  q = feed(rng.normal(size=(b, t, SPEC.n_heads, h)))
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  pos[1, :3] = -1
  upd = jax.jit(lambda c, i: c.update(i, lp))
  att = jax.jit(lambda c, q_, p_: c.attend(q_, p_, lp, spec=SPEC)[0])
  outs = {}
  for ring in ("exact", "inner"):
    cache = init_caches("evict", _spec(budget=14, window=5, ring=ring), SPEC, params, batch=b,
                        capacity=t, dtype=jnp.float32)[0]
    got = []
    for s0, s1 in [(0, 20)] + [(i, i + 1) for i in range(20, t)]:
      sl = lambda a: a[:, s0:s1]
      cache = upd(cache, base.AttnInputs(x=sl(x), k=sl(k), k_pre=sl(k), v=sl(v),
                                         positions=jnp.asarray(pos[:, s0:s1])))
      got.append(att(cache, sl(q), jnp.asarray(pos[:, s0:s1])))
    outs[ring] = np.asarray(jnp.concatenate(got, axis=1))
    assert cache.ring == ring
  np.testing.assert_allclose(outs["inner"], outs["exact"], atol=1e-5, rtol=0)


def test_nbytes_is_inner_at_budget_plus_own_arrays(params):
  es = _spec("kivi", budget=64, window=16)
  cache = init_caches("evict", es, SPEC, params, batch=2, capacity=1024,
                      dtype=jnp.bfloat16)[0]
  inner = init_caches("kivi", KiviSpec(**KIVI), SPEC, params, batch=2, capacity=48,
                      dtype=jnp.bfloat16)[0]
  own = sum(x.size * x.dtype.itemsize for x in (cache.ring_k, cache.ring_v, cache.ring_pos,
                                                 cache.pos_map, cache.lens))
  assert cache.nbytes() == inner.nbytes() + own
  full = init_caches("kivi", KiviSpec(**KIVI), SPEC, params, batch=2, capacity=1024,
                     dtype=jnp.bfloat16)[0]
  assert cache.nbytes() < full.nbytes() / 4


# ------------------------------------------------------------ pipeline entry points


def test_decode_mode_perplexity_and_generation_run(params):
  tokens = np.asarray(_tokens(2, 48))
  es = _spec("kivi", budget=24, window=8)
  nll = window_nll(params, tokens, spec=SPEC, method="evict", method_spec=es,
                   cache_dtype=jnp.bfloat16, mode="decode", prompt_len=24, prefill_chunk=12)
  assert nll.shape == (2, 47) and np.isfinite(nll).all()
  # Greedy generation with eviction active (prompts longer than the budget, ragged).
  prompts = [list(range(1, 30)), list(range(5, 31))]
  res = generate(params, SPEC, prompts, max_new_tokens=8, cache_method="evict",
                 cache_spec=es, eos_ids=())
  assert res.lengths == (8, 8)


# ------------------------------------------------------------------ config errors


@pytest.mark.parametrize("section, match", [
    ({"budget": 8, "window": 16}, r"EvictSpec.budget \(8\) must be greater than "
                                  r"EvictSpec.window \(16\)"),
    ({"budget": 16, "window": 16}, "EvictSpec.budget"),
    ({"window": -1}, "EvictSpec.window"),
    ({"pool": 4}, "EvictSpec.pool"),
    ({"observe": 0}, "EvictSpec.observe"),
    ({"inner": "nope"}, "EvictSpec.inner"),
    ({"inner": "evict"}, "EvictSpec.inner"),
    ({"ring": "ring"}, "EvictSpec.ring"),
    ({"inner_specs": {"kivi": {"bitz": 2}}}, "EvictSpec.inner_specs.kivi"),
    ({"inner_specs": {"nope": {}}}, "EvictSpec.inner_specs"),
])
def test_bad_config_is_one_line_naming_the_field(section, match):
  with pytest.raises(ValueError, match=match) as e:
    get_method("evict").build_spec(section, SPEC)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("section, match", [
    ({"inner": "xquant_cl"}, "EvictSpec.inner='xquant_cl' is not supported"),
    ({"inner": "gear", "inner_specs": {"gear": {"group_size": 32, "buffer": 32}}},
     "config.gear.group_size"),
    ({"inner": "palu", "ring": "exact"}, "EvictSpec.ring='exact'"),
    ({"inner": "kivi", "inner_specs": {"kivi": {"group_size": 12, "residual": 24}}},
     "group_size"),
])
def test_model_checks(section, match):
  with pytest.raises(ValueError, match=match):
    get_method("evict").build_spec(section, SPEC)


def test_config_file_and_sweep_build():
  import importlib.util  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  from kvlowrank.experiment.config import apply_overrides  # pylint: disable=import-outside-toplevel
  from kvlowrank.experiment.spec import from_config  # pylint: disable=import-outside-toplevel
  path = Path(__file__).resolve().parents[1] / "configs" / "evict.py"
  spec = importlib.util.spec_from_file_location("_cfg_evict", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert "python experiments/" in module.__doc__ and cites_results(module.__doc__)
  config = module.get_config()
  inners = [from_config(apply_overrides(config, p)).method_spec for p in module.get_sweep()]
  assert {(s.inner, s.budget) for s in inners} >= {(i, b) for i in ("dense", "kivi")
                                                   for b in (128, 256)}
  assert inners[3].inner_spec == KiviSpec(bits=2, group_size=32, residual=32)
  from kvlowrank.methods import GearSpec  # pylint: disable=import-outside-toplevel
  gear = from_config(module.get_config("inner=gear")).method_spec
  assert gear.inner == "gear" and gear.inner_spec == GearSpec(group_size=32, buffer=32)
  assert from_config(module.get_config("inner=gear,smoke=True")).method_spec.inner_spec == \
      GearSpec(group_size=8, buffer=16)
  with pytest.raises(ValueError, match="EvictSpec.budget"):
    from_config(module.get_config("budget=16,window=32"))
  with pytest.raises(ValueError, match="unknown config arg 'bitz'"):
    module.get_config("bitz=3")


def test_xquant_inner_transparent_and_evicting(params):
  """A pre-RoPE inner cache (XQuant stores X and re-applies RoPE at its slots): equal to
  plain XQuant when nothing is evicted; with eviction (scratch ring, re-indexed queries)
  the budget holds and the outputs stay finite."""
  from kvlowrank.methods import XQuantSpec  # pylint: disable=import-outside-toplevel
  xq = {"bits": 4, "group_size": 16, "window": 0, "implementation": "reference"}
  tokens = _tokens(2, 28)
  es = lambda budget: EvictSpec(inner="xquant", budget=budget, window=6,
                                inner_specs={"xquant": xq})
  got, _ = _run(params, es(64), tokens, 20)
  ref, _ = _run(params, XQuantSpec(**xq), tokens, 20, method="xquant")
  # fp32 round-off: the inner cache projects x over the window's (empty) rows too.
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=0)
  small, states = _run(params, es(16), tokens, 20)
  assert states[-1][0].ring == "inner" and states[-1][0].reindex
  assert np.all(np.asarray(states[-1][0].stored_tokens()) == 16)
  assert np.isfinite(np.asarray(small)).all()
  assert np.abs(np.asarray(small) - np.asarray(ref)).max() > 1e-2   # negative control
