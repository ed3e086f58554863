"""Parameter pytree layout and random initialisation.

The parameter pytree is a plain nested dict (no framework state)::

  params = {
    "embed":      [V, D],
    "final_norm": [D],
    "lm_head":    [D, V]            # absent when spec.tie_embeddings
    "layers": [                     # a list, one dict per layer (ranks may differ per layer)
      {
        "attn_norm": [D],
        "wq": [D, N*H], "wk": [D, K*H], "wv": [D, K*H], "wo": [N*H, D],
        "bq": [N*H], "bk": [K*H], "bv": [K*H]          # only when spec.qkv_bias
        "mlp_norm": [D],
        "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D],
      }, ...
    ],
  }

Weights are stored input-major (y = x @ w), i.e. transposed w.r.t. torch Linear.
Q/K output columns follow `spec.rope_layout` (HF half-rotation by default).
Compression methods may add entries to a layer dict (e.g. Palu's factors) or
replace `wo` (value fold); the attention block reads only what its cache needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.spec import ModelSpec

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")


def layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
  d, f = spec.dim, spec.ffn_dim
  shapes = {
      "attn_norm": (d,), "wq": (d, spec.q_dim), "wk": (d, spec.kv_dim),
      "wv": (d, spec.kv_dim), "wo": (spec.q_dim, d), "mlp_norm": (d,),
      "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
  }
  if spec.qkv_bias:
    shapes.update(bq=(spec.q_dim,), bk=(spec.kv_dim,), bv=(spec.kv_dim,))
  return shapes


def init_params(spec: ModelSpec, key: jax.Array, dtype=jnp.float32, scale: float = 0.02):
  """Random parameters of the right shapes (tests, benchmarks with real shapes).

  Norm weights are 1; every other tensor is N(0, scale^2) in fp32, then cast to `dtype`.
  The draws use numpy's PCG64 generator seeded with the key's data words
  (`np.random.default_rng(list(key_data(key)))`), tensor by tensor in a fixed order:
  each layer's `layer_shapes` entries, then embed, then lm_head. (jax.random would
  compile a sampler per tensor shape: seconds per new spec on a CPU; numpy takes
  microseconds and is equally deterministic.) Equal keys give equal parameters.

  Args:
    spec: the model's ModelSpec.
    key: a jax.random key (typed, or a raw uint32 PRNGKey).
    dtype: parameter dtype.
    scale: standard deviation of the weights.
  Returns:
    the parameter pytree (module docstring layout).
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  rng = np.random.default_rng([int(w) for w in np.asarray(key, np.uint32).ravel()])
  scale = np.float32(scale)
  normal = lambda shape: jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype)
  layers = []
  for _ in range(spec.n_layers):
    lp = {}
    for name, shape in layer_shapes(spec).items():
      lp[name] = (jnp.ones(shape, dtype) if name.endswith("norm") else normal(shape))
    layers.append(lp)
  params = {"embed": normal((spec.vocab_size, spec.dim)),
            "final_norm": jnp.ones((spec.dim,), dtype), "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = normal((spec.dim, spec.vocab_size))
  return params


def check_params(params, spec: ModelSpec, source: str = "params") -> None:
  """Raises ValueError naming the first missing or mis-shaped tensor."""
  def expect(name, arr, shape):
    if arr is None:
      raise ValueError(f"{source}: missing tensor {name!r}")
    if tuple(arr.shape) != tuple(shape):
      raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
  expect("embed", params.get("embed"), (spec.vocab_size, spec.dim))
  expect("final_norm", params.get("final_norm"), (spec.dim,))
  if not spec.tie_embeddings:
    expect("lm_head", params.get("lm_head"), (spec.dim, spec.vocab_size))
  layers = params.get("layers")
  if layers is None or len(layers) != spec.n_layers:
    raise ValueError(f"{source}: expected {spec.n_layers} layers, got "
                     f"{None if layers is None else len(layers)}")
  for i, lp in enumerate(layers):
    for name, shape in layer_shapes(spec).items():
      expect(f"layers.{i}.{name}", lp.get(name), shape)


def cast_params(params, dtype):
  """Casts floating leaves to `dtype` (bf16 or fp32)."""
  def cast(x):
    x = jnp.asarray(x)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, params)


def count_params(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
