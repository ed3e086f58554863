r"""Writes the report of a results folder: `kvlowrank.experiment.report.write(workdir)`.

  python experiments/report.py --workdir=runs/main

Reads <workdir>/results.jsonl and writes <workdir>/report.md (one markdown table per
setting: method, bits, KV bytes/token, compression vs bf16, PPL prefill / decode,
tokens, windows) and the PNG Pareto plot(s) of PPL vs KV bytes/token.
"""

from absl import app
from absl import flags

from kvlowrank.experiment import cli
from kvlowrank.experiment import report

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder holding results.jsonl.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: the workdir).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  paths = report.write(_WORKDIR.value, out_dir=_OUT.value)
  cli.print_report(paths)


if __name__ == "__main__":
  cli.run(main, uses_jax=False)
