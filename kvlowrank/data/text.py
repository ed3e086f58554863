"""Evaluation text for perplexity (WikiText-2, PTB), following the GPTQ / Palu protocol.

The protocol (GPTQ `datautils.get_wikitext2`, Palu `run_ppl_eval.py`): take the rows
of the split as HF `datasets` yields them, join them with "\\n\\n", tokenize the whole
string once, cut it into non-overlapping windows of `seq_len` tokens (the tail that
does not fill a window is dropped).

Sources, in the order `source="auto"` tries them:
  * `path`: any local text file, in `path_format` "rows" (one HF row per line, as the
    original corpus files the HF builders read) or "joined" (already the joined text).
  * the shared data folder (`kvlowrank.resources.shared_path("data", ...)`), used in
    CI and offline:
      wikitext-2-raw/wiki.test.raw  "joined": it is exactly "\\n\\n".join(HF
        wikitext-2-raw-v1 test rows) saved with CRLF line ends (its 11605 line breaks =
        2891 non-blank rows + 2 x 4357 joins of the 4358 HF rows); read with universal
        newlines it is the GPTQ string itself;
      wikitext-2/valid.txt  "rows": the *tokenized* WikiText-2 validation file (HF
        wikitext-2-v1 validation, with <unk>): the shared folder has no raw validation
        or train split;
      ptb/ptb.{test,valid}.txt  "rows".
  * HF `datasets` at a pinned revision (needs the network or a warm HF cache).
Rows are rebuilt from a "rows" file exactly as the HF builders did: WikiText yields every
line with its newline, blank lines as "" (`datasets/wikitext/wikitext.py`); PTB yields
each line stripped (`ptb_text_only`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from kvlowrank import resources


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Where one (dataset, split) lives locally and on the HF hub."""

  local: tuple[str, ...]        # path parts under the shared folder
  local_format: str             # "rows" | "joined" (see the module docstring)
  hf_name: str
  hf_config: str
  hf_split: str
  hf_revision: str
  field: str                    # the HF column holding the text
  rows: str                     # "wikitext" | "ptb": how a local file becomes rows


# Salesforce/wikitext pinned at the commit with the parquet files (2024-01).
_WIKITEXT_REV = "b08601e04326c79dfdd32d625aee71d232d685c3"
_PTB = ("ptb-text-only/ptb_text_only", "penn_treebank")
# PTB on the hub: the canonical `ptb_text_only` (a script dataset) under its org, pinned
# to its auto-converted parquet branch (unverified offline: CI reads ../shared).
_PTB_REV = "refs/convert/parquet"
CORPORA = {
    ("wikitext2", "test"): Corpus(
        ("data", "wikitext-2-raw", "wiki.test.raw"), "joined", "Salesforce/wikitext",
        "wikitext-2-raw-v1", "test", _WIKITEXT_REV, "text", "wikitext"),
    # The local file is the tokenized (<unk>) v1 validation split; HF gives the raw one.
    ("wikitext2", "validation"): Corpus(
        ("data", "wikitext-2", "valid.txt"), "rows", "Salesforce/wikitext",
        "wikitext-2-raw-v1", "validation", _WIKITEXT_REV, "text", "wikitext"),
    ("ptb", "test"): Corpus(("data", "ptb", "ptb.test.txt"), "rows", *_PTB, "test",
                            _PTB_REV, "sentence", "ptb"),
    ("ptb", "validation"): Corpus(("data", "ptb", "ptb.valid.txt"), "rows", *_PTB,
                                  "validation", _PTB_REV, "sentence", "ptb"),
}
SOURCES = ("auto", "local", "hf")


def file_rows(path: Path, convention: str) -> list[str]:
  """Rows of a local corpus file as the HF builder yields them.

  Args:
    path: the text file.
    convention: "wikitext" (each line with its newline, blank lines -> "") or "ptb"
      (each line stripped).
  Returns:
    list of row strings.
  """
  # Text mode with universal newlines, as the HF builders open the files ("\r\n" -> "\n").
  with open(path, encoding="utf-8") as f:
    lines = list(f)
  if convention == "wikitext":
    return [row if row.strip() else "" for row in lines]
  if convention == "ptb":
    return [row.strip() for row in lines]
  raise ValueError(f"unknown row convention {convention!r} (wikitext|ptb)")


def _hf_rows(corpus: Corpus, field: str = "data") -> list[str]:
  import datasets  # pylint: disable=g-import-not-at-top
  try:
    ds = datasets.load_dataset(corpus.hf_name, corpus.hf_config, split=corpus.hf_split,
                               revision=corpus.hf_revision)
  except Exception as e:  # offline / hub errors: name what was tried
    raise FileNotFoundError(
        f"could not load {corpus.hf_name}/{corpus.hf_config} split {corpus.hf_split} "
        f"@ {corpus.hf_revision} from the HF hub ({type(e).__name__}: {e}); give a local "
        f"file with {field}.path or provide the shared data folder") from e
  return list(ds[corpus.field])


