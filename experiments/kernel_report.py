"""Markdown table and plots of `bench_kernels.py` results (no GPU needed).

  python experiments/kernel_report.py --json a.json,b.json --png_prefix out/kernels

Each JSON is one benchmark call (one machine); rooflines and speed-ups are computed
per call (`kvlowrank.bench.finalize`: bytes / the best dense bandwidth of that call, FLOPs /
that call's matmul rate), so files from different calls are never mixed in one ratio.
Prints the markdown table (µs, % of roofline, × the best dense kernel of the same
configuration) and writes <prefix>_speedup.png and <prefix>_roofline.png: one panel per
model and batch, context on the x axis, the #6 targets as dashed lines.
"""

from __future__ import annotations

import argparse
import json

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position

from kvlowrank.bench import finalize  # noqa: E402  pylint: disable=wrong-import-position

DENSE = ("dense-xla", "dense-cudnn", "dense-triton")
COMPRESSED = ("palu-bf16", "palu-mosaic", "palu-v4", "kivi-2bit", "kivi-mosaic")
TARGETS = {"palu-bf16": 1.8, "palu-mosaic": 1.8, "palu-v4": 2.5, "kivi-2bit": 4.5,
           "kivi-mosaic": 4.5}
COLORS = {"palu-bf16": "tab:olive", "palu-mosaic": "tab:green", "palu-v4": "tab:purple",
          "kivi-2bit": "tab:orange", "kivi-mosaic": "tab:red", "dense-triton": "tab:gray",
          "dense-cudnn": "black", "dense-xla": "tab:brown"}


def load(paths):
  """Main-table records of every call, finalized per call; [(info, records)]."""
  calls = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
    recs = [r for r in d["records"] if not r.get("ablation")]
    if not recs:
      raise SystemExit(f"{path}: no records")
    bw = finalize(recs, d["info"]["matmul_TFLOPs"] * 1e12)
    if bw is None:
      raise SystemExit(f"{path}: no dense baseline timed, so no roofline")
    calls.append((dict(d["info"], dense_best_TBps=bw / 1e12, path=path), recs))
  return calls


def markdown(calls, kernels):
  head = "| model | ctx | B | best dense TB/s | " + " | ".join(kernels) + " |"
  lines = [head, "|" + "---|" * (4 + len(kernels))]
  for _, recs in calls:
    cells = {}
    for r in recs:
      cells.setdefault((r["model"], r["context"], r["batch"]), {})[r["kernel"]] = r
    for (model, s, b), row in sorted(cells.items()):
      dense = [r for k, r in row.items() if k.startswith("dense") and r.get("us")]
      best = max((r["achieved_TBps"] for r in dense), default=float("nan"))
      out = []
      for k in kernels:
        r = row.get(k)
        if r is None:
          out.append("")
        elif not r.get("us"):
          out.append("failed")
        elif k.startswith("dense"):
          out.append(f"{r['us']:.1f}")
        else:
          out.append(f"{r['us']:.1f} ({r['pct_roofline']:.0f}%, {r['speedup_vs_dense']:.2f}×)")
      lines.append(f"| {model} | {s // 1024}K | {b} | {best:.2f} | " + " | ".join(out) + " |")
  return "\n".join(lines)


def plot(calls, field, ylabel, path, targets):
  recs = [r for _, rs in calls for r in rs if r.get("us")]
  models = sorted({r["model"] for r in recs})
  batches = sorted({r["batch"] for r in recs})
  fig, axes = plt.subplots(len(models), len(batches), squeeze=False, sharex=True,
                           figsize=(4.2 * len(batches), 3.4 * len(models)))
  for i, model in enumerate(models):
    for j, b in enumerate(batches):
      ax = axes[i][j]
      for k in (COMPRESSED if targets else COMPRESSED + ("dense-triton",)):
        pts = sorted((r["context"], r[field]) for r in recs
                     if r["model"] == model and r["batch"] == b and r["kernel"] == k)
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[k], label=k)
          if targets:
            ax.axhline(TARGETS[k], color=COLORS[k], ls="--", lw=0.8)
      if targets:
        ax.axhline(1.0, color="black", lw=0.8)
      else:
        ax.axhline(75.0, color="black", ls="--", lw=0.8)
      ax.set_xscale("log", base=2)
      ax.set_title(f"{model}, batch {b}", fontsize=10)
      ax.grid(alpha=0.3)
      if j == 0:
        ax.set_ylabel(ylabel)
      if i == len(models) - 1:
        ax.set_xlabel("context (tokens)")
  axes[0][0].legend(fontsize=7)
  dev = calls[0][0]
  fig.suptitle(f"{dev['device']}, JAX {dev['jax']}, {dev['date']} "
               f"({'dashed: targets' if targets else 'dashed: 75% target'})", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--json", required=True, help="comma-separated bench_kernels.py outputs")
  ap.add_argument("--png_prefix", default=None, help="write <prefix>_speedup/_roofline.png")
  args = ap.parse_args(argv)
  calls = load(args.json.split(","))
  present = {r["kernel"] for _, rs in calls for r in rs}
  # The benchmark's row names in table order, then any other kernel the files hold.
  kernels = [k for k in DENSE + COMPRESSED if k in present] + sorted(
      present - set(DENSE + COMPRESSED))
  for info, _ in calls:
    print(f"{info['path']}: {info['device']}, JAX {info['jax']}, {info['date']}; copy "
          f"{info['copy_TBps']:.2f} TB/s, read {info['read_TBps']:.2f} TB/s, matmul "
          f"{info['matmul_TFLOPs']:.0f} TFLOP/s, best dense {info['dense_best_TBps']:.2f} TB/s")
  print(markdown(calls, kernels))
  if args.png_prefix:
    plot(calls, "speedup_vs_dense", "× best dense", args.png_prefix + "_speedup.png", True)
    plot(calls, "pct_roofline", "% of roofline", args.png_prefix + "_roofline.png", False)
    print(f"wrote {args.png_prefix}_speedup.png, {args.png_prefix}_roofline.png")


if __name__ == "__main__":
  main()
