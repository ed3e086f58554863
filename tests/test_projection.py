"""`model.projection.project`: x @ w, one row kept a GEMM.

CPU: the product equals a float64 numpy reference for one row and for many (seeded inputs),
and the one-row case lowers to a two-row dot behind an optimization barrier (negative
control: the plain x @ w lowers to a one-row dot); a tiny model's batch-1 decode step, every
projection through that branch, equals the float64 numpy model. GPU (`-m gpu`): XLA:GPU's
optimised HLO of a one-row K/V-shaped projection (4096 x 1024, bf16) keeps a GEMM with
`project`, and none with the plain x @ w (the strength reduction the module docstring
describes).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvlowrank import ModelSpec  # noqa: E402
from kvlowrank.methods import DenseSpec, init_caches  # noqa: E402
from kvlowrank.model import forward, init_params  # noqa: E402
from kvlowrank.model.projection import project  # noqa: E402
from np_reference import np_forward  # noqa: E402


def _inputs(rows_shape, d=24, n=40, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*rows_shape, d)).astype(np.float32)
  w = rng.standard_normal((d, n)).astype(np.float32)
  return x, w


@pytest.mark.parametrize("rows_shape", [(1, 1), (1,), (2, 1), (3, 5)])
def test_project_matches_float64(rows_shape):
  x, w = _inputs(rows_shape)
  got = np.asarray(jax.jit(project)(x, w))
  want = x.astype(np.float64) @ w.astype(np.float64)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # negative control: another weight matrix is far outside the tolerance
  assert np.abs(got - x.astype(np.float64) @ _inputs(rows_shape, seed=1)[1]).max() > 1e-1


def _dots(text):
  """The lines of StableHLO text that hold a dot_general (its operand shapes among them)."""
  return [line for line in text.splitlines() if "dot_general" in line]


def test_one_row_lowers_to_a_two_row_dot():
  x, w = _inputs((1, 1))
  text = jax.jit(project).lower(x, w).as_text()
  dots = _dots(text)
  assert len(dots) == 1 and "tensor<2x24xf32>" in dots[0], dots
  assert "optimization_barrier" in text
  # negative control: the plain product is a one-row dot, and several rows are left alone
  plain = _dots(jax.jit(lambda a, b: a @ b).lower(x, w).as_text())
  assert not any("tensor<2x24xf32>" in d for d in plain), plain
  many = jax.jit(project).lower(*_inputs((3, 5))).as_text()
  assert "optimization_barrier" not in many


def test_batch1_decode_step_matches_float64_model():
  """The model's one-row path end to end: a dense-cache prefill of 5 tokens, then a batch-1
  decode step (every projection through `project`'s one-row branch) equals the float64
  numpy model at the 6th position; negative control: another decoded token does not."""
  spec = ModelSpec(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   ffn_dim=64)
  params = init_params(spec, jax.random.key(0), scale=0.3)
  seq = np.random.default_rng(3).integers(0, spec.vocab_size, 6).astype(np.int32)
  fwd = jax.jit(forward, static_argnames=("spec",))
  caches = init_caches("dense", DenseSpec(), spec, params, batch=1, capacity=8,
                       dtype=jnp.float32)
  _, caches = fwd(params, jnp.asarray(seq[None, :5]), jnp.arange(5)[None], caches, spec=spec)
  step, _ = fwd(params, jnp.asarray(seq[None, 5:]), jnp.asarray([[5]]), caches, spec=spec)
  ref = np_forward(params, seq, spec)
  np.testing.assert_allclose(np.asarray(step[0, 0]), ref[5], atol=2e-5)
  other = np_forward(params, np.append(seq[:5], (seq[5] + 1) % spec.vocab_size), spec)
  assert np.abs(np.asarray(step[0, 0]) - other[5]).max() > 1e-3


@pytest.mark.gpu
def test_gpu_one_row_projection_stays_a_gemm():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  x = jnp.ones((1, 1, 4096), jnp.bfloat16)
  w = jnp.ones((4096, 1024), jnp.bfloat16)

  def optimised(fn):
    return jax.jit(fn).lower(x, w).compile().as_text()

  def has_gemm(text):
    """A dot left in the optimised HLO (a Triton GEMM fusion's, or a cuBLAS call)."""
    return " dot(" in text or "__cublas" in text

  # (the GEMM itself may hold a reduce: a split-K Triton GEMM sums its splits)
  assert has_gemm(optimised(project))
  # negative control: XLA:GPU strength-reduces the plain one-row product (no dot is left)
  assert not has_gemm(optimised(lambda a, b: a @ b))
  np.testing.assert_allclose(np.asarray(jax.jit(project)(x, w), np.float32), 4096.0)
