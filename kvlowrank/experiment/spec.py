"""Typed boundary of an evaluation config: ConfigDict -> frozen dataclasses, all validated
before any model is loaded (every error names the bad config field)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvlowrank import config_lib
from kvlowrank.data.calib import CalibSpec
from kvlowrank.data.text import CORPORA, SOURCES
from kvlowrank.eval.perplexity import MODES
from kvlowrank.methods import get_method, methods

_DTYPES = ("float32", "bfloat16", "float16")
_TOP_LEVEL = ("model", "method", "cache_dtype", "data", "eval", "calib", "progress",
              "write_report")


@dataclasses.dataclass(frozen=True)
class ModelSource:
  path: str = "smollm2"
  dtype: str = "float32"

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"config.model.dtype must be float32|bfloat16, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class DataSpec:
  dataset: str = "wikitext2"
  split: str = "test"
  source: str = "auto"
  path: str = ""
  path_format: str = "rows"
  add_bos: bool = True
  max_chars: int = 0
  joiner: str = "\n\n"

  def __post_init__(self):
    if (self.dataset, self.split) not in CORPORA:
      raise ValueError(f"config.data.dataset/split {self.dataset!r}/{self.split!r} unknown; "
                       f"known: {', '.join('/'.join(k) for k in sorted(CORPORA))}")
    if self.source not in SOURCES:
      raise ValueError(f"config.data.source must be one of {SOURCES}, got {self.source!r}")
    if self.max_chars < 0:
      raise ValueError(f"config.data.max_chars must be >= 0, got {self.max_chars}")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  seq_len: int = 2048
  max_windows: int = 0
  modes: tuple = ("prefill", "decode")
  batch_size: int = 1
  prompt_len: int = 0
  prefill_chunk: int = 0
  drift_tokens: int = 0
  drift_prompts: int = 2
  drift_prompt_len: int = 0

  def __post_init__(self):
    if self.seq_len < 2:
      raise ValueError(f"config.eval.seq_len must be >= 2, got {self.seq_len}")
    for name in ("max_windows", "prompt_len", "prefill_chunk", "drift_tokens",
                 "drift_prompt_len"):
      if getattr(self, name) < 0:
        raise ValueError(f"config.eval.{name} must be >= 0, got {getattr(self, name)}")
    if self.batch_size <= 0:
      raise ValueError(f"config.eval.batch_size must be positive, got {self.batch_size}")
    modes = tuple(self.modes)
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(MODES):
      raise ValueError(f"config.eval.modes must be distinct entries of {MODES}, got "
                       f"{self.modes!r}")
    object.__setattr__(self, "modes", modes)
    if self.drift_tokens and self.drift_prompts < 1:
      raise ValueError(f"config.eval.drift_prompts must be >= 1, got {self.drift_prompts}")
    if self.drift_tokens and not 1 <= self.drift_prompt_length <= self.seq_len:
      raise ValueError(f"config.eval.drift_prompt_len must be in [1, eval.seq_len="
                       f"{self.seq_len}], got {self.drift_prompt_len}")

  @property
  def drift_prompt_length(self) -> int:
    """Tokens per drift prompt: drift_prompt_len, else prompt_len, else seq_len // 2."""
    return self.drift_prompt_len or self.prompt_len or self.seq_len // 2


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything an evaluation run needs, typed and validated."""

  model: ModelSource
  method: str
  method_spec: Any
  cache_dtype: str
  data: DataSpec
  eval: EvalSpec
  calib: CalibSpec

  @property
  def jnp_cache_dtype(self):
    return jnp.dtype(self.cache_dtype)


def from_config(config, model_spec=None) -> Experiment:
  """Converts and validates an evaluation ConfigDict (see kvlowrank.experiment.config).

  Args:
    config: the ConfigDict.
    model_spec: optional ModelSpec; when given, method checks that need the model run
      too (e.g. KIVI group size vs head dim).
  Returns:
    Experiment.
  Raises:
    ValueError naming the first bad or unknown field.
  """
  known = set(_TOP_LEVEL) | set(methods())
  unknown = sorted(set(config.keys()) - known)
  if unknown:
    raise ValueError(f"unknown config key(s) {', '.join(map(repr, unknown))}; known: "
                     f"{', '.join(sorted(known))}")
  method = get_method(config.method)
  if config.cache_dtype not in _DTYPES:
    raise ValueError(f"config.cache_dtype must be one of {_DTYPES}, got {config.cache_dtype!r}")
  section = config.get(config.method)
  return Experiment(
      model=config_lib.to_dataclass(config.model, ModelSource, where="config.model"),
      method=config.method,
      method_spec=method.build_spec(section, model_spec),
      cache_dtype=config.cache_dtype,
      data=config_lib.to_dataclass(config.data, DataSpec, where="config.data"),
      eval=config_lib.to_dataclass(config.eval, EvalSpec, where="config.eval"),
      calib=config_lib.to_dataclass(config.calib, CalibSpec, where="config.calib"))
