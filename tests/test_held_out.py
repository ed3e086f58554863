"""Held-out windows disjoint from the calibration windows (kvlowrank.data.held_out): the
greedy scan vs a brute-force token-index check, and on the shared WikiText-2 validation
split the windows located by CONTENT in the token stream (independent of the offsets the
code reports), with the old first-windows rule as the negative control."""

import numpy as np
import pytest

from kvlowrank.data import calib, held_out, text
from kvlowrank.experiment.models import ByteTokenizer
from kvlowrank.resources import shared_dir

needs_shared = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")


def _indices(starts, length):
  return set().union(*(range(int(s), int(s) + length) for s in starts)) if len(starts) else set()


def test_free_windows_hand_worked_and_disjoint():
  # Taken [5, 17) and [40, 52): windows of 10 from 0 restart after each range they hit.
  got = held_out.free_windows(100, 10, 5, [40, 5], taken_len=12)
  assert got.tolist() == [17, 27, 52, 62, 72]
  # Negative control: the old rule (the first windows of the stream) overlaps them.
  old = text.windows(np.arange(100), 10, 5)[:, 0]
  assert _indices(old, 10) & _indices([5, 40], 12)


@pytest.mark.parametrize("seed", range(3))
def test_free_windows_never_meet_taken_ranges(seed):
  rng = np.random.default_rng(seed)
  n, t, tl = 2000, 64, 96
  taken = rng.integers(0, n - tl + 1, 6)
  got = held_out.free_windows(n, t, 8, taken, taken_len=tl)
  assert len(got) == 8 and np.all(got + t <= n)
  assert not _indices(got, t) & _indices(taken, tl)            # no shared token index
  assert len(_indices(got, t)) == 8 * t                         # no overlap among them
  assert np.all(np.diff(got) >= t)


def test_not_enough_room_is_one_line_naming_the_fields():
  with pytest.raises(ValueError, match=r"^held_out_windows=3: only 2 windows of "
                                       r"eval.seq_len=10 .*calib.n_samples$"):
    held_out.free_windows(40, 10, 3, [15], taken_len=10)   # [0,10), [25,35) fit


def _locate(stream, window):
  """Every offset where `window` occurs in `stream` (brute force, by content)."""
  t = len(window)
  view = np.lib.stride_tricks.sliding_window_view(stream, t)
  return np.flatnonzero(np.all(view == window, axis=1))


@needs_shared
def test_held_out_shares_no_token_with_calibration_on_wikitext_validation():
  tok = ByteTokenizer()
  cs = calib.CalibSpec(n_samples=8, seq_len=128, seed=3, max_chars=4000)
  ho = held_out.held_out_windows(tok, cs, dataset="wikitext2", source="auto", seq_len=256,
                                 n_windows=4)
  assert ho.shared_text and ho.where.endswith("wikitext-2/valid.txt")
  assert ho.windows.shape == (4, 256)
  # The stream calibration reads, and the calibration windows as calibration draws them.
  stream, _, _ = calib.calibration_ids(tok, cs)
  ctoks, _ = calib.calibration_tokens(tok, cs)
  c_at = [int(_locate(stream, w)[0]) for w in ctoks]
  h_at = []
  for w in ho.windows:
    where = _locate(stream, w)
    assert len(where) == 1                                   # unique: located unambiguously
    h_at.append(int(where[0]))
  assert tuple(h_at) == ho.starts and sorted(c_at) == sorted(ho.calib_starts)
  assert not _indices(h_at, 256) & _indices(c_at, 128)
  # Negative control: the old held-out rule (the first windows of the split) overlaps the
  # calibration windows on this stream, so the check above can fail.
  old = text.windows(stream, 256, 4)
  old_at = [int(_locate(stream, w)[0]) for w in old]
  assert _indices(old_at, 256) & _indices(c_at, 128)


@needs_shared
def test_other_text_takes_its_first_windows():
  tok = ByteTokenizer()
  ho = held_out.held_out_windows(tok, calib.CalibSpec(dataset="ptb", n_samples=2, seq_len=64,
                                                      max_chars=3000),
                                 dataset="wikitext2", source="auto", seq_len=128, n_windows=2,
                                 max_chars=1000)
  txt, _ = text.load_text("wikitext2", "validation")
  assert not ho.shared_text and ho.starts == (0, 128) and ho.calib_starts == ()
  np.testing.assert_array_equal(ho.windows.ravel(),
                                text.tokenize(tok, txt, add_bos=False, max_chars=1000)[:256])
