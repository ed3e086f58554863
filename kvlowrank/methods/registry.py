"""Method registry: what a config's `method = "<name>"` means to the evaluation pipeline.

A *method* ties together everything the experiment code needs to evaluate one KV-cache
compression scheme, so that the pipeline (kvlowrank.experiment) never special-cases one:

  Method(
    name,                 # the config name: config.method = name, knobs in config.<name>
    cache,                # the cache factory registered with kvlowrank.cache.register_cache
    spec_cls,             # frozen dataclass of the knobs; built from the config section
                          # config.<name> by kvlowrank.config_lib.to_dataclass (unknown
                          # keys and mistyped values rejected, __post_init__ validates)
    kv_bytes_per_token,   # f(model_spec, method_spec, params, cache_dtype) -> float:
                          # ANALYTIC asymptotic KV bytes per token summed over layers
                          # (codes + amortised scales/zeros/latents; the O(1)-in-length
                          # residual windows excluded), used for the Pareto axis
    calibrate=None,       # optional f(params, model_spec, method_spec, calib_tokens, *,
                          # workdir) -> params': fits factors on calibration data and
                          # returns the transformed parameter pytree (new entries in
                          # layer dicts, replaced wk/wv/wo...). calib_tokens: int32 [n, T]
                          # (kvlowrank.data.calib). It must not mutate `params` (the
                          # loaded model is shared by a sweep's points: build new dicts/
                          # lists). The pipeline checkpoints params' with
                          # orbax under workdir/calib/<hash of the calibration config> and
                          # restores it instead of calling calibrate again.
    validate=None,        # optional f(model_spec, method_spec): errors that need the
                          # model (e.g. group size vs head dim), raised before any work
    bits=None,            # optional f(method_spec, cache_dtype) -> str for reports
  )

Adding a method: write a package kvlowrank/methods/<name>/ (its spec, cache, calibration if
any, and method.py, which builds a `Method` and calls `register_method(...)` at import),
then import that package in kvlowrank/methods/__init__.py. Nothing else changes: configs set `method = "<name>"` and
a `<name>` section, sweeps list points like {"method": "<name>", "<name>.rank": 64}.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp

from kvlowrank import config_lib
from kvlowrank.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Method:
  """One evaluable KV-cache method (see the module docstring for the contract)."""

  name: str
  cache: str
  spec_cls: type
  kv_bytes_per_token: Callable[..., float]
  calibrate: Optional[Callable[..., Any]] = None
  validate: Optional[Callable[[ModelSpec, Any], None]] = None
  bits: Optional[Callable[[Any, Any], str]] = None

  def build_spec(self, section, model_spec: Optional[ModelSpec] = None):
    """The method's spec dataclass from its config section (None/missing = defaults).

    Args:
      section: ConfigDict / mapping of the knobs (config.<name>), or None.
      model_spec: when given, also runs `validate(model_spec, method_spec)`.
    Returns:
      an instance of `spec_cls`.
    Raises:
      ValueError naming the bad field.
    """
    spec = config_lib.to_dataclass({} if section is None else section, self.spec_cls,
                                   where=f"config.{self.name}")
    if model_spec is not None and self.validate is not None:
      self.validate(model_spec, spec)
    return spec

  def bits_label(self, method_spec, cache_dtype) -> str:
    """Bits per stored K/V element for reports ("16" for a bf16 dense cache, "4"...)."""
    if self.bits is not None:
      return self.bits(method_spec, cache_dtype)
    if hasattr(method_spec, "bits"):
      return str(method_spec.bits)
    return str(8 * jnp.dtype(cache_dtype).itemsize)


_METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
  """Registers `method` under `method.name`; ValueError on a duplicate name."""
  if method.name in _METHODS:
    raise ValueError(f"method {method.name!r} registered twice")
  if not dataclasses.is_dataclass(method.spec_cls):
    raise ValueError(f"method {method.name!r}: spec_cls must be a dataclass")
  _METHODS[method.name] = method
  return method


def methods() -> tuple[str, ...]:
  """Names of the registered methods."""
  return tuple(sorted(_METHODS))


def get_method(name: str) -> Method:
  """The registered method; ValueError listing the known ones otherwise."""
  if name not in _METHODS:
    raise ValueError(f"unknown config.method {name!r}; known: {', '.join(methods())}")
  return _METHODS[name]


def dense_kv_bytes_per_token(spec: ModelSpec, dtype=jnp.bfloat16) -> float:
  """Bytes per token of an uncompressed K+V cache at `dtype`, all layers: 2 L K H b."""
  return float(2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * jnp.dtype(dtype).itemsize)
