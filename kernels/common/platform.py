"""Which GPU generation JAX runs on, for the dispatchers' choice of a default kernel.

The Pallas Mosaic GPU kernels (`implementation="mosaic"`) issue Hopper-only instructions
(wgmma, TMA, setmaxnreg): they run on sm_90 devices (H100, H200, GH200) and nowhere else,
so a dispatcher may pick them by default only there.
"""

from __future__ import annotations

import jax


def hopper_available() -> bool:
  """True when JAX's default backend is a GPU and every device of it has compute
  capability 9.0 (Hopper)."""
  try:
    if jax.default_backend() != "gpu":
      return False
    devices = jax.devices()
  except RuntimeError:
    return False
  return bool(devices) and all(
      str(getattr(d, "compute_capability", "")) == "9.0" for d in devices)
