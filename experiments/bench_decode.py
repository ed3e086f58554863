r"""Whole-model decode benchmark: `kvlowrank.bench.decode.run` for one model on this GPU.

  python experiments/bench_decode.py --model=llama3-8b --out=$OUT/decode_l3.json \
      --png=$OUT/decode_l3.png

Prints a markdown table (tokens/s, x dense, the step split into attention and the rest,
cache bytes = nbytes(), peak bytes, the largest batch), writes the JSON (with the device
and versions) and a plot of tokens/s per method. Results and the command used for the
current tables: BENCHMARKS.md.

Several GPUs of one host (`kvlowrank.parallel`: KV heads over "model", rows over "data"):

  python experiments/bench_decode.py --model=llama3-70b --mesh=1x4 --methods=dense,kivi2,palu50 \
      --configs=32768x8,32768x32
"""

from absl import app
from absl import flags

from kvlowrank.bench import decode, ops
from kvlowrank.experiment import cli
from kvlowrank.bench.env import environment
from kvlowrank.experiment import records

_MODEL = flags.DEFINE_enum("model", "llama3-8b", sorted(decode.MODELS), "Model shape.")
_METHODS = flags.DEFINE_list("methods", list(decode.METHODS), "Methods (decode.METHODS).")
_CONFIGS = flags.DEFINE_list(
    "configs", ["32768x8", "8192x8", "32768x1", "8192x1", "8192x32", "32768x32"],
    "CONTEXTxBATCH pairs in priority order (each runs every method before the next).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed decode steps per configuration.")
_LAYERS = flags.DEFINE_integer("layers", 0, "Layers (0: the model's).")
_PREFILL = flags.DEFINE_list("prefill_methods", [], "Methods whose long prefill is timed.")
_PREFILL_LEN = flags.DEFINE_integer("prefill_length", 32768, "Prefill prompt length.")
_BUDGET = flags.DEFINE_float("time_budget", 1e9, "Seconds; later configurations are skipped.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (rewritten after every record: a cut run keeps them; "
    "`complete` is true once the run finished).")
_PNG = flags.DEFINE_string("png", None, "Plot output path (tokens/s per method).")
_PROFILE = flags.DEFINE_bool("profile", False,
                              "Also trace each step: device time per XLA op and category "
                              "(GPU 0's on a mesh; all-reduces as collectives).")
_MESH = flags.DEFINE_string("mesh", None, "DATAxMODEL devices (e.g. 1x4); default: one GPU.")
_CHECK_BATCH = flags.DEFINE_bool(
    "check_max_batch", False,
    "After each method's first record at a context, allocate and run its estimated largest "
    "batch there (two steps) and record whether it fits.")


def plot(result, path):
  """Tokens/s per method, one panel per context, batches side by side."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  recs = result["records"]
  contexts = sorted({r["context"] for r in recs})
  methods = list(dict.fromkeys(r["method"] for r in recs))
  fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts) + 1.5, 4),
                           squeeze=False)
  width = 0.8 / max(1, len(methods))
  for ax, ctx in zip(axes[0], contexts):
    batches = sorted({r["batch"] for r in recs if r["context"] == ctx})  # this panel's
    for i, m in enumerate(methods):
      vals = [next((r["tokens_per_s"] for r in recs if (r["method"], r["context"], r["batch"])
                    == (m, ctx, b)), 0.0) for b in batches]
      ax.bar([j + i * width for j in range(len(batches))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))],
                  [f"B={b}" for b in batches])
    ax.set_title(f"{result['model']}, {ctx // 1024}K context")
    ax.set_ylabel("decode tokens/s")
  axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    configs = [tuple(int(x) for x in c.lower().split("x")) for c in _CONFIGS.value]
  except ValueError:
    raise app.UsageError(f"--configs: expected CONTEXTxBATCH pairs, got {_CONFIGS.value}")
  mesh = None
  if _MESH.value:
    try:
      mesh = tuple(int(x) for x in _MESH.value.lower().split("x"))
      assert len(mesh) == 2
    except (ValueError, AssertionError):
      raise app.UsageError(f"--mesh: expected DATAxMODEL, got {_MESH.value!r}")
  env = environment()
  save = None
  if _OUT.value:
    save = lambda res: records.write_json(_OUT.value, dict(res, environment=env))
  result = decode.run(_MODEL.value, methods=_METHODS.value, configs=configs,
                      steps=_STEPS.value,
                      n_layers=_LAYERS.value or None, prefill_methods=_PREFILL.value,
                      prefill_length=_PREFILL_LEN.value, time_budget_s=_BUDGET.value,
                      log=lambda s: print(s, flush=True), mesh=mesh,
                      profile=_PROFILE.value, check_batch=_CHECK_BATCH.value,
                      on_progress=save)
  result["environment"] = env
  print(decode.table(result))
  for rec in result["records"]:
    if rec.get("step_ops"):
      so = rec["step_ops"]
      print(f"\n{rec['method']} ctx={rec['context']} B={rec['batch']}: kernels busy "
            f"{1e3 * so['total_s']:.2f} ms (all streams), the compute stream "
            f"{1e3 * so['stream_busy_s']:.2f} ms, of the {rec['step_ms']:.2f} ms step"
            f"\n{ops.op_table(so)}")
  for s in result["skipped"]:
    print(f"not run: {s['method']} ctx={s['context']} B={s['batch']}: {s['why']}")
  if save is not None:
    save(result)
    print(f"wrote {_OUT.value}")
  if _PNG.value and result["records"]:
    plot(result, _PNG.value)
    print(f"wrote {_PNG.value}")


if __name__ == "__main__":
  cli.run(main, uses_jax=False)
