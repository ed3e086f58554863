"""`run(config, workdir)`: load a model, generate one completion, report it.

The library side of `experiments/generate.py`; the ConfigDict is converted to the frozen
dataclasses below (unknown keys → ValueError) before anything is loaded or jitted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp

from kvlowrank import config_lib
from kvlowrank.generate.loop import generate
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


def run(config, workdir: Optional[str] = None) -> dict:
  """Loads `config.model`, generates a continuation of `config.prompt`, returns it.

  Args:
    config: ConfigDict of configs/generate.py (or a GenerateConfig).
    workdir: if given, the result is also written to `workdir/generation.json`.
  Returns:
    dict with the prompt, completion text, generated ids, stop reason and timings.
  Raises:
    ValueError: unknown or mistyped config keys, bad dtype or sampler settings.
  """
  cfg = config_lib.to_dataclass(config, GenerateConfig, where="config")
  sampler = sampler_from_config(cfg.sampler)
  dtype = _dtype(cfg.model.dtype, "model.dtype")
  cache_dtype = _dtype(cfg.cache_dtype, "cache_dtype")
  # Imported here: the loaders pull in gguf/tokenizers, which the jitted loop never needs.
  from kvlowrank.loaders import load_model

  t0 = time.perf_counter()
  model = load_model(cfg.model.path, dtype=dtype)
  t_load = time.perf_counter() - t0
  tok = model.require_tokenizer()
  ids = encode_prompt(tok, cfg.prompt, cfg.chat)
  t0 = time.perf_counter()
  res = generate(model.params, model.spec, [ids], max_new_tokens=cfg.max_new_tokens,
                 sampler=sampler, rng=jax.random.key(cfg.seed), cache_dtype=cache_dtype,
                 eos_ids=tok.eos_ids or model.spec.eos_ids)
  t_gen = time.perf_counter() - t0
  out = {
      "model": str(model.source), "prompt": cfg.prompt, "chat": cfg.chat,
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
