"""Passkey retrieval: a 5-digit pass key hidden in repeated filler lines (KIVI's task).

The format is KIVI's `passkey_examples.jsonl` + `long_context_example.py` (itself
landmark-attention's generator, with newlines between lines):

    There is an important info hidden inside a lot of irrelevant text. Find it and
    memorize it. I will quiz you about the important information there.\\n
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\\n
    ... (the filler line repeated) ...
    The pass key is 74509. Remember it. 74509 is the pass key.\\n
    ... (the filler line repeated) ...
    What is the pass key? The pass key is <- greedy answer continues here

KIVI appends the question directly to the input, whose last filler line has no newline;
here the filler is whole lines (each with its newline) cut to the exact token budget,
so the text before the question is a line, possibly cut short. The key line goes at a
line start (kvlowrank.eval.haystack); KIVI generates len(target) tokens, we generate the
answer's token count + 2 and score the first word (kvlowrank.eval.exact_match).
"""

from __future__ import annotations

from kvlowrank.eval import haystack

TASK = "passkey"
PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about the important information there.\n")
FILLER_LINE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
               "There and back again.\n")
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is "


def sample(tokenizer, *, context: int, depth: float, index: int = 0, seed: int = 0,
           max_new_tokens: int = 12) -> haystack.RetrievalSample:
  """One passkey prompt of exactly `context - max_new_tokens` tokens.

  Args:
    tokenizer: a kvlowrank tokenizer (encode(text, add_bos), decode).
    context: total tokens of prompt + greedy answer budget (the model's window use).
    depth: key line position in [0, 1] of the filler.
    index, seed: which sample; the key is drawn from rng_for(seed, "passkey", ...).
    max_new_tokens: greedy budget; the prompt gets context - max_new_tokens tokens.
  Returns:
    RetrievalSample.
  """
  rng = haystack.rng_for(seed, TASK, context, depth, index)
  key = str(int(rng.integers(10000, 100000)))
  prefix = tokenizer.encode(PREFIX, add_bos=True)
  line = tokenizer.encode(FILLER_LINE, add_bos=False)
  needle = tokenizer.encode(KEY_LINE.format(key=key), add_bos=False)
  question = tokenizer.encode(QUESTION, add_bos=False)
  max_new = haystack.answer_budget(tokenizer, key, max_new_tokens, TASK)
  n_prompt = context - max_new
  n_lines = max(1, n_prompt // max(1, len(line)) + 1)
  tokens, start, hay, n_fill = haystack.assemble(
      prefix, line * n_lines, needle, question, n_prompt=n_prompt, depth=depth,
      allowed=range(0, n_prompt + 1, len(line)), what=f"passkey context={context}")
  return haystack.RetrievalSample(
      task=TASK, context=context, depth=depth, index=index, tokens=tuple(tokens),
      answer=key, needle_start=start, needle_len=len(needle), haystack_start=hay,
      n_fill=n_fill, max_new_tokens=max_new)
