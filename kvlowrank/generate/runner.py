"""`run(config, workdir)`: load a model, generate one completion, report it.

The library side of `experiments/generate.py`; the ConfigDict is converted to the frozen
dataclasses below (unknown keys → ValueError) before anything is loaded or jitted. The
KV cache is any registered method (`config.method`, its knobs in `config.<method>`,
calibration data in `config.calib`), applied through the one-call API
(kvlowrank.compress), which validates the knobs before loading and calibrates (cached)
when the method needs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import jax.numpy as jnp

from kvlowrank import config_lib
from kvlowrank.generate.sampling import SamplerConfig, sampler_from_config

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """`model` section: what `kvlowrank.loaders.load_model` loads, and at which dtype."""

  path: str = "smollm2"
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """The whole configs/generate.py config."""

  model: ModelConfig = ModelConfig()
  method: str = "dense"
  prompt: str = "The capital of France is"
  chat: bool = False
  sampler: SamplerConfig = SamplerConfig()
  max_new_tokens: int = 32
  seed: int = 0
  cache_dtype: str = "float32"


def _dtype(name: str, field: str):
  if name not in _DTYPES:
    raise ValueError(f"{field} must be one of {', '.join(_DTYPES)}, got {name!r}")
  return _DTYPES[name]


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
  """Token ids of `prompt`; with `chat`, wrapped as one user turn of the model's chat
  template (which writes its own special tokens, so no extra BOS is added). Without
  `chat`, BOS is prepended when the model's tokenizer does so by convention."""
  if chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_bos=False))
  return list(tokenizer.encode(prompt, add_bos=True))


def run(config, workdir: Optional[str] = None, *, progress: bool = True) -> dict:
  """Loads `config.model`, generates a continuation of `config.prompt`, returns it.

  Args:
    config: ConfigDict of configs/generate.py (or a GenerateConfig).
    workdir: if given, the result is also written to `workdir/generation.json` (and a
      calibration is cached in workdir/calib/; default: kvlowrank.api default_cache_dir).
    progress: progress bars (loading, calibration, generation) and the exact-window note.
  Returns:
    dict with the prompt, completion text, generated ids, stop reason and timings.
  Raises:
    ValueError: unknown or mistyped config keys, bad dtype or sampler settings.
  """
  if dataclasses.is_dataclass(config):
    d = dataclasses.asdict(config)
  else:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  # The method's knobs and the calibration section go to kvlowrank.compress.
  name = d.get("method", "dense")
  section, calib = d.pop(name, None) or {}, d.pop("calib", None)
  cfg = config_lib.to_dataclass(d, GenerateConfig, where="config")
  sampler = sampler_from_config(cfg.sampler)
  _dtype(cfg.model.dtype, "model.dtype")
  _dtype(cfg.cache_dtype, "cache_dtype")
  # Imported here: the loaders pull in gguf/tokenizers, which the jitted loop never needs.
  from kvlowrank.api import compress, load  # pylint: disable=import-outside-toplevel
  from kvlowrank.methods import get_method  # pylint: disable=import-outside-toplevel
  get_method(cfg.method).build_spec(section)  # bad knobs: an error before loading

  t0 = time.perf_counter()
  model = load(cfg.model.path, cfg.model.dtype, progress=progress)
  t_load = time.perf_counter() - t0
  cm = compress(model, cfg.method, calib=calib, cache_dtype=cfg.cache_dtype,
                cache_dir=workdir, progress=progress, **section)
  tok = model.require_tokenizer()
  ids = encode_prompt(tok, cfg.prompt, cfg.chat)
  t0 = time.perf_counter()
  res = cm.generate_tokens([ids], cfg.max_new_tokens, sampler=sampler, seed=cfg.seed,
                           progress=progress)
  t_gen = time.perf_counter() - t0
  out = {
      "model": str(model.source), "method": cm.method, "bits": cm.bits,
      "method_spec": dataclasses.asdict(cm.spec), "prompt": cfg.prompt, "chat": cfg.chat,
      "prompt_ids": ids, "completion": tok.decode(list(res.tokens[0])),
      "completion_ids": list(res.tokens[0]), "stop_reason": res.stop_reasons[0],
      "sampler": repr(sampler), "load_s": round(t_load, 3),
      "generate_s": round(t_gen, 3),
  }
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "generation.json"), "w") as f:
      json.dump(out, f, indent=1)
  return out
