"""Palu calibration (Grams, Fisher) and an end-to-end check on the real stories260K model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlowrank.methods.palu as palu
from kvlowrank import resources
from kvlowrank.methods import init_caches
from kvlowrank.model.params import layer_shapes
from kvlowrank.model.transformer import forward
from kvlowrank.methods.palu import calibration
from kvlowrank.spec import ModelSpec

SPEC = ModelSpec(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=40)


def _params(spec, seed=0, scale=0.3):
  rng = np.random.default_rng(seed)
  mk = lambda shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
  layers = [{n: (jnp.ones(sh) if n.endswith("norm") else mk(sh))
             for n, sh in layer_shapes(spec).items()} for _ in range(spec.n_layers)]
  return {"embed": mk((spec.vocab_size, spec.dim)), "final_norm": jnp.ones(spec.dim),
          "lm_head": mk((spec.dim, spec.vocab_size)), "layers": layers}


def test_gram_equals_numpy_of_captured_inputs():
  params = _params(SPEC)
  windows = np.random.default_rng(1).integers(0, SPEC.vocab_size, (5, 9))
  grams, n = calibration.gram_statistics(params, SPEC, windows, batch_size=2)
  assert n == 45
  pos = jnp.broadcast_to(jnp.arange(9), (5, 9))
  _, _, xs = jax.jit(forward, static_argnames=("spec", "capture_inputs"))(
      params, jnp.asarray(windows), pos, None, spec=SPEC, capture_inputs=True)
  xs = np.asarray(xs, np.float64).reshape(SPEC.n_layers, -1, SPEC.dim)
  want = np.einsum("lnd,lne->lde", xs, xs)
  np.testing.assert_allclose(grams, want, rtol=1e-5, atol=1e-5)
  # negative control: a dropped window changes the statistics
  partial, _ = calibration.gram_statistics(params, SPEC, windows[:4])
  assert not np.allclose(partial, want, rtol=1e-3)


def test_fisher_matches_per_window_gradients():
  """Fisher from the vmapped wk/wv gradients == explicit jax.grad over all params."""
  params = _params(SPEC)
  windows = np.random.default_rng(2).integers(0, SPEC.vocab_size, (3, 10))
  got_rms = calibration.fisher_scores(params, SPEC, windows, reduce="rms", batch_size=2)
  got_sum = calibration.fisher_scores(params, SPEC, windows, reduce="sum_sq")
  got_grp = calibration.fisher_scores(params, SPEC, windows, n_groups=2)
  grad_fn = jax.jit(jax.grad(calibration.lm_loss), static_argnames=("spec",))
  sq = np.zeros((SPEC.n_layers, 2, SPEC.dim, SPEC.kv_dim))
  for w in windows:
    g = grad_fn(params, jnp.asarray(w)[None], spec=SPEC)
    for i, lg in enumerate(g["layers"]):
      sq[i, 0] += np.asarray(lg["wk"], np.float64) ** 2 / len(windows)
      sq[i, 1] += np.asarray(lg["wv"], np.float64) ** 2 / len(windows)
  np.testing.assert_allclose(got_rms, np.sqrt(sq).mean(axis=(2, 3)), rtol=1e-4)
  np.testing.assert_allclose(got_sum, sq.sum(axis=(2, 3)), rtol=1e-4)
  half = SPEC.kv_dim // 2
  np.testing.assert_allclose(got_grp[..., 1], np.sqrt(sq[..., half:]).mean(axis=(2, 3)),
                             rtol=1e-4)
  # negative control: the square of the *batch-mean* gradient is a different quantity
  g_mean = grad_fn(params, jnp.asarray(windows), spec=SPEC)
  wrong = np.abs(np.asarray(g_mean["layers"][0]["wk"], np.float64)).mean()
  assert abs(wrong - got_rms[0, 0]) > 1e-3 * got_rms[0, 0]


# -- real model ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _stories():
  if resources.shared_dir() is None:
    pytest.skip("../shared (stories260K) not available")
  from kvlowrank.loaders import load_model
  m = load_model(resources.shared_path("models", "stories260K", "stories260K.bin"))
  text = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
          "in the park with her dog. One day, she saw a big red ball under a tree. ")
  ids = np.asarray(m.tokenizer.encode(text * 12, add_bos=True), np.int32)
  return m, ids


@functools.partial(jax.jit, static_argnames=("spec",))
def _nll(params, toks, caches, spec):
  b, t = toks.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  logits, _ = forward(params, toks, pos, caches, spec)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], -1)), logits


def test_stories260k_end_to_end():
  """Real weights: full rank is exact; whitened SVD beats plain SVD at 50%; the Fisher
  allocation hits the target; 2-bit latents hurt less with the Hadamard fold."""
  m, ids = _stories()
  spec, params = m.spec, m.params
  calib_w = ids[:192].reshape(3, 64)
  eval_t = jnp.asarray(ids[192:320].reshape(2, 64))
  calib = palu.calibrate(params, spec, calib_w, fisher_windows=calib_w[:2])
  dense_nll, dense_logits = _nll(params, eval_t, None, spec)

  def run(pspec):
    cp, layout = palu.compress(params, spec, pspec, calib)
    caches = init_caches("palu", pspec, spec, cp, batch=2, capacity=64, dtype=jnp.float32)
    nll, logits = _nll(cp, eval_t, caches, spec)
    return float(nll), logits, layout

  base = palu.PaluSpec(rank_multiple=8, hadamard=True)   # G-LRD gs-4 = all 4 KV heads
  _, logits, _ = run(base.replace(target_ratio=0.0))
  np.testing.assert_allclose(logits, dense_logits, atol=1e-4, rtol=0)
  whiten, _, layout = run(base)
  assert abs(layout.compression_ratio() - 0.5) < 1e-9
  plain, _, _ = run(base.replace(decomposition="svd"))
  assert float(dense_nll) < whiten < plain
  had2, _, _ = run(base.replace(bits=2))
  nohad2, _, _ = run(base.replace(bits=2, hadamard=False))
  assert whiten < had2 < nohad2


def test_method_statistics_cache_and_kv_bytes(tmp_path):
  """The registered method: statistics cached on disk, analytic bytes == cache storage."""
  from kvlowrank.methods import get_method
  from kvlowrank.methods.palu.method import statistics
  method = get_method("palu")
  params = _params(SPEC)
  tokens = np.random.default_rng(3).integers(0, SPEC.vocab_size, (4, 12)).astype(np.int32)
  pspec = method.build_spec({"rank_multiple": 4, "fisher_samples": 2}, SPEC)
  first = statistics(params, SPEC, pspec, tokens, tmp_path)
  assert len(list((tmp_path / "palu_stats").glob("*.npz"))) == 2   # gram + fisher
  again = statistics(params, SPEC, pspec, tokens, tmp_path)
  np.testing.assert_array_equal(first.grams, again.grams)
  np.testing.assert_array_equal(first.fisher, again.fisher)
  direct = calibration.fisher_scores(params, SPEC, tokens[:2])
  np.testing.assert_allclose(first.fisher, direct, rtol=1e-6)
  # other windows -> another cache entry, not a stale hit
  statistics(params, SPEC, pspec, tokens[::-1], tmp_path)
  assert len(list((tmp_path / "palu_stats").glob("*.npz"))) == 4
  cparams = method.calibrate(params, SPEC, pspec, tokens, workdir=str(tmp_path))
  for bits in (None, 3):
    ps = pspec.replace(bits=bits)
    caches = init_caches("palu", ps, SPEC, cparams, batch=1, capacity=8, dtype=jnp.bfloat16)
    want = sum(c.bytes_per_token() for c in caches)
    assert method.kv_bytes_per_token(SPEC, ps, cparams, jnp.bfloat16) == want
  with pytest.raises(ValueError, match="group_size .3. must divide"):
    method.build_spec({"group_size": 3}, SPEC)
