"""Calibration samples for methods that fit factors on data (Palu whitening, XQuant's SVD).

GPTQ/Palu draw `n_samples` windows of `seq_len` tokens at uniformly random offsets of
the tokenized *train* split (seed 3 in Palu's whitening). The shared data folder has no
WikiText-2 train split, so the default here is the validation split
(wikitext-2/valid.txt): disjoint from the test split that perplexity is measured on,
so calibration never sees the evaluation text.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlowrank.data import text as text_lib


@dataclasses.dataclass(frozen=True)
class CalibSpec:
  """Typed calibration section of a config (see configs/*.py `calib`)."""

  dataset: str = "wikitext2"
  split: str = "validation"
  source: str = "auto"
  path: str = ""
  path_format: str = "rows"
  n_samples: int = 16
  seq_len: int = 512
  seed: int = 3
  max_chars: int = 0

  def __post_init__(self):
    if self.n_samples <= 0:
      raise ValueError(f"calib.n_samples must be positive, got {self.n_samples}")
    if self.seq_len < 2:
      raise ValueError(f"calib.seq_len must be >= 2, got {self.seq_len}")
    if self.split == "test":
      raise ValueError("calib.split must not be 'test': calibration must not see the "
                       "evaluation text")


def sample_starts(n_tokens: int, *, n_samples: int, seq_len: int, seed: int,
                  source: str = "") -> np.ndarray:
  """Start offsets of `sample_windows`' windows in a split of `n_tokens` tokens (window i
  covers token indices [starts[i], starts[i] + seq_len)): seeded uniform offsets.

  Raises:
    ValueError: the split is shorter than one window (names calib.seq_len and the text).
  """
  if n_tokens < seq_len:
    where = f" ({source.removeprefix('file:')})" if source else ""
    raise ValueError(f"calibration text{where} has {n_tokens} tokens, fewer than "
                     f"calib.seq_len={seq_len}")
  return np.random.default_rng(seed).integers(0, n_tokens - seq_len + 1, size=n_samples)


def sample_windows(ids: np.ndarray, *, n_samples: int, seq_len: int, seed: int,
                   source: str = "") -> np.ndarray:
  """`n_samples` windows at seeded uniform random offsets (GPTQ's sampler, numpy RNG).

  Args:
    ids: int32 [N] token ids of the calibration split.
    n_samples, seq_len: how many windows, and how long.
    seed: np.random.default_rng seed; equal seeds give equal samples.
    source: where the text came from (named in the error when it is too short).
  Returns:
    int32 [n_samples, seq_len] (window i = ids[starts[i]:][:seq_len], `sample_starts`).
  """
  starts = sample_starts(len(ids), n_samples=n_samples, seq_len=seq_len, seed=seed,
                         source=source)
  return np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)


def calibration_ids(tokenizer, spec: CalibSpec) -> tuple[np.ndarray, str, str]:
  """The calibration split as one token stream: (int32 [N] ids, its text, where it came
  from). `calibration_tokens` samples its windows from exactly these ids."""
  txt, where = text_lib.load_text(spec.dataset, spec.split, source=spec.source, path=spec.path,
                                  path_format=spec.path_format, field="calib")
  return text_lib.tokenize(tokenizer, txt, add_bos=False, max_chars=spec.max_chars), txt, where


def calibration_tokens(tokenizer, spec: CalibSpec) -> tuple[np.ndarray, str]:
  """Loads, tokenizes and samples the calibration split.

  Args:
    tokenizer: a kvlowrank Tokenizer.
    spec: CalibSpec.
  Returns:
    (int32 [n_samples, seq_len], description of the source text).
  """
  ids, _, where = calibration_ids(tokenizer, spec)
  return sample_windows(ids, n_samples=spec.n_samples, seq_len=spec.seq_len,
                        seed=spec.seed, source=where), where
