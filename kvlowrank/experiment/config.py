"""The experiment ConfigDict: defaults, dotted overrides (sweep points) and content hashes.

Layout (every configs/*.py builds on `base_config()`):

  model.path, model.dtype   what kvlowrank.loaders.load_model loads ("smollm2", a HF dir,
                            .gguf, llama2.c .bin) or "random:tiny" (kvlowrank.experiment
                            .models); parameter dtype float32|bfloat16
  method                    a registered method (kvlowrank.methods), e.g. dense | kivi
  cache_dtype               storage dtype of exact K/V (and residual windows)
  <method>                  one section per method named in the config (its knobs)
  data                      evaluation text (kvlowrank.experiment.spec.DataSpec)
  eval                      perplexity protocol (EvalSpec)
  calib                     calibration samples (kvlowrank.data.calib.CalibSpec)
  progress, write_report    presentation only: excluded from the hashes

A point's identity is the hash of its *resolved* config (presentation keys excluded), so
a sweep can tell finished points from new ones however it was interrupted.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_collections
from ml_collections import ConfigDict

from kvlowrank.resources import shared_path

PRESENTATION_KEYS = ("progress", "write_report")
# Keys added after results were recorded: at these values they are left out of the hashes,
# so the points of existing workdirs keep their keys (and are not rerun).
HASH_NEUTRAL_DEFAULTS = {("eval", "allow_beyond_max_seq_len"): False}


def load_file(config_path: str):
  """(module, arg) of a config file named "path/to/config.py" or "path/to/config.py:arg"
  (arg "" when none), its module executed. FileNotFoundError naming a missing file."""
  path, _, arg = config_path.partition(":")
  if not Path(path).is_file():
    raise FileNotFoundError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location("_kvlowrank_config_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, arg


def base_config() -> ConfigDict:
  """Defaults shared by every evaluation config (unlocked; configs add sections)."""
  c = ConfigDict()
  c.model = ConfigDict(dict(path="smollm2", dtype="float32"))
  c.method = "dense"
  c.cache_dtype = "bfloat16"
  c.dense = ConfigDict()
  # Evaluation text; dataset wikitext2|ptb, split test|validation, source auto|local|hf,
  # path: any local file (overrides the shared folder) in path_format rows|joined,
  # add_bos: BOS once at the start when the tokenizer's convention adds one,
  # max_chars: > 0 tokenizes only a prefix, joiner: between rows (GPTQ: "\n\n").
  c.data = ConfigDict(dict(dataset="wikitext2", split="test", source="auto", path="",
                           path_format="rows", add_bos=True, max_chars=0, joiner="\n\n"))
  # seq_len: window length; max_windows: 0 = all windows of the split; modes: prefill
  # and/or decode; prompt_len / prefill_chunk: decode mode's chunked prefill.
  # allow_beyond_max_seq_len: evaluate windows longer than the model's max_seq_len
  # (otherwise an error).
  # drift_tokens: > 0 measures generation drift (kvlowrank.eval.drift): greedy tokens
  # generated after each of the first drift_prompts windows' first drift_prompt_len
  # tokens (0 = prompt_len, or seq_len // 2 when that is 0).
  c.eval = ConfigDict(dict(seq_len=2048, max_windows=0, modes=("prefill", "decode"),
                           batch_size=1, prompt_len=0, prefill_chunk=0,
                           allow_beyond_max_seq_len=False,
                           drift_tokens=0, drift_prompts=2, drift_prompt_len=0))
  # Calibration samples for methods that calibrate (WikiText-2 validation: no train split
  # in ../shared; disjoint from the test split).
  c.calib = ConfigDict(dict(dataset="wikitext2", split="validation", source="auto", path="",
                            path_format="rows", n_samples=16, seq_len=512, seed=3, max_chars=0))
  c.progress = True
  c.write_report = True
  return c


def apply_smoke(c: ConfigDict) -> ConfigDict:
  """The CPU smoke variant shared by configs/*.py: stories260K (llama2.c, head dim 8)
  from ../shared on 2 windows of 256 tokens of the first 2000 characters of the split
  (its pure-Python tokenizer is slow on long texts), decode mode with a 64-token
  prompt prefilled in 32-token chunks. KIVI sections get G = 8 (head dim 8), R = 32."""
  c.model.path = str(shared_path("models", "stories260K", "stories260K.bin"))
  c.data.max_chars = 2000
  c.eval.seq_len = 256
  c.eval.max_windows = 2
  c.eval.batch_size = 2
  c.eval.prompt_len = 64
  c.eval.prefill_chunk = 32
  c.calib.max_chars = 4000
  c.calib.n_samples = 4
  c.calib.seq_len = 128
  if "kivi" in c:
    c.kivi.group_size = 8
    c.kivi.residual = 32
  return c


def _jsonable(o):
  """JSON form of what a resolved spec may hold: nested spec dataclasses (e.g. an eviction
  spec's inner method spec) as their fields, other iterables as lists."""
  if dataclasses.is_dataclass(o) and not isinstance(o, type):
    return dataclasses.asdict(o)
  return list(o)


def _canonical(config) -> dict:
  d = config.to_dict() if isinstance(config, (ConfigDict, ml_collections.FrozenConfigDict)) \
      else copy.deepcopy(dict(config))
  d = json.loads(json.dumps(d, sort_keys=True, default=_jsonable))
  for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
    if isinstance(d.get(section), dict) and d[section].get(key, default) == default:
      d[section].pop(key, None)
  return d


def config_hash(config) -> str:
  """16-hex-digit sha256 of the resolved config without the presentation keys."""
  d = {k: v for k, v in _canonical(config).items() if k not in PRESENTATION_KEYS}
  return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def calibration_hash(config) -> str:
  """Hash of what a calibration depends on: model, method, its resolved spec, calib data.

  The spec is the method's dataclass built from the section, every field included, defaults
  too: a knob added later whose default changes the calibration (PaluSpec.value_fold, which
  moved B_v out of W_o) then keys a new checkpoint instead of restoring one made before it
  (measured 2026-11-27: a workdir's older Palu checkpoint was restored silently, with the
  old folded W_o). A section the method cannot build keeps its raw form (the error comes
  from the evaluation)."""
  d = _canonical(config)
  method = d.get("method")
  section = d.get(method, {})
  try:
    from kvlowrank.methods import get_method  # pylint: disable=import-outside-toplevel
    section = _jsonable(get_method(method).build_spec(section))
  except (KeyError, ValueError, TypeError):
    pass
  sub = {"model": d.get("model"), "method": method, "section": section,
         "calib": d.get("calib")}
  return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()[:16]


def apply_overrides(config: ConfigDict, overrides: Mapping[str, Any]) -> ConfigDict:
  """A copy of `config` with dotted-key overrides applied ({"kivi.bits": 2, ...}).

  Only existing keys may be set (the copy is locked), so a typo in a sweep point is an
  error naming the key rather than a silently ignored setting.

  Args:
    config: the base ConfigDict.
    overrides: mapping from dotted key to value.
  Returns:
    a new locked ConfigDict.
  Raises:
    ValueError naming an unknown key or a value of the wrong type.
  """
  out = ConfigDict(config.to_dict())
  out.lock()
  for key, value in overrides.items():
    parts = key.split(".")
    node = out
    for i, part in enumerate(parts):
      if not isinstance(node, ConfigDict) or part not in node:
        raise ValueError(f"sweep/override key {key!r}: config has no "
                         f"{'.'.join(parts[:i + 1])!r}")
      if i < len(parts) - 1:
        node = node[part]
    try:
      node[parts[-1]] = value
    except TypeError as e:
      raise ValueError(f"sweep/override key {key!r}: {e}") from e
  return out
