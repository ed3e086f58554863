"""What a benchmark ran on: the header of every result file and BENCHMARKS.md table."""

from __future__ import annotations

import datetime
import importlib.metadata
import sys

import jax

from kvlowrank.bench import memory

# Distributions whose versions decide kernel timings (None where not installed).
PACKAGES = {"jax": "jax", "jaxlib": "jaxlib", "triton": "triton", "jax_triton": "jax-triton"}


def _version(dist: str):
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment() -> dict:
  """Device, memory, versions and today's date, JSON-ready.

  Returns:
    dict(device, platform, device_count, memory_bytes, jax, jaxlib, triton, jax_triton,
    python, date): `device` is the first device's kind (e.g. "NVIDIA H200"),
    `memory_bytes` its allocator limit (None off-GPU), package versions None where absent.
  """
  dev = jax.devices()[0]
  info = dict(device=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
              memory_bytes=memory.bytes_limit())
  info.update({key: _version(dist) for key, dist in PACKAGES.items()})
  info.update(python=sys.version.split()[0], date=datetime.date.today().isoformat())
  return info
