"""`kvlowrank.load(name_or_path)`: a model and its tokenizer, with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import jax.numpy as jnp

from kvlowrank.loaders import LoadedModel, load_model


def load(model: Union[str, Path, LoadedModel] = "smollm2", dtype: str = "float32", *,
         progress: bool = True) -> LoadedModel:
  """Loads a model (a LoadedModel is returned as is).

  Args:
    model: "smollm2" (the embedded SmolLM2-135M-Instruct), a HF checkpoint directory, a
      .gguf file, a llama2.c .bin (kvlowrank.loaders.load_model), or "random:tiny" (a
      seeded random model with a byte tokenizer, kvlowrank.experiment.models).
    dtype: parameter dtype, "float32" or "bfloat16".
    progress: show a per-layer bar while reading the checkpoint.
  Returns:
    LoadedModel(spec, params, tokenizer, source).
  Raises:
    FileNotFoundError / ValueError naming the bad path or dtype.
  """
  if isinstance(model, LoadedModel):
    return model
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"load dtype must be 'float32' or 'bfloat16', got {dtype!r}")
  if isinstance(model, str) and model.startswith("random:"):
    from kvlowrank.experiment import models  # pylint: disable=import-outside-toplevel
    return models.load(model, dtype)
  return load_model(model, jnp.dtype(dtype), progress=progress)
