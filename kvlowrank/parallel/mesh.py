"""The device mesh of `kvlowrank.parallel` and what a model needs to split over it."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from kvlowrank.spec import ModelSpec

DATA = "data"    # batch rows
MODEL = "model"  # KV heads, MLP columns, vocabulary


def make_mesh(data: int = 1, model: int = 1, devices: Optional[Sequence] = None) -> Mesh:
  """A (data, model) mesh over the first data * model devices (default: jax.devices()).

  Raises:
    ValueError naming the mesh field when it is not positive or there are too few devices.
  """
  for name, n in (("data", data), ("model", model)):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"mesh.{name} must be a positive int, got {n!r}")
  devices = list(jax.devices() if devices is None else devices)
  if data * model > len(devices):
    raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, "
                     f"{len(devices)} available")
  return Mesh(np.asarray(devices[:data * model]).reshape(data, model), (DATA, MODEL))


def check_layout(spec: ModelSpec, mesh: Mesh, batch: Optional[int] = None) -> None:
  """One-line ValueError naming the field that does not split over the mesh."""
  tp, dp = mesh.shape[MODEL], mesh.shape[DATA]
  for field in ("n_kv_heads", "n_heads", "ffn_dim", "vocab_size"):
    n = getattr(spec, field)
    if n % tp:
      raise ValueError(f"ModelSpec.{field}={n} does not split over mesh model={tp} devices "
                       f"(it must be a multiple of {tp})")
  if batch is not None and batch % dp:
    raise ValueError(f"batch={batch} does not split over mesh data={dp} devices (it must be "
                     f"a multiple of {dp})")


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
  """The spec one device of a model axis of `tp` devices runs: its share of heads, MLP
  columns and vocabulary (head dim, width and everything else unchanged)."""
  if tp == 1:
    return spec
  return spec.replace(n_heads=spec.n_heads // tp, n_kv_heads=spec.n_kv_heads // tp,
                      ffn_dim=spec.ffn_dim // tp, vocab_size=spec.vocab_size // tp)
