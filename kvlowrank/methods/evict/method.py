"""Eviction as an evaluable method: `method = "evict"`, the wrapped method in evict.inner.

The inner method's calibration (Palu's factors...), model checks and bits label are the
wrapper's. KV bytes per token (the Pareto axis): the inner method's asymptotic bytes per
stored token times the fraction of a `bytes_context`-token context the cache keeps,
min(budget, context) / context (an eviction cache does not grow with the context, so a
per-token figure needs a context length; 0 reports the inner's bytes per token).
"""

from __future__ import annotations

from kvlowrank.methods.evict.cache import check_inner
from kvlowrank.methods.evict.spec import EvictSpec
from kvlowrank.methods.registry import Method, get_method, register_method


def _validate(spec, es: EvictSpec) -> None:
  check_inner(es.inner, es.ring)
  if spec.sliding_window is not None:
    raise ValueError("config.evict: sliding-window models are not supported")
  inner = get_method(es.inner)
  if inner.validate is not None:
    inner.validate(spec, es.inner_spec)


def _kv_bytes(spec, es: EvictSpec, params, cache_dtype) -> float:
  per_token = get_method(es.inner).kv_bytes_per_token(spec, es.inner_spec, params,
                                                       cache_dtype)
  if es.bytes_context <= 0:
    return per_token
  return per_token * min(es.budget, es.bytes_context) / es.bytes_context


def _calibrate(params, spec, es: EvictSpec, calib_tokens, *, workdir):
  inner = get_method(es.inner)
  if inner.calibrate is None:
    return params
  return inner.calibrate(params, spec, es.inner_spec, calib_tokens, workdir=workdir)


def _bits(es: EvictSpec, cache_dtype) -> str:
  return get_method(es.inner).bits_label(es.inner_spec, cache_dtype)


EVICT = register_method(Method(name="evict", cache="evict", spec_cls=EvictSpec,
                               kv_bytes_per_token=_kv_bytes, calibrate=_calibrate,
                               validate=_validate, bits=_bits))
