"""Long-context results -> markdown tables + PNG plots in the workdir.

  longctx.md                 accuracy per method x context for each task (mean score over
                             depths and samples), and per method the depth x context grid
  longctx_accuracy.png       accuracy vs context, one line per method, one panel per task
  heatmap_<label>.png        per method: depth x context accuracy, one panel per task

Within the results the latest record of each key wins. LongBench / RULER records (no
depth) are averaged per subset into their own table.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from kvlowrank.experiment import records

SYNTHETIC = ("passkey", "needle")


def latest(recs: list[dict]) -> list[dict]:
  by_key: dict[str, dict] = {}
  for r in recs:
    by_key[r["key"]] = r
  return list(by_key.values())


def _labels(recs) -> list[str]:
  seen = []
  for r in recs:
    if r["label"] not in seen:
      seen.append(r["label"])
  return seen


def accuracy(recs, label: str, task: str, context: int, depth=None) -> float:
  """Mean score of the matching records (nan when none)."""
  s = [r["score"] for r in recs if r["label"] == label and r["task"] == task and
       r["context"] == context and (depth is None or r.get("depth") == depth)]
  return float(np.mean(s)) if s else float("nan")


def _fmt(x: float, n: int = 0) -> str:
  return "—" if np.isnan(x) else f"{x:.2f}" + (f" ({n})" if n else "")


def markdown(recs: list[dict]) -> str:
  out = []
  labels = _labels(recs)
  for task in SYNTHETIC:
    rs = [r for r in recs if r["task"] == task]
    if not rs:
      continue
    ctxs = sorted({r["context"] for r in rs})
    out.append(f"### {task}: accuracy (exact match) vs context\n")
    out.append("| method | " + " | ".join(str(c) for c in ctxs) + " | all |")
    out.append("|---|" + "---|" * (len(ctxs) + 1))
    for lab in labels:
      row = [_fmt(accuracy(rs, lab, task, c)) for c in ctxs]
      mine = [r["score"] for r in rs if r["label"] == lab]
      out.append(f"| {lab} | " + " | ".join(row) + f" | {_fmt(float(np.mean(mine)) if mine else np.nan)} |")
    out.append("")
    depths = sorted({r["depth"] for r in rs})
    out.append(f"#### {task}: depth x context (rows: depth; cells: accuracy)\n")
    for lab in labels:
      out.append(f"{lab}:\n")
      out.append("| depth | " + " | ".join(str(c) for c in ctxs) + " |")
      out.append("|---|" + "---|" * len(ctxs))
      for d in depths:
        out.append(f"| {d:.2f} | " + " | ".join(_fmt(accuracy(rs, lab, task, c, d))
                                                 for c in ctxs) + " |")
      out.append("")
  hf = [r for r in recs if r["task"] not in SYNTHETIC]
  if hf:
    out.append("### LongBench / RULER: mean score per subset\n")
    out.append("| method | benchmark | subset | score | samples |")
    out.append("|---|---|---|---|---|")
    for lab in labels:
      for key in sorted({(r["task"], r["subset"]) for r in hf if r["label"] == lab}):
        s = [r["score"] for r in hf if r["label"] == lab and (r["task"], r["subset"]) == key]
        out.append(f"| {lab} | {key[0]} | {key[1]} | {np.mean(s):.3f} | {len(s)} |")
  return "\n".join(out) + "\n"


def _safe(label: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def plots(recs: list[dict], workdir: Path) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = [t for t in SYNTHETIC if any(r["task"] == t for r in recs)]
  if not tasks:
    return []
  labels = _labels(recs)
  paths = []
  fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    rs = [r for r in recs if r["task"] == task]
    ctxs = sorted({r["context"] for r in rs})
    for k, lab in enumerate(labels):  # distinct markers/dashes: equal lines stay visible
      ax.plot(ctxs, [accuracy(rs, lab, task, c) for c in ctxs], marker="osD^vP*X"[k % 8],
              linestyle=("-", "--", ":", "-.")[k % 4], markersize=8 - (k % 4), label=lab)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs, [str(c) for c in ctxs])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("accuracy (exact match)")
    ax.set_title(task)
    ax.grid(alpha=0.3)
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  p = workdir / "longctx_accuracy.png"
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(str(p))
  for lab in labels:
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
      rs = [r for r in recs if r["task"] == task and r["label"] == lab]
      ctxs = sorted({r["context"] for r in rs})
      depths = sorted({r["depth"] for r in rs})
      grid = np.array([[accuracy(rs, lab, task, c, d) for c in ctxs] for d in depths])
      im = ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap="RdYlGn",
                     aspect="auto")
      ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs])
      ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
      for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "·" if np.isnan(v) else f"{v:.1f}", ha="center", va="center",
                fontsize=8)
      ax.set_xlabel("context (tokens)")
      ax.set_ylabel("depth")
      ax.set_title(f"{lab}: {task}")
    fig.subplots_adjust(wspace=0.4, bottom=0.15)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    p = workdir / f"heatmap_{_safe(lab)}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
  return paths


def write(workdir, *, results_name: str = records.RESULTS, keys=None) -> dict[str, Any]:
  """Writes longctx.md and the PNGs; returns {"markdown": path, "plots": [paths]}.

  keys: only these records (the run's grid; records of other grids in the same file
  are left out so that every method is averaged over the same cells); None = all.
  """
  workdir = Path(workdir)
  recs = latest(records.read(workdir / results_name))
  if keys is not None:
    recs = [r for r in recs if r["key"] in keys]
  md = workdir / "longctx.md"
  md.write_text(markdown(recs), encoding="utf-8")
  return {"markdown": str(md), "plots": plots(recs, workdir)}