def read_local(path: Path, fmt: str, convention: str, joiner: str, field: str = "data"
               ) -> str:
  """The joined text of a local file in format "rows" or "joined"; `field` names the
  config section in errors ("data" or "calib")."""
  if fmt == "joined":
    if joiner != "\n\n":
      raise ValueError(f"{path} is already joined with '\\n\\n'; {field}.joiner="
                       f"{joiner!r} needs a file in path_format='rows'")
    with open(path, encoding="utf-8") as f:  # universal newlines: CRLF -> LF
      return f.read()
  if fmt == "rows":
    return joiner.join(file_rows(path, convention))
  raise ValueError(f"{field}.path_format must be rows|joined, got {fmt!r}")


def load_text(dataset: str, split: str, *, source: str = "auto", path: str = "",
              path_format: str = "rows", joiner: str = "\n\n", field: str = "data"
              ) -> tuple[str, str]:
  """The concatenated text of one split.

  Args:
    dataset: "wikitext2" or "ptb".
    split: "test" or "validation".
    source: "auto" (path, else shared folder, else HF), "local" or "hf".
    path: an explicit local file (overrides the shared folder).
    path_format: "rows" (one HF row per line, read with the dataset's row convention)
      or "joined" (the file is the joined text).
    joiner: string between rows ("\n\n" in GPTQ/Palu).
    field: the config section these settings come from ("data" or "calib"), named in
      errors.
  Returns:
    (text, description of where it came from).
  Raises:
    ValueError: unknown dataset/split/source/format, an empty file.
    FileNotFoundError: no source.
  """
  if (dataset, split) not in CORPORA:
    raise ValueError(f"unknown {field}.dataset/split {dataset!r}/{split!r}; known: "
                     f"{', '.join('/'.join(k) for k in sorted(CORPORA))}")
  if source not in SOURCES:
    raise ValueError(f"{field}.source must be one of {SOURCES}, got {source!r}")
  corpus = CORPORA[(dataset, split)]
  if path:
    p = check_path(path, field)
    return read_local(p, path_format, corpus.rows, joiner, field), f"file:{p.resolve()}"
  if source in ("auto", "local"):
    root = resources.shared_dir()
    local = None if root is None else root.joinpath(*corpus.local)
    if local is not None and local.is_file():
      return (read_local(local, corpus.local_format, corpus.rows, joiner),
              f"file:{local.resolve()}")
    if source == "local":
      raise FileNotFoundError(
          f"data.source=local: {'/'.join(corpus.local)} not found under the shared folder "
          f"({root}); set KVLOWRANK_SHARED or {field}.path")
  rows = _hf_rows(corpus, field)
  return joiner.join(rows), (f"hf:{corpus.hf_name}/{corpus.hf_config}/{corpus.hf_split}"
                             f"@{corpus.hf_revision}")


def check_path(path: str, field: str = "data") -> Path:
  """An explicit text file of a config (`<field>.path`): it must exist and not be empty.

  Raises:
    FileNotFoundError / ValueError naming `<field>.path` and the file.
  """
  p = Path(path).expanduser()
  if not p.is_file():
    raise FileNotFoundError(f"{field}.path: no such file {p}")
  if p.stat().st_size == 0:
    raise ValueError(f"{field}.path: {p} is empty")
  return p


def tokenize(tokenizer, text: str, *, add_bos: bool = True, max_chars: int = 0) -> np.ndarray:
  """Token ids of the whole text as one int32 array.

  Args:
    tokenizer: a kvlowrank Tokenizer (`encode(text, add_bos)`).
    text: the concatenated split.
    add_bos: let the tokenizer prepend BOS *once* at the start when its convention does
      (HF default: Llama yes, SmolLM2 no), as GPTQ's single `tokenizer(text)` call.
    max_chars: > 0 tokenizes only the first max_chars characters (a protocol deviation
      for smoke runs with slow pure-Python tokenizers; 0 = the whole text).
  Returns:
    int32 [N] token ids.
  """
  if max_chars < 0:
    raise ValueError(f"data.max_chars must be >= 0, got {max_chars}")
  if max_chars:
    text = text[:max_chars]
  return np.asarray(tokenizer.encode(text, add_bos=add_bos), np.int32)


def windows(ids: np.ndarray, seq_len: int, max_windows: int = 0, source: str = ""
            ) -> np.ndarray:
  """Non-overlapping windows [W, seq_len] from the start of `ids` (tail dropped).

  Args:
    ids: int32 [N].
    seq_len: window length (>= 2: each window scores seq_len - 1 next-token predictions).
    max_windows: > 0 keeps only the first max_windows windows (a subset for quick runs).
    source: where the text came from (named in the error when it is too short).
  Returns:
    int32 [W, seq_len].
  """
  if seq_len < 2:
    raise ValueError(f"eval.seq_len must be >= 2, got {seq_len}")
  if max_windows < 0:
    raise ValueError(f"eval.max_windows must be >= 0, got {max_windows}")
  n = len(ids) // seq_len
  if n == 0:
    where = f"the text of {source.removeprefix('file:')}" if source else "the text"
    hint = "raise data.max_chars or lower eval.seq_len" if len(ids) else "an empty text"
    raise ValueError(f"{where} has {len(ids)} tokens, fewer than one window of "
                     f"eval.seq_len={seq_len} ({hint})")
  if max_windows:
    n = min(n, max_windows)
  return np.asarray(ids[:n * seq_len], np.int32).reshape(n, seq_len)

