"""GEAR caches streaming through the model: prefill + decode on stories260K (../shared)."""


import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from kvlowrank import resources
from kvlowrank.methods import GearSpec, init_caches
from kvlowrank.model.transformer import forward

try:
  from kvlowrank.loaders import load_model
except ImportError:  # pragma: no cover
  load_model = None


def _stories():
  if load_model is None or resources.shared_dir() is None:
    pytest.skip("loaders or ../shared not available")
  try:
    return load_model(resources.shared_path("models", "stories260K", "stories260K.bin"),
                      dtype=jnp.float32)
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_stories260k_prefill_then_decode_gear_beats_its_backbone():
  """Prefill 40 tokens (a 2-chunk prefill factor, n_b = 16) then decode 24 one by one (a
  chunk compressed at 48 and 64) with 2-bit GEAR and with its bare backbone (s = 0,
  r = 0): the logits vs the uncached dense forward. GEAR's low-rank + sparse terms must
  cut the error of the same 2-bit quantizer, and its greedy tokens must mostly agree.
  Measured: mean relative logit error 3.8 % (GEAR) vs 8.7 % (backbone); argmax agreement
  96 % vs 81 %."""
  m = _stories()
  tok = m.require_tokenizer()
  ids = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                   "outside in the park with her friends. One day, she saw a big red ball")
  ids = (ids * 4)[:64]
  tokens = jnp.asarray([ids, ids[::-1]], jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64))
  ref, _ = jax.jit(lambda t, p: forward(m.params, t, p, None, m.spec))(tokens, positions)
  step = jax.jit(lambda c, t, p: forward(m.params, t, p, c, m.spec))
  gear = GearSpec(bits=2, group_size=8, buffer=16, sparsity=10.0, rank_prefill=4,
                  rank_chunk=2)
  errs, agree = {}, {}
  for name, gs in (("gear", gear), ("backbone", GearSpec(bits=2, group_size=8, buffer=16,
                                                         sparsity=0.0, rank_prefill=0,
                                                         rank_chunk=0))):
    caches = init_caches("gear", gs, m.spec, m.params, batch=2, capacity=64,
                         dtype=jnp.float32)
    logits, caches = step(caches, tokens[:, :40], positions[:, :40])
    outs = [logits]
    for i in range(40, 64):
      logits, caches = step(caches, tokens[:, i:i + 1], positions[:, i:i + 1])
      outs.append(logits)
    out = jnp.concatenate(outs, axis=1)
    assert [int(x) for x in caches[0].n_pchunks] == [2, 2]
    assert [int(x) for x in caches[0].lens] == [64, 64]
    errs[name] = float(jnp.abs(out - ref).mean() / jnp.abs(ref).mean())
    agree[name] = float(jnp.mean(out.argmax(-1) == ref.argmax(-1)))
  assert errs["gear"] < 0.7 * errs["backbone"], errs
  assert agree["gear"] >= 0.85, agree


def _outer_conds(jaxpr) -> int:
  """`lax.cond`s of a jaxpr outside any cond (inside jitted calls too; not their branches)."""
  n = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "cond":
      n += 1
      continue
    for v in e.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          n += _outer_conds(getattr(inner, "jaxpr", inner))
  return n


