"""Exact match of a greedy answer: its first word, stripped of punctuation, equals the
answer string ("74509." and " 74509 is" match 74509; "7450", "745091" and "" do not)."""

from __future__ import annotations

_PUNCT = ".,;:!?\"'()[]<>*`"


def first_word(text: str) -> str:
  """The first whitespace-delimited word of `text` without surrounding punctuation."""
  words = text.split()
  return words[0].strip(_PUNCT) if words else ""


def exact_match(generated: str, answer: str) -> float:
  """1.0 when the first word of `generated` is `answer`, else 0.0."""
  if not answer:
    raise ValueError("exact_match: the answer is empty")
  return float(first_word(generated) == answer.strip())
