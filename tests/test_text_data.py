"""Evaluation text (GPTQ protocol rows/joins, local and shared sources) and seeded
calibration sampling."""

import numpy as np
import pytest

from kvlowrank.data import calib, text
from kvlowrank.experiment.models import ByteTokenizer
from kvlowrank.resources import shared_dir

SHARED = shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared not available")


def test_rows_like_hf_builders(tmp_path):
  p = tmp_path / "wiki.txt"
  p.write_bytes(b" \r\n = Title = \r\n \r\n Body line . \r\n")
  assert text.file_rows(p, "wikitext") == ["", " = Title = \n", "", " Body line . \n"]
  assert text.file_rows(p, "ptb") == ["", "= Title =", "", "Body line ."]
  joined, where = text.load_text("wikitext2", "test", path=str(p))
  assert joined == "\n\n = Title = \n\n\n\n\n Body line . \n" and where.startswith("file:")
  assert text.load_text("ptb", "test", path=str(p), joiner=" ")[0] == " = Title =  Body line ."
  assert text.load_text("wikitext2", "test", path=str(p), path_format="joined")[0] == \
      " \n = Title = \n \n Body line . \n"
  with pytest.raises(ValueError, match="already joined"):
    text.load_text("wikitext2", "test", path=str(p), path_format="joined", joiner=" ")
  with pytest.raises(ValueError, match="path_format must be rows|joined"):
    text.load_text("wikitext2", "test", path=str(p), path_format="csv")


def test_source_errors(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="unknown data.dataset/split 'c4'/'test'"):
    text.load_text("c4", "test")
  with pytest.raises(ValueError, match="data.source must be one of"):
    text.load_text("wikitext2", "test", source="web")
  with pytest.raises(FileNotFoundError, match="data.path: no such file"):
    text.load_text("wikitext2", "test", path=str(tmp_path / "nope.txt"))
  monkeypatch.setenv("KVLOWRANK_SHARED", str(tmp_path))  # a shared folder without data/
  with pytest.raises(FileNotFoundError, match="wikitext-2-raw/wiki.test.raw not found"):
    text.load_text("wikitext2", "test", source="local")


@needs_shared
def test_shared_wikitext_test_is_the_gptq_string():
  """wiki.test.raw is "\\n\\n".join(HF wikitext-2-raw-v1 test rows): its line structure
  equals the join of the 4358 rows of the (tokenized) v1 test file, line for line."""
  raw, _ = text.load_text("wikitext2", "test")
  rows = text.file_rows(SHARED / "data" / "wikitext-2" / "test.txt", "wikitext")
  assert len(rows) == 4358  # HF wikitext-2 test split size
  joined = "\n\n".join(rows)
  shape = lambda s: [bool(line.strip()) for line in s.split("\n")]
  assert shape(raw) == shape(joined)
  assert raw.startswith("\n\n = Robert Boulter = \n\n") and "\r" not in raw
  # Negative control: joining with a single newline changes the structure.
  assert shape(raw) != shape("\n".join(rows))
  val, where = text.load_text("wikitext2", "validation")
  assert where.endswith("wikitext-2/valid.txt") and val.count("\n\n") >= 3759
  ptb, _ = text.load_text("ptb", "test")
  assert ptb.startswith("no it was n't black monday\n\nbut while")


def test_tokenize_and_windows():
  tok = ByteTokenizer()
  ids = text.tokenize(tok, "héllo world", max_chars=5)
  np.testing.assert_array_equal(ids, list("héllo".encode()))
  with pytest.raises(ValueError, match="max_chars"):
    text.tokenize(tok, "x", max_chars=-1)


def test_calibration_samples_are_seeded_slices():
  ids = np.arange(1000, dtype=np.int32) * 7 % 997
  a = calib.sample_windows(ids, n_samples=5, seq_len=64, seed=3)
  b = calib.sample_windows(ids, n_samples=5, seq_len=64, seed=3)
  c = calib.sample_windows(ids, n_samples=5, seq_len=64, seed=4)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (5, 64) and a.dtype == np.int32 and not np.array_equal(a, c)
  for row in a:  # contiguous slices of the token stream
    start = int(np.flatnonzero(ids == row[0])[0])
    np.testing.assert_array_equal(row, ids[start:start + 64])
  with pytest.raises(ValueError, match="fewer than calib.seq_len"):
    calib.sample_windows(ids[:10], n_samples=1, seq_len=64, seed=0)
  with pytest.raises(ValueError, match="calib.split must not be 'test'"):
    calib.CalibSpec(split="test")


@needs_shared
def test_calibration_split_is_disjoint_from_test():
  spec = calib.CalibSpec(n_samples=4, seq_len=256, seed=3)
  toks, where = calib.calibration_tokens(ByteTokenizer(), spec)
  assert toks.shape == (4, 256) and where.endswith("wikitext-2/valid.txt")
  test_text, _ = text.load_text("wikitext2", "test")
  for row in toks:
    assert bytes(row.astype(np.uint8)).decode("utf-8", "replace")[8:72] not in test_text
