"""Needle in a haystack: a one-sentence fact at depth d of WikiText-2 text.

The haystack is WikiText-2 raw test text (the shared folder's wiki.test.raw, or any
source kvlowrank.data.text reads), cut from a seeded sentence start; the needle and
question follow RULER's single-needle task (niah_single, word key -> 7-digit value):

    Some special magic numbers are hidden within the following text. Make sure to
    memorize it. I will quiz you about the numbers afterwards.\\n
    <WikiText ...> One of the special magic numbers for {key} is: {value}. <... WikiText>\\n
    What is the special magic number for {key} mentioned in the provided text? The
    special magic number for {key} mentioned in the provided text is <- greedy answer

RULER draws its keys with `wonderwords`; a fixed word list stands in here. The needle
goes after the last sentence or line end (a token ending in "." or a newline) at or
before depth * n_fill, as gkamradt's needle-in-a-haystack snaps back to a period
(WikiText's headings and blank lines have none, hence line ends too). Scoring: exact match of the answer's first word
(kvlowrank.eval.exact_match).
"""

from __future__ import annotations

import functools

import numpy as np

from kvlowrank.data import text as text_lib
from kvlowrank.eval import haystack

TASK = "needle"
PREFIX = ("Some special magic numbers are hidden within the following text. Make sure to "
          "memorize it. I will quiz you about the numbers afterwards.\n")
NEEDLE = " One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")
KEYS = ("amber", "harbor", "lantern", "meadow", "copper", "falcon", "orchid", "glacier",
        "velvet", "compass", "thunder", "marble", "saffron", "willow", "beacon", "canyon",
        "ember", "juniper", "quartz", "riddle", "summit", "tundra", "walnut", "zephyr")


def _ends_sentence(piece: str) -> bool:
  return piece.endswith("\n") or piece.rstrip().endswith(".")


@functools.lru_cache(maxsize=4)
def filler_ids(tokenizer, max_chars: int, dataset: str = "wikitext2", split: str = "test",
               path: str = "") -> tuple[np.ndarray, np.ndarray]:
  """(ids of the first max_chars characters of the split, sorted indices i such that
  ids[i - 1] ends a sentence or a line: where a needle or the haystack may start)."""
  txt, _ = text_lib.load_text(dataset, split, path=path)
  ids = text_lib.tokenize(tokenizer, txt, add_bos=False, max_chars=max_chars)
  ends = {int(t) for t in np.unique(ids) if _ends_sentence(tokenizer.decode([int(t)]))}
  starts = np.array([i + 1 for i, t in enumerate(ids) if int(t) in ends], np.int64)
  return ids, starts


def sample(tokenizer, *, context: int, depth: float, index: int = 0, seed: int = 0,
           filler_chars: int = 200_000, data_path: str = "", max_new_tokens: int = 12
           ) -> haystack.RetrievalSample:
  """One needle prompt of exactly `context - max_new_tokens` tokens.

  Args:
    tokenizer: a kvlowrank tokenizer.
    context: prompt + greedy answer budget in tokens.
    depth: needle position in [0, 1] of the filler.
    index, seed: which sample (key, value and haystack offset come from rng_for).
    filler_chars: characters of WikiText-2 test tokenized as the haystack pool.
    data_path: a local WikiText-2 raw test file instead of the shared one ("" = shared).
    max_new_tokens: greedy budget; the prompt gets context - max_new_tokens tokens.
  Returns:
    RetrievalSample.
  """
  rng = haystack.rng_for(seed, TASK, context, depth, index)
  key = KEYS[int(rng.integers(len(KEYS)))]
  value = str(int(rng.integers(1_000_000, 10_000_000)))
  prefix = tokenizer.encode(PREFIX, add_bos=True)
  needle = tokenizer.encode(NEEDLE.format(key=key, value=value), add_bos=False)
  question = tokenizer.encode(QUESTION.format(key=key), add_bos=False)
  max_new = haystack.answer_budget(tokenizer, " " + value, max_new_tokens, TASK)
  n_prompt = context - max_new
  n_fill = max(0, n_prompt - len(prefix) - len(needle) - len(question))
  ids, starts = filler_ids(tokenizer, filler_chars, path=data_path)
  offsets = starts[starts + n_fill <= len(ids)]
  what = f"needle context={context}"
  if not len(offsets):
    raise ValueError(f"{what}: {len(ids)} filler tokens from {filler_chars} characters "
                     f"of WikiText-2 cannot hold {n_fill}; raise filler_chars")
  off = int(offsets[int(rng.integers(len(offsets)))])
  allowed = (starts[(starts >= off) & (starts <= off + n_fill)] - off).tolist()
  tokens, start, hay, n_fill = haystack.assemble(
      prefix, ids[off:off + n_fill].tolist(), needle, question, n_prompt=n_prompt,
      depth=depth, allowed=allowed, what=what)
  return haystack.RetrievalSample(
      task=TASK, context=context, depth=depth, index=index, tokens=tuple(tokens),
      answer=value, needle_start=start, needle_len=len(needle), haystack_start=hay,
      n_fill=n_fill, max_new_tokens=max_new)
