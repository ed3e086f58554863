"""Sweeps: a config file's `get_sweep()` -> many evaluations, resumable.

A config file used with experiments/sweep.py defines, beside `get_config(arg)`,
`get_sweep(arg)` (or `get_sweep()`) returning a list of points: dicts from dotted config
keys to values, e.g. [{"method": "dense"}, {"method": "kivi", "kivi.bits": 4}]. Each
point is applied to the command-line config (kvlowrank.experiment.config
.apply_overrides) and evaluated with kvlowrank.experiment.evaluate.run.

Resumability: a point's key is the hash of its resolved config; its record is appended
atomically to workdir/results.jsonl when it finishes. A rerun skips every point whose
key is already there, so an interrupted sweep loses no finished point and repeats none.

Infeasible points: before any point runs, every point is checked against its model
(`check`: the method's feasibility, e.g. Palu's rank budget or a KIVI group size, the
context lengths, the data and calibration files). A point that fails a check, or whose
evaluation raises a ValueError / OSError (e.g. a text too short for one window), is
recorded as a failed result (`"status": "failed"` and the one-line `error`) and the
sweep goes on; the report lists it. `fail_fast=True` stops at the first such point
instead, before any work when the check finds it. A rerun tries failed points again.
"""

from __future__ import annotations

import datetime
import inspect
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import jax

from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, models, records, report
from kvlowrank.experiment.spec import from_config

log = logging.getLogger(__name__)


def load_points(config_path: str) -> list[dict[str, Any]]:
  """Calls `get_sweep` of a config file.

  Args:
    config_path: "path/to/config.py" or "path/to/config.py:arg" (the arg goes to
      get_sweep(arg) when it takes one).
  Returns:
    the list of points.
  Raises:
    FileNotFoundError / ValueError naming the file when it has no valid get_sweep.
  """
  module, arg = config_lib.load_file(config_path)
  path = config_path.partition(":")[0]
  fn = getattr(module, "get_sweep", None)
  if fn is None:
    raise ValueError(f"{path} defines no get_sweep(); experiments/sweep.py needs one")
  points = fn(arg or None) if inspect.signature(fn).parameters else fn()
  if not isinstance(points, (list, tuple)) or not all(isinstance(p, dict) for p in points):
    raise ValueError(f"{path}: get_sweep() must return a list of dicts, got {points!r}")
  return list(points)


def resolve(config, points: Sequence[dict]) -> list[tuple[dict, Any, str]]:
  """(point, resolved config, key) for every point.

  Raises:
    ValueError for a point that names a key the config does not have or a value of the
    wrong type (a mistake in the sweep file, not an infeasible point: see `check`).
  """
  out = []
  for i, point in enumerate(points):
    try:
      cfg = config_lib.apply_overrides(config, point)
    except ValueError as e:
      raise ValueError(f"sweep point {i} {point!r}: {e}") from e
    out.append((point, cfg, config_lib.config_hash(cfg)))
  return out


def check(cfg) -> None:
  """Every check of one resolved point that needs no evaluation work: its config, its
  model's (loaded, memoised) fit, its files. Raises ValueError / FileNotFoundError."""
  exp = from_config(cfg)
  from_config(cfg, models.load(exp.model.path, exp.model.dtype).spec)


def failed_record(point: dict, cfg, key: str, error: BaseException) -> dict:
  """The record of a point that could not run (kvlowrank.experiment.records.failed)."""
  return {"key": key, "status": "failed", "point": point, "config": cfg.to_dict(),
          "method": cfg.method, "error": f"{type(error).__name__}: {error}",
          "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run(config, workdir, points: Sequence[dict], *, results_name: str = records.RESULTS,
        fail_fast: bool = False) -> dict[str, Any]:
  """Runs the unfinished points of a sweep, then (if config.write_report) the report.

  Args:
    config: base ConfigDict (command-line overrides applied).
    workdir: output folder; results in workdir/results_name.
    points: list of dotted-key override dicts.
    results_name: JSONL file name.
    fail_fast: raise at the first infeasible or failing point (module docstring)
      instead of recording it as failed and going on.
  Returns:
    {"ran": n, "skipped": n, "failed": [(point, error), ...], "results": path, and the
    report's paths when written}.
  """
  workdir = Path(workdir)
  results = workdir / results_name
  resolved = resolve(config, points)
  done = records.done_keys(results)
  errors: dict[str, BaseException] = {}
  for i, (point, cfg, key) in enumerate(resolved):  # before any point runs
    if key in done:
      continue
    try:
      check(cfg)
    except (ValueError, FileNotFoundError) as e:
      if fail_fast:
        raise type(e)(f"sweep point {i} {point!r}: {e}") from e
      errors[key] = e
  ran = skipped = 0
  failed: list[tuple[dict, str]] = []
  bar = None
  if config.progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(resolved), desc="sweep", unit="point")
  for i, (point, cfg, key) in enumerate(resolved):
    if key in done:
      skipped += 1
      log.info("skip finished point %s %s", key, point)
    else:
      error = errors.get(key)
      if error is None:
        log.info("run point %s %s", key, point)
        try:
          evaluate.run(cfg, workdir, results_name=results_name)
        except (ValueError, OSError) as e:
          if fail_fast:
            raise type(e)(f"sweep point {i} {point!r}: {e}") from e
          error = e
        finally:
          # Each point compiles its own model/cache functions; JAX keeps every executable,
          # and on the CPU each maps its code into the process. A long sweep would grow
          # towards Linux's vm.max_map_count (65530), where XLA's next compilation
          # segfaults (seen in one long pytest process), so the caches go between points.
          jax.clear_caches()
      if error is None:
        done.add(key)
        ran += 1
      else:
        log.warning("sweep point %d %s failed: %s", i, point, error)
        records.append(results, failed_record(point, cfg, key, error), replace=True)
        failed.append((point, f"{type(error).__name__}: {error}"))
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  summary: dict[str, Any] = {"ran": ran, "skipped": skipped, "failed": failed,
                             "results": str(results)}
  if config.write_report and results.exists():
    summary.update(report.write(workdir, results_name=results_name))
  return summary


def run_file(config_path: str, config, workdir, *, limit: Optional[int] = None,
             fail_fast: bool = False) -> dict[str, Any]:
  """`run` with the points of `config_path`'s get_sweep (the launcher's entry point).

  Args:
    config_path: the --config flag value (path[:arg]).
    config: the parsed config.
    workdir: output folder.
    limit: evaluate only the first `limit` points (None = all).
    fail_fast: stop at the first infeasible point (see `run`).
  """
  points = load_points(config_path)
  return run(config, workdir, points[:limit] if limit else points, fail_fast=fail_fast)
