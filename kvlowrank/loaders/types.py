"""What a loader returns: the model spec, its parameters, its tokenizer and where it came from."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from kvlowrank.spec import ModelSpec


@runtime_checkable
class Tokenizer(Protocol):
  """Text <-> token ids, shared by every loader.

  `encode(text, add_bos=True)` prepends `bos_id` only when the model's own
  tokenizer does so by convention (`adds_bos`: llama2.c and Llama always, SmolLM2
  never); `add_bos=False` never prepends it. BPE tokenizers (HF, GGUF) match
  special-token strings written in the text (e.g. "<|im_start|>") whole; llama2.c's
  tokenizer, like llama2.c, does not. `decode(..., skip_special=True)` drops them.
  """

  bos_id: Optional[int]
  eos_ids: tuple[int, ...]
  adds_bos: bool
  vocab_size: int

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ...

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    ...

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True
                          ) -> str:
    ...


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A loaded checkpoint.

  Attributes:
    spec: static architecture (parameters in the HF half-rotation RoPE layout).
    params: parameter pytree (see kvlowrank.model.params), fp32 or bf16.
    tokenizer: the checkpoint's tokenizer, or None when the checkpoint ships none
      (a HF directory without tokenizer.json, a llama2.c .bin without tokenizer.bin).
    source: the resolved path of the checkpoint file or directory.
  """

  spec: ModelSpec
  params: Any
  tokenizer: Optional[Tokenizer]
  source: str

  def require_tokenizer(self) -> Tokenizer:
    """The tokenizer, or a FileNotFoundError naming the checkpoint that lacks one."""
    if self.tokenizer is None:
      raise FileNotFoundError(f"{self.source}: this checkpoint has no tokenizer (HF: "
                              "tokenizer.json; llama2.c: tokenizer.bin / tok<V>.bin beside it "
                              "or load_model(..., tokenizer=path))")
    return self.tokenizer
