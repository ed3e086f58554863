"""A retrieval prompt of an exact token length with a needle at a stated depth.

Passkey retrieval and needle-in-a-haystack (kvlowrank.eval.passkey / .needle) build
their prompts the same way, at the token level so that lengths and positions are exact:

    tokens = prefix + filler[:i] + needle + filler[i:n_fill] + question

`n_fill = n_prompt - len(prefix) - len(needle) - len(question)` filler tokens surround the
needle; the needle starts after `i` of them, where `i` is the last allowed insertion
point (a line or sentence boundary of the filler, see `boundaries`) at or before
`round(depth * n_fill)`: depth 0 puts the needle right after the prefix, depth 1 right
before the question (the way gkamradt's needle-in-a-haystack snaps the insertion back
to the previous sentence end). Each segment is tokenized on its own and the ids are
concatenated, so the needle's ids in the prompt are exactly its own tokenization.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RetrievalSample:
  """One prompt and the answer its greedy continuation must start with.

  tokens: prompt ids (BOS included when the tokenizer adds one), len = n_prompt.
  needle_start, needle_len: the needle's ids are tokens[needle_start:+needle_len].
  haystack_start, n_fill: the filler+needle region starts at haystack_start and holds
    n_fill filler tokens; depth_actual = (needle_start - haystack_start) / n_fill.
  max_new_tokens: greedy budget (prompt + budget = context).
  """

  task: str
  context: int
  depth: float
  index: int
  tokens: tuple[int, ...]
  answer: str
  needle_start: int
  needle_len: int
  haystack_start: int
  n_fill: int
  max_new_tokens: int

  @property
  def depth_actual(self) -> float:
    return (self.needle_start - self.haystack_start) / max(1, self.n_fill)


def insertion_point(depth: float, n_fill: int, allowed: Sequence[int]) -> int:
  """The last allowed filler index <= round(depth * n_fill) (0 is always allowed)."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  target = int(round(depth * n_fill))
  ok = [a for a in allowed if 0 <= a <= target]
  return max(ok) if ok else 0


def assemble(prefix: Sequence[int], filler: Sequence[int], needle: Sequence[int],
             question: Sequence[int], *, n_prompt: int, depth: float,
             allowed: Sequence[int], what: str) -> tuple[list[int], int, int, int]:
  """The prompt ids and where the needle went.

  Args:
    prefix, needle, question: token ids of the fixed segments.
    filler: a filler id stream with at least n_fill ids (only its first n_fill are used).
    n_prompt: the prompt length to produce exactly.
    depth: requested needle depth in [0, 1] of the filler.
    allowed: filler indices where the needle may go (line/sentence starts).
    what: names the task in errors.
  Returns:
    (tokens, needle_start, haystack_start, n_fill).
  Raises:
    ValueError when n_prompt cannot hold the fixed segments or the filler is too short.
  """
  n_fill = n_prompt - len(prefix) - len(needle) - len(question)
  if n_fill < 0:
    raise ValueError(f"{what}: context of {n_prompt} prompt tokens cannot hold the "
                     f"{n_prompt - n_fill} tokens of its instructions, needle and question")
  if len(filler) < n_fill:
    raise ValueError(f"{what}: the filler has {len(filler)} tokens, fewer than the "
                     f"{n_fill} needed (raise the filler text size)")
  i = insertion_point(depth, n_fill, allowed)
  fill = list(filler[:n_fill])
  tokens = list(prefix) + fill[:i] + list(needle) + fill[i:] + list(question)
  assert len(tokens) == n_prompt, (len(tokens), n_prompt)
  return tokens, len(prefix) + i, len(prefix), n_fill


def answer_budget(tokenizer, answer: str, max_new_tokens: int, what: str) -> int:
  """max_new_tokens, checked to leave room for the answer's tokens and one more."""
  n = len(tokenizer.encode(answer, add_bos=False))
  if max_new_tokens <= n:
    raise ValueError(f"{what}: max_new_tokens={max_new_tokens} must exceed the answer's "
                     f"{n} tokens")
  return max_new_tokens


def rng_for(seed: int, task: str, context: int, depth: float, index: int
            ) -> np.random.Generator:
  """A generator seeded by (seed, task, context, depth, index): every sample is
  reproducible on its own, whatever else a run generates."""
  key = [seed, zlib.crc32(task.encode()), context, int(round(depth * 1000)), index]
  return np.random.default_rng(key)
