"""The uncompressed baseline: exact K/V at the cache dtype (bf16 = the paper baselines)."""

from __future__ import annotations

from kvlowrank.methods.dense.cache import DenseSpec
from kvlowrank.methods.registry import Method, dense_kv_bytes_per_token, register_method


def _kv_bytes(spec, method_spec, params, cache_dtype) -> float:
  del method_spec, params
  return dense_kv_bytes_per_token(spec, cache_dtype)


DENSE = register_method(Method(name="dense", cache="dense", spec_cls=DenseSpec,
                               kv_bytes_per_token=_kv_bytes))
