r"""Whole-model decode runs side by side (`kvlowrank.bench.compare`; no GPU needed).

  cd experiments/results && python ../decode_report.py --png /tmp/h200_vs_h100.png \
      --json decode_l3_all_h200_2026-11-27.json,decode_l3_h100_2026-11-28.json

Each JSON is one `bench_decode.py` call (another device, or another commit). Prints a
markdown table of the rows every run has (tokens/s, step = attention + rest, each run's
attention ÷ the first run's) and, with --png, a plot of the steps split the same way.
"""

from absl import app
from absl import flags

from kvlowrank.bench import compare
from kvlowrank.experiment import cli

_JSON = flags.DEFINE_list("json", None, "bench_decode.py JSON files (the first is the base).")
_PNG = flags.DEFINE_string("png", None, "Plot output path.")
_TITLE = flags.DEFINE_string("title", "", "Plot title.")
flags.mark_flags_as_required(["json"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = [compare.load(p) for p in _JSON.value]
  labels = [compare.label(r, p) for r, p in zip(results, _JSON.value)]
  rows = compare.rows(results)
  print(compare.table(rows, labels))
  if _PNG.value:
    compare.plot(rows, labels, _PNG.value, _TITLE.value)
    print(f"wrote {_PNG.value}")


if __name__ == "__main__":
  cli.run(main, uses_jax=False)
