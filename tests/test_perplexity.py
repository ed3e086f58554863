"""Perplexity (kvlowrank.eval.perplexity) vs an independent float64 numpy computation of the
windowed NLL, the window/schedule bookkeeping, and text windowing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ModelSpec
from kvlowrank.methods import DenseSpec
from kvlowrank.data import text as text_lib
from kvlowrank.eval.perplexity import perplexity, schedule
from np_params import np_init_params
from np_reference import np_forward

SPEC = ModelSpec(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64)
W, T = 3, 12


@pytest.fixture(scope="module")
def setup():
  params = np_init_params(SPEC, seed=0, scale=0.3)
  ids = np.random.default_rng(0).integers(0, SPEC.vocab_size, W * T + 5).astype(np.int32)
  return params, ids


def np_windowed_nll(params, ids, seq_len, stride=None, shift=1):
  """GPTQ protocol in float64 numpy: non-overlapping windows, T-1 predictions each."""
  stride = stride or seq_len
  total, count = 0.0, 0
  for s in range(0, len(ids) - seq_len + 1, stride):
    win = ids[s:s + seq_len]
    logits = np_forward(params, win, SPEC)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = seq_len - shift
    total -= logp[np.arange(n), win[shift:shift + n]].sum()
    count += n
  return total, count


@pytest.mark.parametrize("mode,prompt,chunk,batch", [("prefill", 0, 0, 1), ("prefill", 0, 0, 2),
                                                     ("decode", 0, 0, 3), ("decode", 5, 2, 2)])
def test_ppl_matches_numpy(setup, mode, prompt, chunk, batch):
  params, ids = setup
  windows = text_lib.windows(ids, T)
  assert windows.shape == (W, T)  # tail of 5 tokens dropped
  res = perplexity(params, windows, spec=SPEC, method="dense", method_spec=DenseSpec(),
                   cache_dtype=jnp.float32, mode=mode, batch_size=batch, prompt_len=prompt,
                   prefill_chunk=chunk)
  ref_total, ref_count = np_windowed_nll(params, ids[:W * T], T)
  assert res.n_tokens == ref_count == W * (T - 1) and res.n_windows == W
  np.testing.assert_allclose(res.nll_sum, ref_total, rtol=2e-6)
  np.testing.assert_allclose(res.ppl, math.exp(ref_total / ref_count), rtol=2e-6)
  assert len(res.window_ppl) == W
  # Negative controls: an off-by-one target or overlapping windows must not match.
  bad_total, _ = np_windowed_nll(params, ids[:W * T], T, shift=2)
  assert abs(res.nll_sum - bad_total) > 1e-2 * abs(ref_total)
  ovl_total, ovl_count = np_windowed_nll(params, ids[:W * T], T, stride=T // 2)
  assert abs(res.ppl - math.exp(ovl_total / ovl_count)) > 1e-4 * res.ppl


def test_schedule():
  assert schedule(10, "prefill") == [(0, 10)]
  assert schedule(6, "decode") == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
  assert schedule(10, "decode", 5, 2) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8),
                                          (8, 9)]
  assert schedule(10, "decode", 4) == [(0, 4)] + [(s, s + 1) for s in range(4, 9)]
  assert schedule(5, "decode", 99) == [(0, 4)]  # the last token is never fed
  with pytest.raises(ValueError, match="mode"):
    schedule(5, "generate")


def test_windows_and_errors():
  ids = np.arange(23, dtype=np.int32)
  w = text_lib.windows(ids, 5)
  np.testing.assert_array_equal(w, np.arange(20).reshape(4, 5))
  np.testing.assert_array_equal(text_lib.windows(ids, 5, 2), np.arange(10).reshape(2, 5))
  with pytest.raises(ValueError, match="seq_len"):
    text_lib.windows(ids, 1)
  with pytest.raises(ValueError, match="fewer than one window"):
    text_lib.windows(ids, 50)
  with pytest.raises(ValueError, match=r"windows must be \[W, T>=2\]"):
    perplexity(None, np.zeros((3,), np.int32), spec=SPEC, method="dense",
               method_spec=DenseSpec())
