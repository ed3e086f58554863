"""Held-out windows that share no token with the calibration windows (model selection,
e.g. the FDC/ZACK rate search, `kvlowrank.methods.rotated.search`).

The shared data folder has no WikiText-2 train split, so calibration (`calib.sample_windows`:
windows at random offsets of the validation split) and a held-out set for selection (the
validation split too: the test split is what the reports measure) come from the SAME text.
They are kept apart by token index:
  * both are cut from one token stream: the calibration split tokenized exactly as
    calibration tokenizes it (`calib.calibration_ids`: no BOS, calib.max_chars);
  * the calibration windows cover [c_i, c_i + calib.seq_len) for the seeded offsets c_i
    (`calib.sample_starts`, the offsets `calib.sample_windows` slices at);
  * the held-out windows are the first `n` windows of `seq_len` tokens, scanning the stream
    from its start, whose ranges [s, s + seq_len) meet none of those ranges; consecutive
    held-out windows do not overlap each other either.
So no token of the stream is in both sets (`tests/test_held_out.py` checks it). When the
held-out text is not the calibration text (another dataset, or a calib.path file with other
contents), nothing can overlap by index and the first `n` windows of the held-out text
(tokenized without BOS, data.max_chars) are taken. Not detected: a calib.path file that
copies part of the validation text with different contents around it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlowrank.data import calib as calib_lib, text as text_lib


@dataclasses.dataclass(frozen=True)
class HeldOut:
  windows: np.ndarray        # int32 [n, seq_len]
  starts: tuple              # token offset of each held-out window in the stream
  calib_starts: tuple        # offsets of the calibration windows (same stream), or ()
  where: str                 # the held-out text's source
  shared_text: bool          # True: calibration and held-out windows share one stream


def free_windows(n_tokens: int, seq_len: int, n_windows: int, taken, *,
                 taken_len: int, where: str = "") -> np.ndarray:
  """Offsets of the first `n_windows` windows [s, s + seq_len) of a stream of `n_tokens`
  tokens that meet no taken range [c, c + taken_len) and no earlier window (greedy scan
  from 0: a window that hits a taken range restarts after the range's end).

  Raises:
    ValueError: fewer than `n_windows` such windows fit (one line, naming the fields).
  """
  if seq_len < 2:
    raise ValueError(f"eval.seq_len must be >= 2, got {seq_len}")
  if n_windows < 1:
    raise ValueError(f"held_out_windows must be >= 1, got {n_windows}")
  ends = sorted((int(c), int(c) + taken_len) for c in taken)
  out, s = [], 0
  while len(out) < n_windows and s + seq_len <= n_tokens:
    hit = [e for b, e in ends if b < s + seq_len and s < e]
    if hit:
      s = max(hit)
      continue
    out.append(s)
    s += seq_len
  if len(out) < n_windows:
    raise ValueError(f"held_out_windows={n_windows}: only {len(out)} windows of eval.seq_len="
                     f"{seq_len} tokens of {where or 'the text'} ({n_tokens} tokens) avoid the "
                     f"{len(ends)} calibration windows; lower held_out_windows or "
                     f"calib.n_samples")
  return np.asarray(out, np.int64)


def held_out_windows(tokenizer, calib: calib_lib.CalibSpec, *, dataset: str, source: str,
                     seq_len: int, n_windows: int, max_chars: int = 0) -> HeldOut:
  """`n_windows` windows of `seq_len` tokens of `dataset`'s validation split, disjoint from
  the calibration windows of `calib` (module docstring).

  Args:
    tokenizer: a kvlowrank Tokenizer.
    calib: the config's calibration section (its windows are excluded).
    dataset, source: the held-out text (data.dataset, data.source; split "validation").
    seq_len: window length (eval.seq_len); n_windows: how many.
    max_chars: data.max_chars, used only when the held-out text is not the calibration text.
  """
  txt, where = text_lib.load_text(dataset, "validation", source=source)
  cids, ctxt, _ = calib_lib.calibration_ids(tokenizer, calib)
  if ctxt == txt:
    cstarts = calib_lib.sample_starts(len(cids), n_samples=calib.n_samples,
                                      seq_len=calib.seq_len, seed=calib.seed, source=where)
    starts = free_windows(len(cids), seq_len, n_windows, cstarts, taken_len=calib.seq_len,
                          where=where.removeprefix("file:"))
    ids, shared, cs = cids, True, tuple(int(c) for c in cstarts)
  else:
    ids = text_lib.tokenize(tokenizer, txt, add_bos=False, max_chars=max_chars)
    starts = free_windows(len(ids), seq_len, n_windows, (), taken_len=0,
                          where=where.removeprefix("file:"))
    shared, cs = False, ()
  windows = np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)
  return HeldOut(windows=windows, starts=tuple(int(s) for s in starts), calib_starts=cs,
                 where=where, shared_text=shared)
