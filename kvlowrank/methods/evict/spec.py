"""EvictSpec: the knobs of the eviction wrapper (kvlowrank.methods.evict.cache).

Config layout (`method = "evict"`):

  evict.inner        registered method whose cache holds the kept tokens ("dense", "kivi",
                     "gear", "palu", "xquant", "fdc", "zack"; not "xquant_cl": cache.py)
  evict.inner_specs  {method name: its knobs}; only the entry of `inner` is used (absent =
                     the inner method's defaults), so one config can sweep over inners
  evict.budget       most tokens stored per sequence and layer (inner cache + window)
  evict.window       recent tokens that are never evicted (SnapKV's window_size)
  evict.observe      last queries of a call whose attention scores the candidates
                     (SnapKV's observation window; None = window, at least 1)
  evict.pool         width of the average pooling of the scores (SnapKV kernel_size, odd)
  evict.ring         how the window is attended: "auto" | "exact" | "inner" (cache.py)
  evict.bytes_context  context length at which kv_bytes_per_token is reported (the cache
                     holds min(budget, context) tokens of it; 0 = the inner's bytes/token)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from kvlowrank import config_lib

RINGS = ("auto", "exact", "inner")


def _int(where: str, value, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{where} must be an int >= {low}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class EvictSpec:
  """SnapKV-style eviction around any registered cache (defaults: SnapKVCluster's window
  32, kernel 5, avgpool; the budget is SnapKV's max_capacity_prompt)."""

  inner: str = "dense"
  budget: int = 256
  window: int = 32
  observe: Optional[int] = None
  pool: int = 5
  ring: str = "auto"
  bytes_context: int = 0
  inner_specs: Any = None

  def __post_init__(self):
    # Imported here: the registry imports every method package, this one included.
    from kvlowrank.methods.registry import get_method  # pylint: disable=import-outside-toplevel
    if not isinstance(self.inner, str) or self.inner == "evict":
      raise ValueError(f"EvictSpec.inner must name another registered method, got "
                       f"{self.inner!r}")
    try:
      get_method(self.inner)
    except ValueError as e:
      raise ValueError(f"EvictSpec.inner: {e}") from None
    budget = _int("EvictSpec.budget", self.budget, 1)
    window = _int("EvictSpec.window", self.window, 0)
    if budget <= window:
      raise ValueError(f"EvictSpec.budget ({budget}) must be greater than EvictSpec.window "
                       f"({window}): the window is never evicted and the budget includes it")
    if self.observe is not None:
      _int("EvictSpec.observe", self.observe, 1)
    pool = _int("EvictSpec.pool", self.pool, 1)
    if pool % 2 == 0:
      raise ValueError(f"EvictSpec.pool must be odd (centred pooling), got {pool}")
    if self.ring not in RINGS:
      raise ValueError(f"EvictSpec.ring must be one of {RINGS}, got {self.ring!r}")
    _int("EvictSpec.bytes_context", self.bytes_context, 0)
    sections = {} if self.inner_specs is None else self.inner_specs
    if isinstance(sections, tuple):          # already resolved (dataclasses.replace)
      sections = dict(sections)
    if not isinstance(sections, Mapping):
      raise ValueError(f"EvictSpec.inner_specs must map method names to their knobs, got "
                       f"{type(sections).__name__}")
    built = []
    for name, section in sorted(dict(sections).items()):
      if name == "evict":
        raise ValueError("EvictSpec.inner_specs cannot hold 'evict' (no nested eviction)")
      try:
        method = get_method(name)
      except ValueError as e:
        raise ValueError(f"EvictSpec.inner_specs: {e}") from None
      built.append((name, config_lib.to_dataclass(
          {} if section is None else section, method.spec_cls,
          where=f"EvictSpec.inner_specs.{name}")))
    object.__setattr__(self, "inner_specs", tuple(built))

  @property
  def observe_queries(self) -> int:
    return self.observe if self.observe is not None else max(self.window, 1)

  @property
  def inner_spec(self):
    """The inner method's spec dataclass (its defaults when `inner_specs` has no entry)."""
    from kvlowrank.methods.registry import get_method  # pylint: disable=import-outside-toplevel
    for name, spec in self.inner_specs:
      if name == self.inner:
        return spec
    return get_method(self.inner).build_spec(None)
