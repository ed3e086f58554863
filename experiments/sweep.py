r"""Runs a config's sweep, resumably: `kvlowrank.experiment.sweep.run_file(...)`.

  python experiments/sweep.py --config=configs/main.py --workdir=runs/main

Every point of the config file's get_sweep() is applied to the config (command-line
overrides included) and evaluated; finished points (keyed by the hash of their resolved
config) found in <workdir>/results.jsonl are skipped, so an interrupted sweep is resumed
by rerunning the same command. With config.write_report the markdown table and the
Pareto plot are written at the end. An infeasible point is recorded as failed with its
reason and the sweep goes on (--fail_fast stops instead, before any work).
"""

import os

# Before numpy loads OpenBLAS: on small CPU boxes its worker threads spin against
# XLA:CPU's thread pool, and Palu's float64 SVD/Cholesky calibration ran an order of
# magnitude slower on 2 cores. Set OPENBLAS_NUM_THREADS to override.
if (os.cpu_count() or 1) <= 4:
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import platform

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import kvlowrank
from kvlowrank.experiment import cli
from kvlowrank.experiment import sweep

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a configs/*.py file defining get_sweep().", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (results.jsonl, report).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N points of the sweep.")
_FAIL_FAST = flags.DEFINE_bool("fail_fast", False, "Stop at the first infeasible point "
                               "instead of recording it as failed and going on.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.info("python %s, jax %s, kvlowrank %s, devices %s", platform.python_version(),
               jax.__version__, kvlowrank.__version__, jax.devices())
  summary = sweep.run_file(config_flags.get_config_filename(flags.FLAGS["config"]),
                           _CONFIG.value, _WORKDIR.value, limit=_LIMIT.value,
                           fail_fast=_FAIL_FAST.value)
  print(f"sweep: {summary['ran']} points run, {summary['skipped']} already finished, "
        f"{len(summary['failed'])} failed")
  for point, error in summary["failed"]:
    print(f"failed:   {point}: {error}")
  print(f"results:  {summary['results']}")
  if "markdown" in summary:
    cli.print_report(summary)


if __name__ == "__main__":
  cli.run(main)
