"""What a calibration changed in a parameter pytree, so checkpoints hold only that.

A calibrated model (Palu factors, folded W_o, XQuant projections) differs from the
loaded one in a few entries per layer. Saving the whole pytree would write the
model's weights again for every calibration (~0.5 GB for SmolLM2 in fp32); the delta
holds only new or changed arrays plus the names of removed entries, and `apply`
rebuilds the calibrated pytree bit for bit from the loaded model.

Pytrees here are nested dicts and lists of arrays (the layout of
kvlowrank.model.params). Paths are tuples of dict keys / list indices.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _same(a, b) -> bool:
  if a is b:
    return True
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def diff(base: Any, new: Any) -> tuple[dict, list[list]]:
  """Returns (changed, removed): changed maps "/"-joined paths to arrays of `new` that
  are absent from or differ from `base`; removed lists paths present only in `base`."""
  changed: dict[str, Any] = {}
  removed: list[list] = []

  def walk(b, n, path):
    if isinstance(n, dict) and isinstance(b, dict):
      for k in n:
        if k in b:
          walk(b[k], n[k], path + [k])
        else:
          _collect(n[k], path + [k])
      removed.extend(path + [k] for k in b if k not in n)
    elif isinstance(n, (list, tuple)) and isinstance(b, (list, tuple)) and len(n) == len(b):
      for i, (bi, ni) in enumerate(zip(b, n)):
        walk(bi, ni, path + [i])
    elif isinstance(n, (dict, list, tuple)) or isinstance(b, (dict, list, tuple)):
      raise ValueError(f"calibrated params change the structure at {_key(path)}; "
                       "only dict entries may be added or removed")
    elif not _same(b, n):
      changed[_key(path)] = n

  def _collect(n, path):
    if isinstance(n, dict):
      for k, v in n.items():
        _collect(v, path + [k])
    elif isinstance(n, (list, tuple)):
      raise ValueError(f"calibrated params add a list at {_key(path)}; not supported")
    else:
      changed[_key(path)] = n

  walk(base, new, [])
  return changed, removed


def apply(base: Any, changed: dict, removed: list[list]) -> Any:
  """Rebuilds the calibrated pytree from `base` and a `diff` result (base is not mutated)."""
  def copy(t):
    if isinstance(t, dict):
      return {k: copy(v) for k, v in t.items()}
    if isinstance(t, (list, tuple)):
      return [copy(v) for v in t]
    return t
  out = copy(base)
  for path in removed:
    node = out
    for p in path[:-1]:
      node = node[p]
    del node[path[-1]]
  for key, arr in changed.items():
    path = [int(p) if p.isdigit() else p for p in key.split("/")]
    node = out
    for p in path[:-1]:
      node = node.setdefault(p, {}) if isinstance(node, dict) else node[p]
    node[path[-1]] = arr
  return out


def _key(path) -> str:
  for p in path:
    if isinstance(p, str) and ("/" in p or p.isdigit()):
      raise ValueError(f"parameter name {p!r} cannot be stored in a delta checkpoint")
  return "/".join(str(p) for p in path)
