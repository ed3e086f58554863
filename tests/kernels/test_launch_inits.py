"""`triton_backend.launch`'s init pointers: 1-element dummies of each output's dtype (not
aliased), NaN buffers of the outputs' shapes aliased to them with poison, none with
inits=False. A fake jax-triton records the call (CPU)."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.common import triton_backend

OUTS = [jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.bfloat16)]


@pytest.fixture(name="calls")
def _fake_jax_triton(monkeypatch):
  calls = []

  def triton_call(*args, kernel, out_shape, input_output_aliases, **kwargs):
    calls.append((args, input_output_aliases))
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
  return calls


def _launch(**kw):
  return triton_backend.launch("kernel", jnp.ones(5), 7, jnp.ones(2), out_shapes=OUTS,
                               grid=(1,), num_warps=1, num_stages=1, **kw)


def test_dummies_without_poison(calls):
  _launch(aliases={1: 0})
  (args, aliases), = calls
  assert [(a.shape, a.dtype) for a in args[3:]] == [((1,), jnp.float32), ((1,), jnp.bfloat16)]
  assert aliases == {1: 0}


def test_poison_aliases_nan_buffers(calls):
  _launch(poison=True)
  (args, aliases), = calls
  assert [(a.shape, a.dtype) for a in args[3:]] == [(s.shape, s.dtype) for s in OUTS]
  assert all(np.isnan(np.asarray(a, np.float32)).all() for a in args[3:])
  assert aliases == {2: 0, 3: 1}  # after the two input arrays (the int is no array)


def test_no_inits(calls):
  _launch(inits=False)
  (args, aliases), = calls
  assert len(args) == 3 and aliases == {}
  with pytest.raises(ValueError, match="poison needs"):
    _launch(inits=False, poison=True)
