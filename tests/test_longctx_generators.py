"""Passkey / needle generators (exact length, needle at the stated depth), the exact-match
scorer and the LongBench / RULER metrics, on the byte-level tokenizer (fast, exact)."""

import numpy as np
import pytest

from kvlowrank.eval import exact_match as em
from kvlowrank.eval import haystack, hf_tasks, needle, passkey
from kvlowrank.experiment.models import ByteTokenizer

from kvlowrank.resources import shared_dir

# WikiText-2 filler / stories260K live in ../shared (absent: skipped, as the other tests).
NEEDS_SHARED = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")

TOK = ByteTokenizer()
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _expected_insertion(depth, n_fill, allowed):
  """Independent reference: the last allowed index <= depth * n_fill, by brute force."""
  target = int(np.floor(depth * n_fill + 0.5))
  return max([0] + [a for a in allowed if a <= target])


def _filler_of(s):
  """The prompt's filler tokens (the haystack without the needle)."""
  t = list(s.tokens)
  hay_end = s.haystack_start + s.n_fill + s.needle_len
  return t[s.haystack_start:s.needle_start] + t[s.needle_start + s.needle_len:hay_end]


@pytest.mark.parametrize("context", [700, 1500])
@pytest.mark.parametrize("depth", DEPTHS)
def test_passkey_length_and_depth(context, depth):
  s = passkey.sample(TOK, context=context, depth=depth, index=1, seed=7)
  assert len(s.tokens) == context - s.max_new_tokens
  key_line = TOK.encode(passkey.KEY_LINE.format(key=s.answer))
  assert list(s.tokens[s.needle_start:s.needle_start + s.needle_len]) == key_line
  text = TOK.decode(list(s.tokens))
  assert text.startswith(passkey.PREFIX) and text.endswith(passkey.QUESTION)
  assert text.count(f"The pass key is {s.answer}.") == 1
  # Line starts of the filler (a repeated line): the needle sits on the last one before
  # depth * n_fill.
  line = len(TOK.encode(passkey.FILLER_LINE))
  allowed = range(0, s.n_fill + 1, line)
  offset = s.needle_start - s.haystack_start
  assert offset == _expected_insertion(depth, s.n_fill, allowed)
  assert abs(s.depth_actual - depth) <= line / s.n_fill
  assert len(s.answer) == 5 and s.answer.isdigit()


def test_passkey_position_negative_control():
  """A sample built for depth 0.25 fails the depth-0.75 position check."""
  s = passkey.sample(TOK, context=1500, depth=0.25)
  line = len(TOK.encode(passkey.FILLER_LINE))
  offset = s.needle_start - s.haystack_start
  assert offset != _expected_insertion(0.75, s.n_fill, range(0, s.n_fill + 1, line))
  assert abs(s.depth_actual - 0.75) > line / s.n_fill


@NEEDS_SHARED
@pytest.mark.parametrize("depth", DEPTHS)
def test_needle_length_and_depth(depth):
  s = needle.sample(TOK, context=3000, depth=depth, index=2, seed=1, filler_chars=60000)
  assert len(s.tokens) == 3000 - s.max_new_tokens
  key = [k for k in needle.KEYS if f"for {k} is: {s.answer}." in TOK.decode(list(s.tokens))]
  assert len(key) == 1
  want = TOK.encode(needle.NEEDLE.format(key=key[0], value=s.answer))
  assert list(s.tokens[s.needle_start:s.needle_start + s.needle_len]) == want
  text = TOK.decode(list(s.tokens))
  assert text.startswith(needle.PREFIX)
  assert text.endswith(needle.QUESTION.format(key=key[0]))
  # Sentence / line ends of the filler (bytes "." and "\n"): the needle follows the last
  # one at or before depth * n_fill.
  filler = _filler_of(s)
  assert len(filler) == s.n_fill
  allowed = [i for i in range(1, s.n_fill + 1) if filler[i - 1] in (ord("."), ord("\n"))]
  offset = s.needle_start - s.haystack_start
  assert offset == _expected_insertion(depth, s.n_fill, allowed)
  gap = max(np.diff([0] + allowed + [s.n_fill]))
  assert abs(s.depth_actual - depth) <= gap / s.n_fill
  assert abs(s.depth_actual - depth) < 0.1  # sentences are short vs 3000 bytes