def test_decode_step_defers_the_chunk_compression_to_one_conditional(monkeypatch):
  """`forward` at T = 1 leaves a chunk that the step completes in the exact window and
  the next step compresses it before its layers, under one `lax.cond` for every layer
  (`cache.base.settle_step`), as Algorithm 1 compresses a full buffer before the next token:
  the token that fills the buffer is generated with the buffer exact. The per-layer decision
  (deferral off) compresses it inside the step, before the layers above attend. Over a
  6-token prefill (no chunk) and 30 decode steps (chunks completed at positions 7, 15, 23,
  31) of 2 rows, one finishing early (padding):
  * the decode step's program holds 1 conditional, the per-layer one n_layers;
  * a step ends with at most one whole chunk waiting in each window, whole chunks
    compressed below it; settled (`settle_step`), layer 0 (whose K/V do not depend on
    attention) holds the per-layer run's codes, outliers and factors after every step; the
    layers above compress the completing token's K/V as computed over the exact buffer, so
    they differ;
  * the logits equal the per-layer run's up to the first completing step, and at that step
    are closer to the uncached forward's (the chunk still exact);
  * negative control: without the settle the next step's token finds no window slot
    (a row then holds more than a chunk uncompressed) and the logits go wrong."""
  from kvlowrank.cache import base  # pylint: disable=import-outside-toplevel
  from kvlowrank.methods import GearCache  # pylint: disable=import-outside-toplevel
  from kvlowrank.model.params import init_params  # pylint: disable=import-outside-toplevel
  from kvlowrank.spec import ModelSpec  # pylint: disable=import-outside-toplevel
  spec = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, ffn_dim=48, max_seq_len=64)
  params = init_params(spec, jax.random.PRNGKey(0), scale=0.3)
  gs = GearSpec(bits=2, group_size=4, buffer=8, sparsity=20.0, rank_prefill=4,
                rank_chunk=2)
  b, t, prompt, nb = 2, 36, 6, 8
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, spec.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  pos = pos.at[1, 34:].set(-1)     # row 1 stops early (a finished row: padding)
  exact, _ = jax.jit(lambda tk, p: forward(params, tk, p, None, spec))(tokens, pos)

  def run():
    f = jax.jit(lambda c, tk, p: forward(params, tk, p, c, spec))
    caches = init_caches("gear", gs, spec, params, batch=b, capacity=40, dtype=jnp.float32)
    lg, caches = f(caches, tokens[:, :prompt], pos[:, :prompt])
    outs, states = [lg], [caches]
    for i in range(prompt, t):
      lg, caches = f(caches, tokens[:, i:i + 1], pos[:, i:i + 1])
      outs.append(lg)
      states.append(caches)
    step = jax.make_jaxpr(lambda c: forward(params, tokens[:, :1], pos[:, :1], c, spec))
    return np.asarray(jnp.concatenate(outs, axis=1)), states, _outer_conds(step(caches).jaxpr)

  got, got_states, got_conds = run()
  with monkeypatch.context() as m:
    m.setattr(GearCache, "deferring", lambda self, on: self)
    m.setattr(GearCache, "pending", lambda self: None)
    ref, ref_states, ref_conds = run()
  assert (got_conds, ref_conds) == (1, spec.n_layers)
  settle = jax.jit(base.settle_step)   # one compile for the 31 states (eagerly: one each)
  for g, r in zip(got_states, ref_states):
    for c in g:
      w = np.asarray(c.lens - c.q_lens)
      assert (w >= 0).all() and (w <= nb).all() and (np.asarray(c.q_lens) % nb == 0).all()
    g = settle(g)
    assert all((np.asarray(c.lens - c.q_lens) < nb).all() for c in g)
    gc, rc = g[0], r[0]
    assert np.array_equal(gc.q_lens, rc.q_lens) and np.array_equal(gc.lens, rc.lens)
    for x, y in zip(jax.tree.leaves(gc.store), jax.tree.leaves(rc.store)):
      np.testing.assert_array_equal(x, y)
    for name in ("sk_idx", "sk_val", "sv_idx", "sv_val"):
      np.testing.assert_array_equal(getattr(gc, name), getattr(rc, name), err_msg=name)
    for name in ("a_k", "a_v", "b_k", "b_v"):
      np.testing.assert_allclose(getattr(gc, name), getattr(rc, name), atol=2e-3,
                                 err_msg=name)
  assert [int(x) for x in got_states[-1][0].q_lens] == [32, 32]
  assert not np.array_equal(got_states[-1][1].store.keys.codes,
                            ref_states[-1][1].store.keys.codes)
  first = 7                                            # position 7 completes chunk 0
  np.testing.assert_allclose(got[:, :first], ref[:, :first], atol=1e-5)
  err = lambda x: float(np.abs(x[:, first] - np.asarray(exact)[:, first]).mean())
  assert np.abs(got[:, first] - ref[:, first]).max() > 1e-3 and err(got) < err(ref)
  # Negative control: the decode steps without their settle.
  with monkeypatch.context() as m:
    m.setattr(base, "settle_step", lambda caches: tuple(c.deferring(False) for c in caches))
    bad, bad_states, _ = run()
  w = np.asarray(bad_states[-1][0].lens - bad_states[-1][0].q_lens)
  assert w.max() > nb and np.abs(bad - got).max() > 1e-2


def test_multi_token_call_after_a_deferred_chunk_equals_it_settled():
  """A decode step that completes a chunk leaves it in the window for the next step's
  `settle`. A multi-token call on that cache (a prompt after decoding; prompt 6 < n_b, so
  q_len = 0) compresses it as a streaming chunk, as `settle` would have, not as the row's
  prefill segment: its logits and caches (as attention reads them) equal those of the call on
  the settled cache.
  Negative control: the same call with the waiting chunk's keys perturbed changes the logits."""
  from kvlowrank.cache import base  # pylint: disable=import-outside-toplevel
  from kvlowrank.model.params import init_params  # pylint: disable=import-outside-toplevel
  from kvlowrank.spec import ModelSpec  # pylint: disable=import-outside-toplevel
  spec = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, ffn_dim=48, max_seq_len=64)
  params = init_params(spec, jax.random.PRNGKey(0), scale=0.3)
  gs = GearSpec(bits=2, group_size=4, buffer=8, sparsity=20.0, rank_prefill=4,
                rank_chunk=2)
  b, nb = 2, 8
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, 11), 0, spec.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (b, 11))
  f = jax.jit(lambda c, tk, p: forward(params, tk, p, c, spec))
  caches = init_caches("gear", gs, spec, params, batch=b, capacity=32, dtype=jnp.float32)
  _, caches = f(caches, tokens[:, :6], pos[:, :6])
  for i in (6, 7):
    _, caches = f(caches, tokens[:, i:i + 1], pos[:, i:i + 1])
  assert [int(x) for x in caches[0].lens - caches[0].q_lens] == [nb, nb]   # waiting
  got, got_c = f(caches, tokens[:, 8:], pos[:, 8:])
  ref, ref_c = f(base.settle_step(caches), tokens[:, 8:], pos[:, 8:])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  for g, r in zip(got_c, ref_c):   # the caches as attention reads them (valid slots)
    (gk, gv, gm), (rk, rv, rm) = g.materialize(), r.materialize()
    np.testing.assert_array_equal(np.asarray(gm), np.asarray(rm))
    for x, y in ((gk, rk), (gv, rv), (g.q_lens, r.q_lens)):
      np.testing.assert_array_equal(np.where(gm[..., None, None], x, 0) if x.ndim > 1 else x,
                                    np.where(gm[..., None, None], y, 0) if y.ndim > 1 else y)
  bad = tuple(dataclasses.replace(c, k_win=c.k_win.at[:, 3].add(1.0)) for c in caches)
  assert np.abs(np.asarray(f(bad, tokens[:, 8:], pos[:, 8:])[0]) - np.asarray(ref)).max() > 1e-2
