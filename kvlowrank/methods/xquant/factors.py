"""The latent path's weight factors (XQuant and XQuant-CL), computed once per weights.

`svd_factors` is a float64 SVD on the host: seconds per matrix for a Llama-3-8B layer
([W_k | W_v] is 4096 x 2048; the set-up times measured: results/decode_ablations.md,
XQuant section), and every `init_caches` call (each
`generate`, each evaluation batch) builds its caches anew. `cached` keeps what a cache
derives from its layer's weights, on the host and in the dtype the cache stores it, for
as long as those weight arrays live: keyed by the arrays' identity, dropped when any of
them is freed (`weakref.finalize`). Traced weights (inside jit / eval_shape) are never
cached. Host memory held: per layer, U_k, ΣB_kᵀ, U_v, ΣB_vᵀ in the weights' dtype (XQuant,
about W_k and W_v's bytes plus two kv_dim² squares) or U [D, 2·kv_dim] in fp32 (XQuant-CL,
twice [W_k | W_v] in bf16). Weights are taken as immutable, as jax arrays are: a numpy
array changed in place after a cache was built from it would keep its old factors.
"""

from __future__ import annotations

import weakref
from typing import Callable

import jax
import numpy as np

_CACHE: dict = {}


def svd_factors(w) -> tuple[np.ndarray, np.ndarray]:
  """Thin SVD W = U·(ΣBᵀ) in float64: returns (U [D, r], ΣBᵀ [r, N]), r = min(D, N).

  Exact (no truncation): U has orthonormal columns, so X·U·(ΣBᵀ) = X·W.
  """
  w64 = np.asarray(jax.device_get(w), np.float64)
  u, s, vt = np.linalg.svd(w64, full_matrices=False)
  return u, s[:, None] * vt


def cached(weights: tuple, tag: str, build: Callable[[], tuple]) -> tuple:
  """build() -> host arrays derived from `weights`; computed once per (tag, weights) while
  every one of those weight objects lives."""
  if any(isinstance(w, jax.core.Tracer) for w in weights):
    return build()
  key = (tag,) + tuple(id(w) for w in weights)
  hit = _CACHE.get(key)
  if hit is not None:
    return hit
  out = build()
  _CACHE[key] = out
  for w in weights:
    weakref.finalize(w, _CACHE.pop, key, None)
  return out


def cached_count() -> int:
  """Entries held now (tests)."""
  return len(_CACHE)
