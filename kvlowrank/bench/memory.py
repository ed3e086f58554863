"""The device's memory counters (JAX's allocator statistics of the first device).

Each returns None where the backend keeps no statistics (the CPU backend), so a benchmark
writes null instead of a made-up number.
"""

from __future__ import annotations

import jax


def _stat(name: str):
  stats = jax.devices()[0].memory_stats()
  if not stats or name not in stats:
    return None
  return int(stats[name])


def peak_bytes():
  """Most bytes the allocator held at once since the process started, or None."""
  return _stat("peak_bytes_in_use")


def bytes_in_use():
  """Bytes the allocator holds now, or None."""
  return _stat("bytes_in_use")


def bytes_limit():
  """Bytes the allocator may hand out (device memory less XLA's reserve), or None."""
  return _stat("bytes_limit")
