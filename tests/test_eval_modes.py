"""`prefill` vs `decode` evaluation modes: equal for an exact cache, and for KIVI different
exactly where its residual window predicts.

KIVI (kvlowrank.methods.kivi.cache) at length L holds keys [0, floor(L/R) R) and values
[0, L - R) quantized, the rest exact. In decode mode the query at position p sees the
cache at length p + 1, so nothing is quantized before the first flush at p = R - 1; in
prefill mode every query sees the cache at length T.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ModelSpec
from kvlowrank.methods import DenseSpec, KiviSpec
from kvlowrank.eval.perplexity import window_nll
from kvlowrank.model import forward

from np_params import np_init_params

SPEC = ModelSpec(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64)
T = 40
TOL = 2e-5  # fp32: same maths, different reduction shapes


@pytest.fixture(scope="module")
def setup():
  params = np_init_params(SPEC, seed=0, scale=0.3)  # attention far from uniform
  tokens = np.random.default_rng(1).integers(0, SPEC.vocab_size, (2, T)).astype(np.int32)
  return params, tokens


def nll(params, tokens, method, mspec, mode, prompt=0, chunk=0):
  return window_nll(params, tokens, spec=SPEC, method=method, method_spec=mspec,
                    cache_dtype=jnp.float32, mode=mode, prompt_len=prompt,
                    prefill_chunk=chunk)


def uncached_nll(params, tokens):
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
  logits, _ = jax.jit(forward, static_argnames="spec")(params, jnp.asarray(tokens), pos,
                                                       None, SPEC)
  logits = np.asarray(logits, np.float64)[:, :-1]
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return lse - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]


def test_dense_modes_agree(setup):
  params, tokens = setup
  ref = uncached_nll(params, tokens)
  runs = [nll(params, tokens, "dense", DenseSpec(), "prefill"),
          nll(params, tokens, "dense", DenseSpec(), "decode"),
          nll(params, tokens, "dense", DenseSpec(), "decode", prompt=13, chunk=5)]
  for r in runs:
    assert r.shape == (2, T - 1)
    np.testing.assert_allclose(r, ref, atol=TOL, rtol=0)
  # Negative control: a different window order changes the NLL far beyond TOL.
  assert np.abs(nll(params, tokens[::-1], "dense", DenseSpec(), "prefill") - ref).max() > 0.1


def test_kivi_residual_longer_than_window_is_exact(setup):
  params, tokens = setup
  ref = uncached_nll(params, tokens)
  ks = KiviSpec(bits=2, group_size=8, residual=48)  # R > T: nothing is ever quantized
  for mode in ("prefill", "decode"):
    np.testing.assert_allclose(nll(params, tokens, "kivi", ks, mode), ref, atol=TOL, rtol=0)
  # Negative control: R = 8 < T quantizes keys [0, 40) and values [0, 32) in prefill mode.
  short = nll(params, tokens, "kivi", KiviSpec(bits=2, group_size=8, residual=8), "prefill")
  assert np.abs(short - ref).max() > 0.05


def test_kivi_decode_differs_only_past_first_flush(setup):
  params, tokens = setup
  r = 8
  ks = KiviSpec(bits=2, group_size=8, residual=r)
  dense = nll(params, tokens, "dense", DenseSpec(), "decode")
  dec = nll(params, tokens, "kivi", ks, "decode")
  diff = np.abs(dec - dense)
  # Query positions p < R - 1 see a cache of length <= R - 1: nothing flushed yet.
  np.testing.assert_allclose(dec[:, :r - 1], dense[:, :r - 1], atol=TOL, rtol=0)
  # From p = R - 1 on, the first R keys are quantized: every row changes there...
  assert (diff[:, r - 1] > 1e-3).all(), diff[:, r - 1]
  # ...and (almost) every later prediction differs (quantized keys and values).
  assert (diff[:, r - 1:] > 1e-4).mean() > 0.9
  # Prefill mode quantizes keys [0, 40) and values [0, 32) for every query: it differs
  # from dense already at position 0, where decode mode is exact.
  pre = nll(params, tokens, "kivi", ks, "prefill")
  assert (np.abs(pre[:, 0] - dense[:, 0]) > 1e-3).all()


def test_kivi_decode_prompt_equals_prefill_of_prompt(setup):
  """Decode mode's first chunk [0, P) builds the same cache state as prefilling a P-token
  window, so their predictions inside the prompt agree."""
  params, tokens = setup
  ks = KiviSpec(bits=2, group_size=8, residual=8)
  p = 20
  dec = nll(params, tokens, "kivi", ks, "decode", prompt=p)
  pre_p = nll(params, tokens[:, :p], "kivi", ks, "prefill")
  np.testing.assert_allclose(dec[:, :p - 1], pre_p, atol=TOL, rtol=0)
  # Negative control: the full-window prefill quantizes more (floor(40/8)*8 = 40 keys).
  pre_full = nll(params, tokens, "kivi", ks, "prefill")
  assert np.abs(pre_full[:, :p - 1] - pre_p).max() > 1e-3