@NEEDS_SHARED
def test_generators_are_seeded():
  a = needle.sample(TOK, context=900, depth=0.5, index=3, seed=5, filler_chars=30000)
  b = needle.sample(TOK, context=900, depth=0.5, index=3, seed=5, filler_chars=30000)
  c = needle.sample(TOK, context=900, depth=0.5, index=4, seed=5, filler_chars=30000)
  assert a == b
  assert (a.answer, a.tokens) != (c.answer, c.tokens)
  assert passkey.sample(TOK, context=900, depth=0.5, seed=1) == passkey.sample(
      TOK, context=900, depth=0.5, seed=1)


@NEEDS_SHARED
def test_generator_errors_name_the_problem():
  with pytest.raises(ValueError, match="passkey context=100: context of"):
    passkey.sample(TOK, context=100, depth=0.5)
  with pytest.raises(ValueError, match="max_new_tokens=4 must exceed"):
    passkey.sample(TOK, context=900, depth=0.5, max_new_tokens=4)
  with pytest.raises(ValueError, match="raise filler_chars"):
    needle.sample(TOK, context=3000, depth=0.5, filler_chars=1000)
  with pytest.raises(ValueError, match="depth must be in"):
    haystack.insertion_point(1.5, 10, [0])


def test_exact_match():
  assert em.exact_match("74509.", "74509") == 1.0
  assert em.exact_match(" 74509 is the pass key", "74509") == 1.0
  assert em.exact_match("\n74509\n", "74509") == 1.0
  # Negative controls: a wrong, partial, longer or missing answer scores 0.
  for wrong in ("74508.", "7450", "745091", "", "the pass key is 74509", "74,509"):
    assert em.exact_match(wrong, "74509") == 0.0, wrong
  with pytest.raises(ValueError, match="answer is empty"):
    em.exact_match("x", "")


def test_longbench_ruler_metrics():
  # LongBench qa_f1: normalize (lower, no punctuation/articles) then token F1.
  # pred {paris, france} vs ref {paris}: P = 1/2, R = 1 -> F1 = 2/3.
  assert hf_tasks.qa_f1("Paris, France.", "the Paris") == pytest.approx(2 / 3)
  assert hf_tasks.qa_f1("London", "Paris") == 0.0
  assert hf_tasks.score("longbench", "hotpotqa", "Paris", ["Rome", "paris"]) == 1.0
  assert hf_tasks.retrieval_score("Paragraph 3 and 7", "Paragraph 3") == 0.5
  assert hf_tasks.retrieval_score("Paragraph 4", "Paragraph 3") == 0.0
  # RULER string_match_all: the fraction of references contained in the prediction.
  assert hf_tasks.score("ruler", "niah_multikey_1", "1234 and 99", ["1234", "5678"]) == 0.5
  assert hf_tasks.score("ruler", "qa_1", "it is 5678", ["1234", "5678"]) == 1.0
  assert hf_tasks.score("ruler", "qa_1", "none", ["1234"]) == 0.0


def test_hf_prompt_truncates_the_middle():
  s = hf_tasks.HFSample(name="qasper", index=0, context="abcdefghij" * 10,
                        question="Q?", answer_prefix="A:", answers=("x",),
                        max_new_tokens=8, revision="main")
  ids, new = hf_tasks.prompt_ids(TOK, s, 40)
  assert new == 8 and len(ids) == 40 - 8
  text = TOK.decode(ids)
  assert text.startswith("abcdefghijabc") and text.endswith("ghijQ?A:")
  with pytest.raises(ValueError, match="qasper sample 0"):
    hf_tasks.prompt_ids(TOK, s, 10)


def test_hf_offline_is_one_line(monkeypatch):
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
  monkeypatch.setattr(hf_tasks, "hub_reachable", lambda *a, **k: False)
  with pytest.raises(hf_tasks.DatasetUnavailable) as e:
    hf_tasks.load("longbench", longbench=("qasper",))
  msg = str(e.value)
  assert "\n" not in msg and "Xnhyacinth/LongBench/qasper@main" in msg and "offline" in msg
  with pytest.raises(ValueError, match="unknown subset"):
    hf_tasks.load("longbench", longbench=("gov_report",))
