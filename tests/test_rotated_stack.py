"""Stacking (issue 22 item 5): rotation + KIVI-style 4-bit + SnapKV eviction in one config."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import caches_nbytes, init_caches
from kvlowrank.methods import EvictSpec, get_method, rotated
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec
from np_params import np_init_params

SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                 ffn_dim=48)


@functools.partial(jax.jit, static_argnames=("spec",))
def _fwd(params, toks, pos, caches, spec):
  return forward(params, toks, pos, caches, spec)


def test_rotation_quantization_eviction_compose():
  params = np_init_params(SPEC, seed=0, scale=0.25)
  toks = np.random.default_rng(0).integers(0, 64, (2, 48))
  es = EvictSpec(inner="zack", budget=40, window=8,
                 inner_specs={"zack": dict(target_ratio=0.5, bits=4, group_size=16,
                                           residual=16, calibration="data")})
  method = get_method("evict")
  cp = method.calibrate(params, SPEC, es, toks, workdir=None)    # zack's, through evict
  assert rotated.layout_from_params(cp, 32).compression_ratio() == 0.5
  pos = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32), (2, 48))
  t = jnp.asarray(toks)
  # Budget >= length: nothing is evicted and the wrapper is transparent.
  big = EvictSpec(inner="zack", budget=64, window=8, inner_specs=dict(es.inner_specs))
  wrapped = init_caches("evict", big, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32)
  plain = init_caches("rotated", es.inner_spec, SPEC, cp, batch=2, capacity=48,
                      dtype=jnp.float32)
  lw, _ = _fwd(cp, t, pos, wrapped, SPEC)
  lp_, _ = _fwd(cp, t, pos, plain, SPEC)
  np.testing.assert_allclose(np.asarray(lw), np.asarray(lp_), atol=2e-4)
  # Budget 40 < 48 tokens: 8 evicted; the stacked cache stores fewer bytes, runs finite and
  # differs from the unevicted one (negative control: eviction really happened).
  ev = init_caches("evict", es, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32)
  le, ev = _fwd(cp, t, pos, ev, SPEC)
  assert np.all(np.isfinite(np.asarray(le)))
  assert np.max(np.abs(np.asarray(le) - np.asarray(lp_))) > 1e-4
  assert caches_nbytes(ev) < caches_nbytes(
      init_caches("evict", big, SPEC, cp, batch=2, capacity=48, dtype=jnp.float32))
  assert isinstance(ev[0].inner, rotated.RotatedCache) and ev[0].inner.quant is not None
