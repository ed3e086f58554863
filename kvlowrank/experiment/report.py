"""Results JSONL -> markdown table + PNG Pareto plot (PPL vs KV bytes per token).

Records are grouped by setting (model, dataset/split, seq_len, number of windows); each
setting gets a table and a plot. Within a setting the latest record of each config key
wins. The bf16 dense row is the baseline: compression ratios are bf16 bytes / method
bytes, and the plot marks it with a star and a dotted line at its PPL. Records with a
generation-drift measurement (eval.drift_tokens > 0) fill the "greedy match" and "KL"
columns; others show a dash.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from kvlowrank.experiment import records

COLUMNS = ("method", "bits", "KV bytes/token", "compression vs bf16", "PPL prefill",
           "PPL decode", "greedy match", "KL", "tokens", "windows")
_MODES = ("prefill", "decode")


def _setting(r: dict) -> tuple:
  return (r["model"]["path"], r["data"]["dataset"], r["data"]["split"], r["seq_len"],
          r["windows"])


def _is_baseline(r: dict) -> bool:
  return r["method"] == "dense" and r.get("cache_dtype") == "bfloat16"


def group(recs: list[dict]) -> dict[tuple, list[dict]]:
  """{setting: records (latest per key), baseline first then by decreasing bytes}."""
  latest: dict[str, dict] = {}
  for r in recs:
    latest[r["key"]] = r  # file order = time order
  groups: dict[tuple, list[dict]] = {}
  for r in latest.values():
    groups.setdefault(_setting(r), []).append(r)
  for rows in groups.values():
    rows.sort(key=lambda r: (not _is_baseline(r), -r["kv_bytes_per_token"], r["method"],
                             str(r["bits"])))
  return groups


def _fmt_ppl(r: dict, mode: str) -> str:
  v = r.get(f"ppl_{mode}")
  return "—" if v is None else f"{v:.3f}"


def _fmt_drift(r: dict) -> tuple[str, str]:
  """(greedy match, KL) cells: generation drift vs the dense model (kvlowrank.eval.drift)."""
  d = r.get("drift")
  if not d:
    return "—", "—"
  return f"{d['greedy_match']:.3f}", f"{d['kl']:.3g}"


def markdown(groups: dict[tuple, list[dict]]) -> str:
  """Markdown tables, one per setting."""
  out = []
  for (model, dataset, split, seq_len, windows), rows in groups.items():
    out.append(f"### {model} — {dataset}/{split}, seq_len {seq_len}, {windows} windows\n")
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "---|" * len(COLUMNS))
    for r in rows:
      name = r["method"] + (" (baseline)" if _is_baseline(r) else "")
      out.append("| " + " | ".join([
          name, str(r["bits"]), f"{r['kv_bytes_per_token']:.0f}",
          f"{r['compression_vs_bf16']:.2f}x", _fmt_ppl(r, "prefill"), _fmt_ppl(r, "decode"),
          *_fmt_drift(r), str(r["tokens"]), str(r["windows"])]) + " |")
    drifts = sorted({(d["n_prompts"], d["n_tokens"], d["prompt_len"])
                     for d in (r.get("drift") for r in rows) if d})
    if drifts:
      sizes = "; ".join(f"{p} prompts x {n} tokens after {pl} prompt tokens"
                        for p, n, pl in drifts)
      out.append(f"\ngreedy match / KL: generation drift against the dense model with the "
                 f"same cache dtype (kvlowrank.eval.drift): the fraction of identical greedy "
                 f"tokens, and the mean KL(dense || method) in nats of the next-token "
                 f"distributions along the dense greedy trajectory; {sizes}.")
    out.append("")
  return "\n".join(out)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """The (bytes, ppl) points not dominated by a point with fewer-or-equal bytes and lower
  PPL, sorted by bytes."""
  front, best = [], math.inf
  for x, y in sorted(points, key=lambda p: (p[0], p[1])):
    if y < best:
      front.append((x, y))
      best = y
  return front


def plot(rows: list[dict], png: Path, title: str) -> None:
  """PPL vs KV bytes/token, one series per mode, Pareto fronts, baseline marked."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(7, 4.5))
  markers, colors = {"prefill": "o", "decode": "^"}, {"prefill": "C0", "decode": "C1"}
  for mode in _MODES:
    pts = [(r["kv_bytes_per_token"], r[f"ppl_{mode}"], r) for r in rows
           if r.get(f"ppl_{mode}") is not None]
    if not pts:
      continue
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[mode],
               color=colors[mode], label=f"{mode} mode", zorder=3)
    front = pareto([(x, y) for x, y, _ in pts])
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color=colors[mode],
            alpha=0.5, lw=1)
    for x, y, r in pts:
      if mode == "decode" or r.get("ppl_decode") is None:
        ax.annotate(f"{r['method']}-{r['bits']}", (x, y), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    for x, y, r in pts:
      if _is_baseline(r):
        ax.scatter([x], [y], marker="*", s=220, color="k", zorder=4,
                   label="bf16 baseline" if mode == _MODES[0] else None)
        ax.axhline(y, color=colors[mode], ls=":", lw=1)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("KV cache bytes per token (all layers)")
  ax.set_ylabel("perplexity")
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  plt.close(fig)


def write(workdir, *, results_name: str = records.RESULTS, out_dir=None) -> dict[str, Any]:
  """Writes report.md and one pareto PNG per setting.

  Args:
    workdir: folder holding results_name.
    results_name: JSONL file name.
    out_dir: where to write (default: workdir).
  Returns:
    {"markdown": path, "plots": [paths]}.
  Raises:
    FileNotFoundError when there are no results.
  """
  workdir = Path(workdir)
  recs = records.read(workdir / results_name)
  if not recs:
    raise FileNotFoundError(f"no results to report in {workdir / results_name}")
  out_dir = Path(out_dir) if out_dir else workdir
  out_dir.mkdir(parents=True, exist_ok=True)
  groups = group(recs)
  plots = []
  for i, (setting, rows) in enumerate(groups.items()):
    model, dataset, split, seq_len, windows = setting
    name = "pareto.png" if len(groups) == 1 else (
        f"pareto_{i}_{re.sub(r'[^A-Za-z0-9]+', '_', Path(str(model)).name)}.png")
    title = f"{Path(str(model)).name} — {dataset}/{split}, {windows} x {seq_len} tokens"
    plot(rows, out_dir / name, title)
    plots.append(str(out_dir / name))
  md = out_dir / "report.md"
  body = markdown(groups)
  body += "\n" + "\n".join(f"![Pareto plot]({Path(p).name})" for p in plots) + "\n"
  md.write_text("# KV-cache compression: perplexity vs KV bytes per token\n\n" + body)
  return {"markdown": str(md), "plots": plots}
