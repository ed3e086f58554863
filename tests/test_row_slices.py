"""`forward` over its batch a slice of rows at a time (`kvlowrank.model.row_slices`): the
logits, captured inputs and caches equal one pass over the whole batch (XQuant-CL, whose
carry bounds the rows, and the dense cache), generation uses it, and the bad knob is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.methods import init_caches
from kvlowrank.methods.xquant import cl
from kvlowrank.methods.xquant.cl import XQuantCLSpec
from kvlowrank.model import row_slices
from kvlowrank.model.params import init_params
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from kvlowrank.generate import generate

GQA = ModelSpec(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                ffn_dim=96, qkv_bias=True)
B, T, CAP = 5, 12, 32
_fwd = jax.jit(forward, static_argnums=4,
               static_argnames=("capture_inputs", "rows_per_pass", "last_only"))


def test_plan():
  assert row_slices.plan(179, 3) == (3, 59, 2)
  assert row_slices.plan(8, 3) == (3, 2, 2)
  assert row_slices.plan(8, 4) == (4, 2, 0)
  assert row_slices.plan(5, 5) == (5, 1, 0)
  assert row_slices.plan(7, 100) == (7, 1, 0)
  with pytest.raises(ValueError, match="rows_per_pass"):
    row_slices.plan(4, 0)


def _inputs(spec, seed):
  params = init_params(spec, jax.random.key(seed), scale=0.15)
  toks = jax.random.randint(jax.random.key(seed + 1), (B, T + 4), 0, spec.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  pos = pos.at[1, 9:].set(-1).at[3, 5:].set(-1)           # ragged prompts
  return params, toks, pos


def _run(method, mspec, rows, capture=False, seed=0):
  """Prefill then 4 decode steps with `rows_per_pass=rows` (0: the whole batch)."""
  params, toks, pos = _inputs(GQA, seed)
  caches = init_caches(method, mspec, GQA, params, batch=B, capacity=CAP, dtype=jnp.float32)
  out = _fwd(params, toks[:, :T], pos, caches, GQA, capture_inputs=capture,
             rows_per_pass=rows)
  logits, caches = out[0], out[1]
  outs = [logits] + ([out[2]] if capture else [])
  nxt = jnp.max(pos, axis=1, keepdims=True) + 1
  for i in range(4):
    lg, caches = _fwd(params, toks[:, T + i:T + i + 1], nxt + i, caches, GQA,
                      rows_per_pass=rows)
    outs.append(lg)
  return outs, caches


@pytest.mark.parametrize("method,mspec,rows", [
    ("xquant_cl", XQuantCLSpec(bits=2, group_size=16, path="latent", base_layer=1), 2),
    ("xquant_cl", XQuantCLSpec(bits=2, group_size=16, path="x", base_layer=0), 3),
    ("dense", None, 2)], ids=["xquant-cl-latent-2", "xquant-cl-x-3", "dense-2"])
def test_sliced_forward_equals_whole_batch(method, mspec, rows):
  """Slices of `rows` rows (scanned passes plus a remainder: 5 = 2 + 2 + 1, 3 + 2) give the
  whole batch's logits, captured inputs and cache arrays, through prefill and decode steps.
  Negative control: the rows differ from one another, so a slice written to the wrong rows
  would show."""
  # Tolerances: the products of a slice and of the whole batch may round differently in the
  # last bit (XLA:CPU at the suite's optimisation level 0 blocks loops by shape); one such
  # bit can move a stored fp16 zero-point by an ulp, and the 2-bit logits by ~3e-4, where
  # 2 bits against exact move them by > 1e-1 (`test_xquant_cl`).
  whole, wc = _run(method, mspec, 0, capture=True)
  sliced, sc = _run(method, mspec, rows, capture=True)
  for a, b in zip(sliced, whole):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3, rtol=0)
  for a, b in zip(jax.tree.leaves(sc), jax.tree.leaves(wc)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iu":
      assert np.mean(a != b) < 1e-2            # a rounding-boundary code may flip
    else:
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-3)
  last = np.asarray(whole[-1])
  for i in range(B - 1):
    assert np.abs(last[i] - last[i + 1]).max() > 5e-2


def test_xquant_cl_bounds_its_rows_by_the_carry():
  """The default bound keeps the fp32 carry [rows, S, D] within `CARRY_BYTES`; the spec's
  field overrides it; the bound reaches `forward` (`rows_per_pass`), and a bad value is
  named."""
  params = init_params(GQA, jax.random.key(0), scale=0.15)
  caches = init_caches("xquant_cl", XQuantCLSpec(bits=2, group_size=16), GQA, params,
                       batch=2, capacity=CAP)
  assert row_slices.rows_per_pass(caches) == cl.CARRY_BYTES // (CAP * GQA.dim * 4)
  big = GQA.replace(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, n_layers=1)
  assert cl.CARRY_BYTES // (33024 * big.dim * 4) == 3     # Llama-3-8B width, 32K slots
  caches = init_caches("xquant_cl", XQuantCLSpec(bits=2, group_size=16, rows_per_pass=2),
                       GQA, params, batch=2, capacity=CAP)
  assert row_slices.rows_per_pass(caches) == 2
  assert row_slices.rows_per_pass(init_caches("dense", None, GQA, params, batch=2,
                                              capacity=CAP)) is None
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="XQuantCLSpec.rows_per_pass"):
      XQuantCLSpec(rows_per_pass=bad)


def test_generate_runs_row_slices():
  """Greedy generation with XQuant-CL one row per pass (the cache's bound, as a user sets
  it) gives the tokens of the whole-batch run."""
  params = init_params(GQA, jax.random.key(7), scale=0.3)
  prompts = [[3, 5, 7, 9, 11], [2, 4], [8, 1, 6, 6, 2, 9, 9]]

  def gen(rows):
    spec = XQuantCLSpec(bits=4, group_size=16, base_layer=1, rows_per_pass=rows)
    return generate(params, GQA, prompts, max_new_tokens=8, cache_method="xquant_cl",
                    cache_spec=spec, cache_dtype=jnp.float32, eos_ids=()).tokens

  one, whole = gen(1), gen(16)
  assert [list(map(int, r)) for r in one] == [list(map(int, r)) for r in whole]
