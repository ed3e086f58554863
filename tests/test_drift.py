"""Generation drift (kvlowrank.eval.drift) on a tiny random model: the rollout is the real
generation path (token for token kvlowrank.generate), dense vs dense is exactly match 1 /
KL 0, and the KL of a perturbed model equals a float64 numpy computation along the dense
trajectory (negative controls: a perturbed model or a 2-bit cache drifts; the reverse KL
direction does not match); a full-rank GEAR cache stays on the dense trajectory where its
bare 2-bit backbone drifts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ModelSpec
from kvlowrank.eval import drift as drift_lib
from kvlowrank.generate import generate
from kvlowrank.methods import DenseSpec, GearSpec, KiviSpec
from kvlowrank.model import init_params
from np_reference import np_forward

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64)
PARAMS = init_params(SPEC, jax.random.key(0), scale=0.3)
PROMPTS = np.array([[5, 9, 2, 33, 7, 1, 60, 11], [12, 4, 4, 40, 8, 17, 3, 22]], np.int32)
N = 12
F32 = jnp.float32


def _perturbed(scale, seed=1):
  leaves, tree = jax.tree.flatten(PARAMS)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [a + scale * jax.random.normal(k, a.shape, a.dtype)
                                   for a, k in zip(leaves, keys)])


def _np_logp(params, seq, first, n):
  """float64 log-softmax of the uncached numpy forward at positions first..first+n-1."""
  logits = np_forward(params, seq, SPEC)[first:first + n]
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


# GEAR over 2-bit KIVI (g = 4) with an 8-token buffer: the 8-token prompt is one prefill
# chunk, the 12 generated tokens complete one more chunk.
GEAR = dict(bits=2, group_size=4, buffer=8)


@pytest.mark.parametrize("method,mspec", [("dense", DenseSpec()),
                                          ("kivi", KiviSpec(bits=2, group_size=4,
                                                            residual=4)),
                                          ("gear", GearSpec(**GEAR))])
def test_rollout_is_the_generation_path(method, mspec):
  toks, logp = drift_lib.rollout(PARAMS, SPEC, PROMPTS, N, method=method, method_spec=mspec,
                                 cache_dtype=F32)
  gen = generate(PARAMS, SPEC, PROMPTS.tolist(), max_new_tokens=N, eos_ids=(),
                 cache_method=method, cache_spec=mspec, cache_dtype=F32)
  assert toks.tolist() == [list(t) for t in gen.tokens]
  np.testing.assert_array_equal(toks, logp.argmax(-1))
  np.testing.assert_allclose(np.exp(logp).sum(-1), 1.0, atol=1e-5)


def test_dense_vs_dense_is_exact():
  r = drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS, N, method="dense",
                      method_spec=DenseSpec(), cache_dtype=F32)
  assert r.greedy_match == 1.0 and r.kl == 0.0 and r.kl_max == 0.0
  assert r.first_mismatch == N and (r.n_prompts, r.n_tokens, r.prompt_len) == (2, N, 8)


def test_kl_matches_float64_numpy_along_the_dense_trajectory():
  other = _perturbed(0.05)
  r = drift_lib.drift(PARAMS, other, SPEC, PROMPTS, N, method="dense",
                      method_spec=DenseSpec(), cache_dtype=F32)
  ref_toks, _ = drift_lib.reference(PARAMS, SPEC, PROMPTS, N, F32)
  p = PROMPTS.shape[1]
  kls, rev = [], []
  for prompt, gen in zip(PROMPTS, ref_toks):
    seq = list(prompt) + list(gen[:-1])  # the dense trajectory, teacher-forced
    lp = _np_logp(PARAMS, seq, p - 1, N)
    lq = _np_logp(other, seq, p - 1, N)
    assert list(lp.argmax(-1)) == list(gen)  # numpy agrees on the dense greedy tokens
    kls.append((np.exp(lp) * (lp - lq)).sum(-1))
    rev.append((np.exp(lq) * (lq - lp)).sum(-1))
  assert r.kl == pytest.approx(float(np.mean(kls)), rel=1e-4)
  assert r.kl_max == pytest.approx(float(np.max(kls)), rel=1e-4)
  # Negative controls: the perturbed model drifts; KL(method || dense) is another number.
  assert r.kl > 1e-3 and r.greedy_match < 1.0 and r.first_mismatch < N
  assert abs(float(np.mean(rev)) / r.kl - 1) > 0.01


def test_compressed_cache_drifts():
  r = drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS, N, method="kivi",
                      method_spec=KiviSpec(bits=2, group_size=4, residual=0),
                      cache_dtype=F32)
  assert r.kl > 1e-4 and 0.0 <= r.greedy_match <= 1.0


def test_gear_cache_drift_full_rank_is_lossless_backbone_drifts():
  """GEAR at rank r_p = r_g = n_b = H = 8: each compressed chunk's residual (8 x 8) has
  rank <= 8, so the power iteration's orthonormal A spans it and D^ + S + A B^T = X up to
  the fp16 rounding of A and B: the greedy tokens are the dense ones and the KL is at
  round-off level. Negative control: the same 2-bit backbone without S and L drifts; the
  paper's GEAR (s > 0, r below full) lies in between."""
  def run(**kw):
    return drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS, N, method="gear",
                           method_spec=GearSpec(**GEAR, **kw), cache_dtype=F32)
  full = run(sparsity=0.0, rank_prefill=8, rank_chunk=8)
  bare = run(sparsity=0.0, rank_prefill=0, rank_chunk=0)
  gear = run(sparsity=20.0, rank_prefill=4, rank_chunk=2)
  assert full.greedy_match == 1.0 and full.first_mismatch == N
  assert full.kl < 1e-5 and full.kl_max < 1e-4
  assert bare.kl > 1e-2 and bare.greedy_match < 1.0
  assert full.kl < gear.kl < bare.kl


def test_precomputed_reference_is_used_and_errors_name_the_argument():
  ref = drift_lib.reference(PARAMS, SPEC, PROMPTS, N, F32)
  fake = (ref[0], np.log(np.full_like(ref[1], 1.0 / SPEC.vocab_size)))  # uniform "dense"
  r = drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS, N, method="dense",
                      method_spec=DenseSpec(), cache_dtype=F32, ref=fake)
  assert r.greedy_match == 1.0 and r.kl > 0  # tokens from ref, KL against the fake
  with pytest.raises(ValueError, match="n_tokens"):
    drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS, 0, method="dense",
                    method_spec=DenseSpec())
  with pytest.raises(ValueError, match="prompts"):
    drift_lib.drift(PARAMS, PARAMS, SPEC, PROMPTS[0], N, method="dense",
                    method_spec=DenseSpec())


def test_kl_divergence_float64():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
  la = a - np.log(np.exp(a).sum(-1, keepdims=True))
  lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
  want = [sum(np.exp(la[i, j]) * (la[i, j] - lb[i, j]) for j in range(7)) for i in range(3)]
  np.testing.assert_allclose(drift_lib.kl_divergence(la, lb), want, rtol=1e-12)
  np.testing.assert_allclose(drift_lib.kl_divergence(la, la), 0.0, atol=1e-15)
  la[0, 0] = -np.inf  # zero reference mass contributes nothing (no nan)
  assert np.isfinite(drift_lib.kl_divergence(la, lb)).all()
