r"""The long-context job: `kvlowrank.experiment.longctx.run_file(...)`.

  python experiments/longctx.py --config=configs/longctx.py --workdir=runs/longctx

Passkey and needle-in-a-haystack accuracy (and LongBench / RULER when online) of every
method of the config's get_sweep(), per context and depth, each prompt prefilled into
the method's cache and answered by greedy decoding. Resumable: finished prompts in
<workdir>/results.jsonl are skipped, so an interrupted run continues where it stopped.
Writes longctx.md, longctx_accuracy.png and heatmap_<method>.png into the workdir.
A bad config, a missing file or an unreachable dataset ends in one line and exit 1
(--debug shows the traceback).
"""

import os

# Before numpy loads OpenBLAS (see experiments/sweep.py): Palu's calibration.
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
from kvlowrank.experiment import longctx

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to configs/longctx.py (with an optional :arg).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (results.jsonl, plots).")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N methods of the sweep.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  summary = longctx.run_file(config_flags.get_config_filename(flags.FLAGS["config"]),
                             _CONFIG.value, _WORKDIR.value, limit=_LIMIT.value)
  logging.info("python %s, jax %s, kvlowrank %s, devices %s", platform.python_version(),
               jax.__version__, kvlowrank.__version__, jax.devices())
  print(f"longctx: {summary['ran']} prompts run, {summary['skipped']} already finished")
  print(f"results:  {summary['results']}")
  if "markdown" in summary:
    cli.print_report(summary)


if __name__ == "__main__":
  cli.run(main)
