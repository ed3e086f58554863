"""Orbax checkpoints of calibrated parameters: a pytree of arrays plus JSON metadata.

Used so that an expensive calibration (Palu's whitening SVD, XQuant's projections) runs
once: the evaluation pipeline saves the calibrated parameter pytree under
`workdir/calib/<hash of the calibration config>` and restores it on later runs.

Uses the composite-args API of orbax-checkpoint 0.11/0.12 (`ocp.Checkpointer` with a
`CompositeCheckpointHandler` and `ocp.args.StandardSave/JsonSave`), not the deprecated
`PyTreeCheckpointer.save(..., save_args=...)` form. Orbax writes into a temporary
directory and renames it when complete, so a checkpoint directory that exists is whole.
Arrays come back with their saved dtypes (bf16 stays bf16) and bitwise-identical
values; lists and dicts keep their structure.

Orbax logs each save or restore at INFO in many lines (its handlers' timings, throughputs,
renames), which buried a launcher's own output. `save` and `restore` drop orbax's records
below WARNING while they run (`_quiet_orbax`); its warnings and errors, and everything else,
still print.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

_TREE, _META = "tree", "meta"
_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


def _not_orbax_info(record: logging.LogRecord) -> bool:
  """False for a record below WARNING logged from orbax's own source files."""
  return record.levelno >= logging.WARNING or _ORBAX_DIR not in record.pathname


@contextlib.contextmanager
def _quiet_orbax():
  """`_not_orbax_info` on every handler of the root logger (absl's included) meanwhile."""
  handlers = list(logging.getLogger().handlers)
  for h in handlers:
    h.addFilter(_not_orbax_info)
  try:
    yield
  finally:
    for h in handlers:
      h.removeFilter(_not_orbax_info)


def _check_tree(tree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(leaf, (jax.Array, np.ndarray)):
      raise ValueError(f"checkpoint tree leaf {jax.tree_util.keystr(path)} is "
                       f"{type(leaf).__name__}, not an array (put scalars in metadata)")


def save(path, tree, metadata: Optional[dict] = None) -> Path:
  """Saves `tree` (arrays only) and JSON-serialisable `metadata` to directory `path`.

  Args:
    path: checkpoint directory; must not exist yet.
    tree: pytree of jax/numpy arrays (dicts, lists, tuples).
    metadata: JSON-serialisable dict (e.g. the method, its spec, the calibration config).
  Returns:
    the absolute checkpoint path.
  Raises:
    FileExistsError if `path` exists; ValueError for non-array leaves or non-JSON metadata.
  """
  path = Path(path).expanduser().resolve()
  if path.exists():
    raise FileExistsError(f"checkpoint already exists: {path}")
  _check_tree(tree)
  meta = dict(metadata or {})
  try:
    json.dumps(meta)
  except TypeError as e:
    raise ValueError(f"checkpoint metadata is not JSON-serialisable: {e}") from e
  path.parent.mkdir(parents=True, exist_ok=True)
  with _quiet_orbax(), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(path, ocp.args.Composite(**{_TREE: ocp.args.StandardSave(tree),
                                           _META: ocp.args.JsonSave(meta)}))
  return path


def restore(path) -> tuple[Any, dict]:
  """Restores (tree, metadata) saved by `save`.

  Args:
    path: checkpoint directory.
  Returns:
    (pytree of jax arrays with the saved structure and dtypes, metadata dict).
  Raises:
    FileNotFoundError if `path` is not a checkpoint directory.
  """
  path = Path(path).expanduser().resolve()
  if not (path / _TREE).is_dir():
    raise FileNotFoundError(f"no kvlowrank checkpoint at {path} (missing {_TREE}/)")
  with _quiet_orbax(), ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    out = ckptr.restore(path, ocp.args.Composite(**{_TREE: ocp.args.StandardRestore(),
                                                    _META: ocp.args.JsonRestore()}))
  return out[_TREE], dict(out[_META] or {})


def exists(path) -> bool:
  """Whether `path` holds a completed checkpoint written by `save`."""
  return (Path(path).expanduser() / _TREE).is_dir()
