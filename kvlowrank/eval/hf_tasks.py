"""LongBench and RULER through HF `datasets` (kvpress's copies of both), when online.

Datasets (names pinned here; the revision is `longctx.hf_revision`, default "main"):
  * LongBench: `Xnhyacinth/LongBench`, one config per subset (kvpress's copy: columns
    context, question, answer_prefix, answers, max_new_tokens), split "test".
  * RULER: `simonjegou/ruler`, one config per context length ("4096", "8192", ...),
    split "test" (kvpress's pre-generated RULER: context, question, answer_prefix,
    answer, task, max_new_tokens).
The commit SHAs of these datasets could not be looked up from the offline box this was
written on, so "main" is the default and every record stores the commit the hub
resolved (`HfApi.dataset_info(...).sha`): a run is reproducible by passing that SHA as
longctx.hf_revision.

Offline: `load` probes the hub (3 s) and raises DatasetUnavailable with one line naming
the dataset; with HF_HUB_OFFLINE=1 it skips the probe and reads the local HF cache.

Prompt = context + question + answer_prefix (kvpress's order), the context's tokens cut
in the middle to fit the budget (LongBench's truncation). Scores: RULER's
string_match_all (fraction of references found in the prediction, case-insensitive;
string_match_part = any of them for its qa tasks), LongBench's qa_f1 (normalized token
F1, best reference) and passage retrieval score.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import socket
import string

BENCHMARKS = ("longbench", "ruler")
LONGBENCH = "Xnhyacinth/LongBench"
RULER = "simonjegou/ruler"
# LongBench's dataset2maxlen for the subsets scored here.
LONGBENCH_MAX_NEW = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64,
                     "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
                     "passage_retrieval_en": 32}
LONGBENCH_SUBSETS = ("narrativeqa", "qasper", "hotpotqa", "passage_retrieval_en")


class DatasetUnavailable(FileNotFoundError):
  """The dataset cannot be read (hub unreachable and no cached copy)."""


@dataclasses.dataclass(frozen=True)
class HFSample:
  name: str                # the LongBench subset or the RULER task
  index: int
  context: str
  question: str
  answer_prefix: str
  answers: tuple[str, ...]
  max_new_tokens: int
  revision: str            # the dataset commit the hub resolved


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
  try:
    with socket.create_connection((host, 443), timeout=timeout):
      return True
  except OSError:
    return False


def _rows(name: str, config: str, revision: str, n: int) -> tuple[list[dict], str]:
  where = f"{name}/{config}@{revision or 'main'}"
  offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get(
      "HF_DATASETS_OFFLINE") == "1"
  if not offline and not hub_reachable():
    raise DatasetUnavailable(f"{where}: the Hugging Face hub is unreachable (offline); "
                             "run online, or with HF_HUB_OFFLINE=1 and a cached copy")
  logging.getLogger("datasets").setLevel(logging.WARNING)  # no INFO chatter at import
  import datasets  # pylint: disable=g-import-not-at-top
  try:
    ds = datasets.load_dataset(name, config, split="test", revision=revision or None)
  except Exception as e:  # hub/cache errors of any kind: one line naming the dataset
    raise DatasetUnavailable(f"{where}: cannot load ({type(e).__name__}"
                             f"{'; offline and not cached' if offline else ''})") from None
  sha = revision or "main"
  if not offline:
    try:
      from huggingface_hub import HfApi  # pylint: disable=g-import-not-at-top
      sha = HfApi().dataset_info(name, revision=revision or None).sha or sha
    except Exception:  # the data loaded; the SHA is best effort  # pylint: disable=broad-except
      pass
  return [ds[i] for i in range(min(n, len(ds)))], sha


def _answers(row: dict) -> tuple[str, ...]:
  a = row.get("answers", row.get("answer", ()))
  return (a,) if isinstance(a, str) else tuple(str(x) for x in a)


def load(benchmark: str, *, ruler: str = "4096", longbench=LONGBENCH_SUBSETS, n: int = 20,
         revision: str = "") -> list[HFSample]:
  """The first n samples of each LongBench subset, or of RULER at context `ruler`.

  Raises:
    ValueError for an unknown benchmark/subset; DatasetUnavailable (one line, naming the
    dataset) when it cannot be read.
  """
  if benchmark == "longbench":
    bad = [s for s in longbench if s not in LONGBENCH_MAX_NEW]
    if bad:
      raise ValueError(f"config.longctx.longbench: unknown subset(s) {bad}; scored: "
                       f"{', '.join(LONGBENCH_MAX_NEW)}")
    sources = [(LONGBENCH, s) for s in longbench]
  elif benchmark == "ruler":
    sources = [(RULER, ruler)]
  else:
    raise ValueError(f"unknown benchmark {benchmark!r}; known: {BENCHMARKS}")
  out = []
  for name, config in sources:
    rows, sha = _rows(name, config, revision, n)
    for i, r in enumerate(rows):
      sub = config if benchmark == "longbench" else str(r.get("task", "ruler"))
      default_new = LONGBENCH_MAX_NEW.get(sub, 64)
      out.append(HFSample(name=sub, index=i, context=str(r.get("context", "")),
                          question=str(r.get("question", "")),
                          answer_prefix=str(r.get("answer_prefix", "") or ""),
                          answers=_answers(r),
                          max_new_tokens=int(r.get("max_new_tokens") or default_new),
                          revision=sha))
  return out


def prompt_ids(tokenizer, s: HFSample, budget: int) -> tuple[list[int], int]:
  """(prompt ids of at most budget - max_new_tokens tokens, max_new_tokens): the
  context's middle is cut to fit."""
  ctx = tokenizer.encode(s.context, add_bos=True)
  tail = tokenizer.encode(s.question + s.answer_prefix, add_bos=False)
  room = budget - s.max_new_tokens - len(tail)
  if room < 2:
    raise ValueError(f"{s.name} sample {s.index}: a budget of {budget} tokens cannot hold "
                     f"its question and answer")
  if len(ctx) > room:
    ctx = ctx[:room // 2] + ctx[len(ctx) - (room - room // 2):]
  return ctx + tail, s.max_new_tokens


def _normalize(text: str) -> list[str]:
  """LongBench's normalize_answer: lower, drop punctuation and articles, split."""
  text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return text.split()


def qa_f1(prediction: str, reference: str) -> float:
  p, r = _normalize(prediction), _normalize(reference)
  common = sum((collections.Counter(p) & collections.Counter(r)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(p), common / len(r)
  return 2 * precision * recall / (precision + recall)


def retrieval_score(prediction: str, reference: str) -> float:
  """LongBench passage retrieval: the share of numbers in the prediction that are the
  referenced paragraph's number."""
  m = re.findall(r"Paragraph (\d+)", reference)
  if not m:
    return 0.0
  nums = re.findall(r"\d+", prediction)
  return sum(n == m[0] for n in nums) / len(nums) if nums else 0.0


def score(benchmark: str, name: str, prediction: str, answers) -> float:
  """The benchmark's metric for one prediction against its references."""
  answers = tuple(answers)
  if benchmark == "ruler":
    found = [a.lower() in prediction.lower() for a in answers]
    if not found:
      return 0.0
    return float(any(found)) if name.startswith("qa") else sum(found) / len(found)
  if name == "passage_retrieval_en":
    return max(retrieval_score(prediction, a) for a in answers)
  return max(qa_f1(prediction, a) for a in answers)
