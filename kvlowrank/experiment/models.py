"""Where an experiment's model comes from: kvlowrank.loaders, or a random-init model.

`model.path = "random:tiny"` builds a seeded random-init Llama with a byte-level (UTF-8)
tokenizer: no files needed, so pipeline tests (sweep resume, checkpoints) run without
../shared. Its perplexities are meaningless (near log 256); everything else is real.
Loaded models are memoised per process so that a sweep loads its model once.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from kvlowrank.loaders import LoadedModel, load_model
from kvlowrank.model.params import init_params
from kvlowrank.spec import ModelSpec

RANDOM_SPECS = {
    # GQA (2 query heads per kv head), head dim 32 so KIVI's default G = 32 applies.
    "tiny": ModelSpec(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=32, ffn_dim=128, max_seq_len=4096),
}


class ByteTokenizer:
  """UTF-8 bytes as token ids (vocab 256, no BOS/EOS): the random models' tokenizer."""

  bos_id = None
  eos_ids: tuple[int, ...] = ()
  adds_bos = False
  vocab_size = 256

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    del add_bos  # no BOS in this vocabulary
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    del skip_special
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True
                          ) -> str:
    """Plain "role: content" lines (these models have no chat format)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


@functools.lru_cache(maxsize=2)
def load(path: str, dtype: str = "float32") -> LoadedModel:
  """The model named by `config.model` (memoised).

  Args:
    path: anything kvlowrank.loaders.load_model accepts, or "random:<preset>" (presets:
      RANDOM_SPECS; seed 0, init scale 0.3 so attention is far from uniform).
    dtype: "float32" | "bfloat16" parameter dtype.
  Returns:
    LoadedModel.
  """
  jdtype = jnp.dtype(dtype)
  if path.startswith("random:"):
    name = path.split(":", 1)[1]
    if name not in RANDOM_SPECS:
      raise ValueError(f"config.model.path {path!r}: unknown random preset; known: "
                       f"{', '.join('random:' + k for k in sorted(RANDOM_SPECS))}")
    spec = RANDOM_SPECS[name]
    params = init_params(spec, jax.random.key(0), dtype=jdtype, scale=0.3)
    return LoadedModel(spec=spec, params=params, tokenizer=ByteTokenizer(), source=path)
  return load_model(path, jdtype, progress=True)  # a per-layer bar on stderr
