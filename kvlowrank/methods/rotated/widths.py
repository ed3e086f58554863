"""Kept widths per KV head from one global singular-value removal rate (FDC Eq. 1, ZACK Eq. 6).

For a head whose singular values θ_0 >= ... >= θ_{H-1} (sorted descending), with the
normalised tail mass tail[m] = Σ_{i>=m} θ_i / Σ_i θ_i (tail[0] = 1, tail[H] = 0), Eq. 1
keeps dims 0..j where j is the smallest index with tail[j+1] <= r: the removed dims' mass
is <= r and removing dim j too would exceed it. Sums of singular values, not squares.

Rounding: the kept width is then rounded UP to a multiple of `multiple` (16) with real
rotated components (capped at H). The papers zero-pad to multiples of 16 instead; real
components cost the same bytes and can only help (a deliberate departure).

`allocate` applies one r to every head of every layer, keys and values alike; with a
`target_ratio` it bisects r to the smallest rate that removes at least that fraction of the
KV hidden dimension (widths are monotone in r), so two allocations compare at equal bytes.
"""

from __future__ import annotations

import numpy as np


def kept_width(sigma, rate: float) -> int:
  """Eq. 1: dims kept for singular values `sigma` [H] (any order) at removal rate r in [0, 1).

  Returns j + 1 with j the smallest index such that the normalised mass of dims j+1.. is
  <= rate (H when every singular value is zero).
  """
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"removal rate must be in [0, 1), got {rate}")
  s = np.sort(np.abs(np.asarray(sigma, np.float64)))[::-1]
  total = s.sum()
  if total <= 0:
    return len(s)
  # tail[m] for m = 1..H (tail[H] = 0): mass of dims m.. over the total.
  tail = np.concatenate([np.cumsum(s[::-1])[::-1][1:], [0.0]]) / total
  return int(np.argmax(tail <= rate)) + 1


def round_width(width: int, multiple: int, head_dim: int) -> int:
  """Rounds a kept width up to a multiple (real components, no zero padding), capped at H."""
  return int(min(head_dim, -(-width // multiple) * multiple))


def widths_at(sigmas, rate: float, multiple: int) -> np.ndarray:
  """Rounded Eq. 1 widths for sigmas [..., H] at one rate: int array [...]."""
  s = np.asarray(sigmas, np.float64)
  h = s.shape[-1]
  flat = s.reshape(-1, h)
  w = [round_width(kept_width(row, rate), multiple, h) for row in flat]
  return np.asarray(w, np.int64).reshape(s.shape[:-1])


def uniform_widths(shape, head_dim: int, target_ratio: float, multiple: int) -> np.ndarray:
  """The /AC ablation: ceil((1 - target_ratio) H) rounded up to `multiple`, everywhere."""
  w = round_width(int(np.ceil((1.0 - target_ratio) * head_dim - 1e-9)), multiple, head_dim)
  return np.full(shape, max(w, min(multiple, head_dim)), np.int64)


def rate_for_target(sigmas_k, sigmas_v, target_ratio: float, multiple: int,
                    iters: int = 40) -> float:
  """Smallest removal rate (to 2^-iters) whose rounded widths remove >= target_ratio of
  the KV dims (bisection; widths are non-increasing in the rate)."""
  h = np.asarray(sigmas_k).shape[-1]
  dense = 2 * h * np.asarray(sigmas_k)[..., 0].size

  def removed(r):
    kept = widths_at(sigmas_k, r, multiple).sum() + widths_at(sigmas_v, r, multiple).sum()
    return 1.0 - kept / dense

  if removed(0.0) >= target_ratio:
    return 0.0
  lo, hi = 0.0, 1.0 - 1e-12
  if removed(hi) < target_ratio:
    raise ValueError(f"RotatedSpec.target_ratio {target_ratio} is out of reach: the "
                     f"narrowest widths (one multiple of {multiple}) remove "
                     f"{removed(hi):.3f} of the KV dims")
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    if removed(mid) >= target_ratio:
      hi = mid
    else:
      lo = mid
  return float(hi)


def allocate(sigmas_k, sigmas_v, *, rate: float, target_ratio, allocation: str,
             multiple: int):
  """Per-layer, per-KV-head kept widths for keys and values.

  Args:
    sigmas_k, sigmas_v: [L, K, H] singular values (Q-K stacks; value spectra).
    rate: removal rate r (adaptive, when target_ratio is None).
    target_ratio: None or the fraction of KV dims to remove (see RotatedSpec).
    allocation: "adaptive" | "uniform".
    multiple: width rounding.
  Returns:
    (k_widths [L, K], v_widths [L, K] int arrays, the rate used or None for uniform).
  """
  sk, sv = np.asarray(sigmas_k), np.asarray(sigmas_v)
  h = sk.shape[-1]
  if allocation == "uniform":
    w = uniform_widths(sk.shape[:-1], h, target_ratio, multiple)
    return w, w.copy(), None
  if target_ratio is not None:
    rate = rate_for_target(sk, sv, target_ratio, multiple)
  return widths_at(sk, rate, multiple), widths_at(sv, rate, multiple), rate
