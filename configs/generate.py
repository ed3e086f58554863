r"""Greedy (or sampled) continuation of one prompt with any registered KV-cache method.

Command (the embedded SmolLM2-135M-Instruct GGUF, CPU OK):

  python experiments/generate.py --config=configs/generate.py

Expected (greedy, fp32, CPU; measured): 'The capital of France is' ->
  " Paris.\n\nThe answer is: 2018-01-22 12:12:53." (29 tokens, stops at EOS).
`:chat` with --config.prompt="What is the capital of France?" gives
"The capital of France is Paris."; `:smoke` (stories260K) gives
", there was a little girl named Lily. She loved to play outside in the park. ..."

Structural args after `:` (kvlowrank.config_lib.parse_arg), scalars via --config.x:

  python experiments/generate.py --config=configs/generate.py:smoke   # stories260K
  python experiments/generate.py --config=configs/generate.py:chat \
      --config.prompt="What is the capital of France?" --config.max_new_tokens=48
  python experiments/generate.py --config=configs/generate.py \
      --config.sampler.name=top_p --config.sampler.top_p=0.9 --config.seed=1
  python experiments/generate.py --config=configs/generate.py:method=palu
  python experiments/generate.py --config=configs/generate.py:method=kivi \
      --config.kivi.bits=2 --config.kivi.residual=0 --config.max_new_tokens=64

`method=` is any registered method (dense, kivi, palu, xquant, xquant_cl, ...); its knobs
(`config.<method>`) and the calibration data (`config.calib`) are those of
configs/main.py (its smoke variant with `smoke`), applied through kvlowrank.compress. A
calibrating method (palu) calibrates once and caches the result (orbax) in
<workdir>/calib/, else in ~/.cache/kvlowrank (or $KVLOWRANK_CACHE).
"""

import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from kvlowrank.config_lib import parse_arg
from kvlowrank.resources import shared_path


def get_config(arg=None):
  """Args (comma-separated k=v): model (loader path or name), chat (bool), smoke (bool:
  the tiny stories260K model from ../shared with a TinyStories prompt), method (a
  registered KV-cache method)."""
  arg = parse_arg(arg, model="smollm2", chat=False, smoke=False, method="dense")
  config = ConfigDict()
  # Anything kvlowrank.loaders.load_model accepts: "smollm2", an HF dir, .gguf, llama2.c .bin.
  config.model = ConfigDict(dict(path=arg.model, dtype="float32"))
  # The KV-cache method and its knobs (those of configs/main.py), calibration data.
  config.method = arg.method
  if arg.method != "dense":
    main = _main_config("smoke" if arg.smoke else None)
    if arg.method not in main:
      raise ValueError(f"config arg method={arg.method!r}: configs/main.py has no section for "
                       "it; known: " + ", ".join(k for k in main if isinstance(main[k],
                                                                            ConfigDict)
                                                 and k not in _NOT_METHODS))
    config[arg.method] = main[arg.method]
    config.calib = main.calib
  config.prompt = "The capital of France is"
  if arg.smoke:
    config.model.path = str(shared_path("models", "stories260K", "stories260K.bin"))
    config.prompt = "Once upon a time"
  # Wrap the prompt as one user turn of the tokenizer's chat template.
  config.chat = arg.chat
  # name: greedy | temperature | top_k | top_p; the other fields feed those samplers.
  config.sampler = ConfigDict(dict(name="greedy", temperature=1.0, top_k=50, top_p=0.9))
  config.max_new_tokens = 32
  # PRNG seed of the stochastic samplers.
  config.seed = 0
  # Storage dtype of the dense KV cache.
  config.cache_dtype = "float32"
  return config


_NOT_METHODS = ("model", "data", "eval", "calib", "dense")


def _main_config(arg):
  """configs/main.py's config: its method sections are the knobs used here."""
  spec = importlib.util.spec_from_file_location("_kvlowrank_main_config",
                                                Path(__file__).with_name("main.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
