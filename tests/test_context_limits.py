"""No silent wrong answers: tokens beyond a cache's capacity or the model's max_seq_len.

Before these checks, an 11-token prompt into a 4-slot cache returned logits up to 16.9
off at positions >= 4 (the extra tokens were dropped like padding), and a 1024-token
window on a 512-token model gave a plausible but wrong perplexity. Each check has a
negative control: the same call within the limit runs and matches the uncached forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ModelSpec
from kvlowrank.eval.perplexity import perplexity
from kvlowrank.generate import generate
from kvlowrank.methods import DenseSpec, XQuantSpec, init_caches
from kvlowrank.model import forward, init_params
from kvlowrank.model.segments import forward_segments

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64, max_seq_len=24)
PARAMS = init_params(SPEC, jax.random.key(0), scale=0.3)
# Exact XQuant store: allocates exactly `capacity` rows (no rounding up), so a small
# capacity is really small.
EXACT = ("xquant", XQuantSpec(bits=None, path="x"))
jit_forward = jax.jit(forward, static_argnames=("spec", "allow_beyond_max_seq_len"))


def _tokens(t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, SPEC.vocab_size, (1, t)),
                     jnp.int32)


def _caches(capacity, method=EXACT):
  return init_caches(*method, SPEC, PARAMS, batch=1, capacity=capacity, dtype=jnp.float32)


def test_capacity_eager_and_jit():
  toks, pos = _tokens(11), jnp.arange(11)[None]
  ref, _ = forward(PARAMS, toks, pos, None, SPEC)
  # Negative control: capacity 11 holds the prompt; logits equal the uncached forward.
  out, _ = forward(PARAMS, toks, pos, _caches(11), SPEC)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  # The README case: 11 tokens into capacity 4, eagerly and under jit (static T).
  with pytest.raises(ValueError, match="11 tokens in one call exceed the cache capacity=4"):
    forward(PARAMS, toks, pos, _caches(4), SPEC)
  with pytest.raises(ValueError, match="exceed the cache capacity=4"):
    jit_forward(PARAMS, toks, pos, _caches(4), SPEC)
  # A decode step at a concrete position past the capacity.
  _, caches = forward(PARAMS, toks[:, :4], pos[:, :4], _caches(4), SPEC)
  with pytest.raises(ValueError, match="position 4 is beyond the cache capacity=4"):
    forward(PARAMS, toks[:, 4:5], pos[:, 4:5], caches, SPEC)
  # Calling a cache's update directly is checked too.
  caches[0].update(_inputs(4), PARAMS["layers"][0])  # control
  with pytest.raises(ValueError, match="6 tokens in one call exceed the XCache capacity=4"):
    caches[0].update(_inputs(6), PARAMS["layers"][0])


def _inputs(t):
  from kvlowrank.cache.base import AttnInputs
  z = jnp.zeros((1, t, SPEC.n_kv_heads, SPEC.head_dim))
  return AttnInputs(x=jnp.zeros((1, t, SPEC.dim)), k=z, k_pre=z, v=z,
                    positions=jnp.arange(t, dtype=jnp.int32)[None])


def test_traced_positions_give_nan_rows():
  """Under jit a position is not known while tracing: the row's logits become NaN."""
  toks = _tokens(4)
  _, caches = forward(PARAMS, toks, jnp.arange(4)[None], _caches(5), SPEC)
  step = lambda p: jit_forward(PARAMS, toks[:, :1], jnp.asarray([[p]], jnp.int32), caches,
                               SPEC)[0]
  assert np.isfinite(np.asarray(step(4))).all()   # control: the last slot
  assert np.isnan(np.asarray(step(5))).all()      # one past the capacity
  # Padding (-1) is never beyond anything.
  assert np.isfinite(np.asarray(step(-1))).all()


def test_forward_segments_capacity():
  toks, pos = _tokens(8), jnp.arange(8)[None]
  segs = ((0, 4), (4, 5), (5, 6), (6, 7), (7, 8))
  ref, _ = forward(PARAMS, toks, pos, None, SPEC)
  out, _ = forward_segments(PARAMS, toks, pos, _caches(8, ("dense", DenseSpec())), SPEC,
                            segs)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="8 tokens in one call exceed the cache capacity=6"):
    forward_segments(PARAMS, toks, pos, _caches(6), SPEC, segs)


def test_max_seq_len():
  toks, pos = _tokens(30), jnp.arange(30)[None]
  with pytest.raises(ValueError, match="30 tokens in one call exceed the model's "
                     "max_seq_len=24.*allow_beyond_max_seq_len"):
    forward(PARAMS, toks, pos, None, SPEC)
  with pytest.raises(ValueError, match="max_seq_len=24"):
    jit_forward(PARAMS, toks, pos, None, SPEC)
  # Allowed explicitly: runs, and equals the model with a larger max_seq_len.
  out, _ = forward(PARAMS, toks, pos, None, SPEC, allow_beyond_max_seq_len=True)
  ref, _ = forward(PARAMS, toks, pos, None, SPEC.replace(max_seq_len=30))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  # A traced decode position past max_seq_len (cache large enough): NaN unless allowed.
  _, caches = forward(PARAMS, toks[:, :24], pos[:, :24], _caches(32), SPEC)
  p = jnp.asarray([[24]], jnp.int32)
  assert np.isnan(np.asarray(jit_forward(PARAMS, toks[:, :1], p, caches, SPEC)[0])).all()
  assert np.isfinite(np.asarray(jit_forward(PARAMS, toks[:, :1], p, caches, SPEC,
                                            allow_beyond_max_seq_len=True)[0])).all()


def test_perplexity_and_generate_refuse_beyond_max_seq_len():
  windows = np.asarray(_tokens(32)).reshape(1, 32)
  kw = dict(spec=SPEC, method="dense", method_spec=DenseSpec(), cache_dtype=jnp.float32)
  with pytest.raises(ValueError, match="eval.seq_len=32 exceeds the model's max_seq_len=24"):
    perplexity(PARAMS, windows, **kw)
  allowed = perplexity(PARAMS, windows, allow_beyond_max_seq_len=True, **kw)
  ok = perplexity(PARAMS, windows[:, :24], **kw)  # control: within the limit
  assert np.isfinite(allowed.ppl) and np.isfinite(ok.ppl)
  prompt = [list(np.asarray(_tokens(20))[0])]
  with pytest.raises(ValueError, match="max_new_tokens=6 runs past the model's "
                     "max_seq_len=24"):
    generate(PARAMS, SPEC, prompt, max_new_tokens=6)
  assert generate(PARAMS, SPEC, prompt, max_new_tokens=5).lengths == (5,)


def test_generate_pads_prompt_within_capacity():
  """The prefill hands the cache the prompt padded to a multiple of 8 columns: with an
  exact-capacity cache (capacity 5 + 2 = 7 < 8 columns) generation still runs and
  equals the dense cache."""
  prompt = [list(np.asarray(_tokens(5))[0])]
  got = generate(PARAMS, SPEC, prompt, max_new_tokens=2, cache_method=EXACT[0],
                 cache_spec=EXACT[1])
  want = generate(PARAMS, SPEC, prompt, max_new_tokens=2)
  assert got.tokens == want.tokens
