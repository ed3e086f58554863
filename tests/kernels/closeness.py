"""The element-wise closeness check of the kernel tests (GPU tests and the Triton-interpreter
checks): |out - ref| <= atol + rtol |ref| everywhere, equal-signed infinities (lse of an empty
row) count as equal, NaN never does; and its negative-control twin, `assert_differs`; and
`assert_splits_bitwise_equal` for split-K partials that must not depend on the launch's
schedule."""

from __future__ import annotations

import numpy as np


def assert_close(out, ref, atol, rtol, what):
  """AssertionError naming `what` and the count of elements off; returns the max error."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (what, out.shape, ref.shape)
  assert not np.isnan(out).any(), f"{what}: NaN in output"
  both_inf = np.isinf(out) & np.isinf(ref) & (np.sign(out) == np.sign(ref))
  err = np.where(both_inf, 0.0, np.abs(out - ref))
  bad = err > atol + rtol * np.abs(np.where(both_inf, 0.0, ref))
  assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, max err {err.max():.3g}"
  return float(err.max()) if err.size else 0.0


def assert_differs(out, ref, atol, rtol, what, unnoticed):
  """Negative control: `out` must fail `assert_close` against `ref` (the failure is printed);
  else AssertionError(unnoticed)."""
  try:
    assert_close(out, ref, atol, rtol, what)
  except AssertionError as e:
    print(f"negative control failed as it must: {str(e)[:200]}")
  else:
    raise AssertionError(unnoticed)


def assert_splits_bitwise_equal(got, want):
  """Split-K partials (o [B, N, splits, H], lse [B, N, splits]; NaN equal to NaN) `got` and
  `want` bitwise equal, naming the splits that differ. Negative control: the comparison sees a
  one-ulp change of got's first nonzero output."""
  same = lambda a, b: np.array_equal(a, b, equal_nan=True)
  (got_o, got_lse), (want_o, want_lse) = [(np.asarray(o), np.asarray(l)) for o, l in (got, want)]
  bad = [s for s in range(want_o.shape[2]) if not (same(got_o[:, :, s], want_o[:, :, s])
                                                  and same(got_lse[:, :, s], want_lse[:, :, s]))]
  assert not bad, f"splits {bad} differ"
  off = got_o.copy()
  first = np.flatnonzero(off)[0]
  off.flat[first] = np.nextafter(off.flat[first], np.inf)
  assert not same(off, want_o), "a one-ulp change went unseen"
