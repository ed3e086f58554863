"""A `tokenizers.Tokenizer` (HF tokenizer.json or rebuilt from GGUF metadata) behind the
kvlowrank Tokenizer interface (kvlowrank.loaders.types.Tokenizer)."""

from __future__ import annotations

from typing import Optional, Sequence

import tokenizers

from kvlowrank.loaders.chat_template import render_chat_template


class BPETokenizer:
  """Wraps a `tokenizers.Tokenizer`; BOS is added here, never by its post-processor."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: Optional[int],
               eos_ids: Sequence[int], adds_bos: bool, chat_template: Optional[str],
               source: str):
    """
    Args:
      backend: the `tokenizers` pipeline (normalizer, pre-tokenizer, model, decoder).
      bos_id: BOS token id (None: the model has none).
      eos_ids: ids that end generation.
      adds_bos: whether the model's tokenizer prepends BOS when encoding text.
      chat_template: Jinja chat template, or None.
      source: checkpoint path, for error messages.
    """
    self.backend = backend
    self.bos_id = bos_id
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.adds_bos = bool(adds_bos and bos_id is not None)
    self.chat_template = chat_template
    self.source = source
    self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

  def _token(self, i: Optional[int]) -> Optional[str]:
    return None if i is None else self.backend.id_to_token(i)

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text`; BOS first when `add_bos` and the model prepends one."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] + ids) if (add_bos and self.adds_bos) else ids

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    """Text of `ids` (special tokens kept unless `skip_special`)."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True
                          ) -> str:
    """Chat prompt string (see kvlowrank.loaders.chat_template.render_chat_template)."""
    eos = self._token(self.eos_ids[0]) if self.eos_ids else None
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=self._token(self.bos_id), eos_token=eos,
                                source=self.source)
