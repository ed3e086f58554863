"""The element-wise closeness check of the kernel tests (GPU tests and the Triton-interpreter
checks): |out - ref| <= atol + rtol |ref| everywhere, equal-signed infinities (lse of an empty
row) count as equal, NaN never does; and its negative-control twin, `assert_differs`."""

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
