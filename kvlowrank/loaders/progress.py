"""The loaders' progress bar: one tick per decoder layer read (tqdm; off by default)."""

from __future__ import annotations

from pathlib import Path


def layer_range(n_layers: int, progress: bool, path) -> range:
  """range(n_layers), shown as a tqdm bar "loading <file>" when `progress`."""
  if not progress:
    return range(n_layers)
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(range(n_layers), desc=f"loading {Path(path).name}", unit="layer", leave=False)
