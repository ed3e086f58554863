r"""Evaluates one config: `kvlowrank.experiment.evaluate.run(config, workdir)`.

  python experiments/evaluate.py --config=configs/kivi.py:bits=4 --workdir=runs/kivi4

Appends one JSON record (perplexity per mode, KV bytes/token, ...) to
<workdir>/results.jsonl and prints it; calibrations are cached in <workdir>/calib/.
A point already in the workdir is skipped (--overwrite evaluates and replaces it). A bad
config or file ends in one line naming it and exit status 1 (--debug: the traceback).
"""

import os

# Before numpy loads OpenBLAS: on small CPU boxes its worker threads spin against
# XLA:CPU's thread pool, and Palu's float64 SVD/Cholesky calibration ran an order of
# magnitude slower on 2 cores. Set OPENBLAS_NUM_THREADS to override.
if (os.cpu_count() or 1) <= 4:
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import platform

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import kvlowrank
from kvlowrank.experiment import cli
from kvlowrank.experiment import evaluate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a configs/*.py file (with an optional :arg).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (results.jsonl, calib/).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Evaluate a point the workdir already "
                               "holds again and replace its record (default: skip it).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.info("python %s, jax %s, kvlowrank %s, devices %s", platform.python_version(),
               jax.__version__, kvlowrank.__version__, jax.devices())
  record = evaluate.run(_CONFIG.value, _WORKDIR.value, overwrite=_OVERWRITE.value)
  if record.get("skipped"):
    print(f"point {record['key']} is already in {_WORKDIR.value}/results.jsonl: skipped "
          "(--overwrite evaluates it again)")
    return
  summary = {k: record[k] for k in ("key", "method", "bits", "kv_bytes_per_token",
                                    "compression_vs_bf16", "tokens", "windows")}
  summary.update({k: v for k, v in record.items() if k.startswith("ppl_")})
  print(json.dumps(summary, indent=1))
  print(f"appended to {_WORKDIR.value}/results.jsonl")


if __name__ == "__main__":
  cli.run(main)
