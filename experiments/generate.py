r"""Generates a continuation of one prompt: `kvlowrank.generate.run(config, workdir)`.

  python experiments/generate.py --config=configs/generate.py [--workdir=/tmp/gen]

The logic lives in kvlowrank.generate (importable, testable); this file only parses
flags, logs the environment and writes config.json into the workdir.
"""

import json
import os
import platform
import sys

from absl import app
from absl import flags
from absl import logging
import jax
import jaxlib
from ml_collections import config_flags

import kvlowrank
from kvlowrank.experiment import cli
import kvlowrank.generate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a configs/*.py file (with an optional :arg).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Optional output folder for config.json "
                               "and generation.json.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  logging.info("python %s, jax %s, jaxlib %s, kvlowrank %s", platform.python_version(),
               jax.__version__, jaxlib.__version__, kvlowrank.__version__)
  logging.info("devices: %s", jax.devices())
  workdir = _WORKDIR.value
  result = kvlowrank.generate.run(config, workdir)
  if workdir:  # after the run: nothing is written before the model and prompt load
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=1))
  logging.info("result: %s", json.dumps(result))
  print(f"{result['prompt']!r} ->\n{result['completion']}")
  print(f"[{len(result['completion_ids'])} tokens, stop: {result['stop_reason']}, "
        f"load {result['load_s']} s, generate {result['generate_s']} s]", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
