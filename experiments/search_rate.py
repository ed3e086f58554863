r"""Binary search of the largest FDC/ZACK removal rate whose perplexity stays within 1% of
dense on held-out WikiText-2 validation windows that share no token with the calibration
windows (`kvlowrank.data.held_out`; the papers' "99% of baseline accuracy", translated to
perplexity): `kvlowrank.methods.rotated.search.run_config_search`.

  python experiments/search_rate.py --config=configs/fdc.py --workdir=runs/fdc_search
  python experiments/search_rate.py --config=configs/zack.py:calibration=data \
      --workdir=runs/zack_search --tolerance=0.01 --steps=6

Prints one line per evaluated rate and writes <workdir>/search_<method>.json (the rate, its
perplexity and widths, the fraction of KV dims removed, the history, the token offsets of
the held-out and calibration windows).
"""

import os

# Before numpy loads OpenBLAS (see experiments/evaluate.py).
if (os.cpu_count() or 1) <= 4:
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from kvlowrank import config_lib
from kvlowrank.methods.rotated import search

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/fdc.py or configs/zack.py (with an optional :arg).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (search_<method>.json).")
_TOL = flags.DEFINE_float("tolerance", 0.01, "PPL bound: (1 + tolerance) x dense.")
_HI = flags.DEFINE_float("hi", 0.5, "Upper end of the searched rates, < 1.")
_STEPS = flags.DEFINE_integer("steps", 8, "Bisection steps after the two ends.")
_WINDOWS = flags.DEFINE_integer("held_out_windows", 4, "Validation windows scored (disjoint "
                                   "from the calibration windows).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  record = search.run_config_search(_CONFIG.value, _WORKDIR.value, tolerance=_TOL.value,
                                    hi=_HI.value, steps=_STEPS.value,
                                    held_out_windows=_WINDOWS.value)
  print(json.dumps({k: record[k] for k in ("method", "rate", "ppl", "dense_ppl", "bound",
                                           "kv_dims_removed", "path")}, indent=1))


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main, flags_parser=config_lib.flags_parser)
