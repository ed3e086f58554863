"""Byte-level BPE tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

Builds the same `tokenizers` pipeline HF transformers builds from a GGUF file
(integrations/gguf/gguf_tokenizer_mapping.py): BPE over the file's vocabulary and
merges, GPT-2 byte-level pre-tokenizer and decoder (or a model-specific split regex
for the `tokenizer.ggml.pre` types listed below), control tokens (token_type 3)
as special added tokens and user-defined tokens (type 4) as plain added tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from kvlowrank.loaders.bpe_tokenizer import BPETokenizer

CONTROL, USER_DEFINED = 3, 4

# Split regexes of the llama.cpp pre-tokenizer types HF maps to a custom split; every
# other type (e.g. SmolLM2's "smollm") uses the plain GPT-2 byte-level regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character map."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, (chr(c) for c in cs)))


def build_gpt2_tokenizer(meta: Mapping[str, Any], source: str) -> BPETokenizer:
  """BPETokenizer from GGUF `tokenizer.*` metadata (already decoded to python values).

  Args:
    meta: GGUF key -> value for the tokenizer.* keys.
    source: the GGUF path, for error messages.
  Returns:
    The tokenizer.
  """
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' "
                     "byte-level BPE)")
  tokens = meta.get("tokenizer.ggml.tokens")
  merges = meta.get("tokenizer.ggml.merges")
  if not tokens:
    raise ValueError(f"{source}: missing GGUF field 'tokenizer.ggml.tokens'")
  if merges is None:
    raise ValueError(f"{source}: missing GGUF field 'tokenizer.ggml.merges'")
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  # Tokens are stored in the byte-level alphabet already; respell any that are not
  # (as HF does) so they stay reachable.
  vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
           for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    parts = m.split(" ")
    if len(parts) != 2:
      raise ValueError(f"{source}: malformed merge {m!r} in 'tokenizer.ggml.merges'")
    pairs.append(tuple(parts))
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type") or ()
  # A control token written outside the byte alphabet is a llama.cpp mislabel (HF skips it).
  control = [AddedToken(t, normalized=False, special=True)
             for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
  if control:
    backend.add_special_tokens(control)
  user = [AddedToken(t, normalized=False, special=False)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
  if user:
    backend.add_tokens(user)
  bos = meta.get("tokenizer.ggml.bos_token_id")
  eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
         if meta.get(k) is not None]
  for name, i in [("bos_token_id", bos)] + [("eos_token_id", e) for e in eos]:
    if i is not None and not 0 <= int(i) < len(tokens):
      raise ValueError(f"{source}: tokenizer.ggml.{name} {i} outside the vocabulary")
  return BPETokenizer(backend, bos_id=None if bos is None else int(bos),
                      eos_ids=tuple(dict.fromkeys(int(e) for e in eos)),
                      adds_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                      chat_template=meta.get("tokenizer.chat_template"), source=source)
