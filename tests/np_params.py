"""Seeded random parameters built with numpy (fast: no per-shape jax RNG compilations),
in the layout of kvlowrank.model.params. Shared by the evaluation-pipeline tests."""

import jax.numpy as jnp
import numpy as np

from kvlowrank.model.params import layer_shapes


def np_init_params(spec, seed=0, scale=0.3, dtype=jnp.float32):
  """Like kvlowrank.model.init_params (norms 1, weights N(0, scale^2)), numpy RNG."""
  rng = np.random.default_rng(seed)
  normal = lambda shape: jnp.asarray(scale * rng.standard_normal(shape), dtype)
  layers = [{name: jnp.ones(shape, dtype) if name.endswith("norm") else normal(shape)
             for name, shape in layer_shapes(spec).items()} for _ in range(spec.n_layers)]
  params = {"embed": normal((spec.vocab_size, spec.dim)),
            "final_norm": jnp.ones((spec.dim,), dtype), "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = normal((spec.dim, spec.vocab_size))
  return params
