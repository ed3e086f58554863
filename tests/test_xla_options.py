"""The decode programs' XLA options (kvlowrank.model.xla_options): XLA accepts them, rejects
a bad value (negative control), and `generate`'s decode loop and the perplexity windows are
compiled with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.eval import perplexity
from kvlowrank.generate import loop
from kvlowrank.model import xla_options


def _compiled(options):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32)
  f = jax.jit(lambda a: jnp.cumsum(a * 2.0), compiler_options=options)
  return np.asarray(f(x)), np.cumsum(np.asarray(x, np.float64) * 2.0)


def test_decode_options_are_valid_xla_options():
  got, want = _compiled(xla_options.DECODE)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_bad_value_is_rejected():
  key = next(iter(xla_options.DECODE))
  with pytest.raises(Exception, match="not a valid enum value"):
    _compiled({key: "NOT_A_MODE"})


# pylint: disable=protected-access
@pytest.mark.parametrize("fn", [loop._decode, perplexity._window_nll],
                         ids=["generate_decode", "perplexity_windows"])
def test_decode_programs_carry_the_options(fn):
  assert dict(fn._jit_info.compiler_options_kvs) == xla_options.DECODE


def test_prefill_keeps_xla_defaults():
  assert dict(loop._prefill._jit_info.compiler_options_kvs) == {}
