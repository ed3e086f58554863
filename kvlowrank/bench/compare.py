"""Whole-model decode runs side by side: where two devices (or two commits) differ.

Each input is the JSON of one `experiments/bench_decode.py` call (`kvlowrank.bench.decode`'s
result with its `environment`), on one GPU or a mesh (`--mesh`: one GPU against two is the
scaling). Rows are matched by (method, context, batch). Per run a row
keeps the step, its attention (one layer's `attend` timed alone x layers) and the rest; the
ratio of a run's attention to the first run's says what limits a kernel: a kernel that the
memory bandwidth limits takes longer on the device of lower bandwidth by about the bandwidth
ratio, one that the multiprocessors limit (latency, tensor work) takes the same time on two
devices with the same multiprocessors. Used for BENCHMARKS.md "Which kernels the bandwidth
limits" (H100 vs H200).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

from kvlowrank.bench.decode import context_label


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run's numbers for one row."""
  tokens_per_s: float
  step_ms: float
  attention_ms: Optional[float]   # None where the run has no attention split (XQuant-CL)

  @property
  def rest_ms(self) -> Optional[float]:
    return None if self.attention_ms is None else self.step_ms - self.attention_ms


@dataclasses.dataclass(frozen=True)
class Row:
  method: str
  context: int
  batch: int
  cells: tuple[Cell, ...]         # one per run, in the runs' order

  def attention_ratios(self) -> tuple[Optional[float], ...]:
    """Each run's attention ÷ the first run's (None where either has no split)."""
    first = self.cells[0].attention_ms
    return tuple(None if first is None or c.attention_ms is None else c.attention_ms / first
                 for c in self.cells)


def load(path: str) -> dict:
  """A bench_decode JSON, with one-line errors naming the file."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"--json: no file {path}")
  try:
    with open(path) as f:
      result = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"--json: {path} is not JSON ({e.msg}, line {e.lineno})") from None
  if not isinstance(result, dict) or not isinstance(result.get("records"), list):
    raise ValueError(f"--json: {path} has no 'records' list (not a bench_decode.py result)")
  return result


def label(result: dict, path: str = "") -> str:
  """The run's device, mesh and date (`environment`, the records' mesh), else the file's
  name."""
  env = result.get("environment") or {}
  device = str(env.get("device", "")).removeprefix("NVIDIA ")
  if not device:
    return os.path.basename(path) or "run"
  mesh = next((r["mesh"] for r in result.get("records", []) if r.get("mesh")), None)
  if mesh:
    device += f" [{mesh[0]}x{mesh[1]}]"
  return f"{device} ({env['date']})" if env.get("date") else device


def rows(results: Sequence[dict]) -> list[Row]:
  """The (method, context, batch) rows present in every run, in the first run's order."""
  if len(results) < 2:
    raise ValueError(f"--json: give two or more runs to compare, got {len(results)}")
  keyed = []
  for res in results:
    keyed.append({(r["method"], r["context"], r["batch"]): Cell(
        float(r["tokens_per_s"]), float(r["step_ms"]),
        None if r.get("attention_ms") is None else float(r["attention_ms"]))
                  for r in res["records"]})
  out = [Row(m, c, b, tuple(k[(m, c, b)] for k in keyed))
         for (m, c, b) in keyed[0] if all((m, c, b) in k for k in keyed[1:])]
  if not out:
    raise ValueError("--json: no (method, context, batch) row is in every run")
  return out


def table(rows_: Sequence[Row], labels: Sequence[str]) -> str:
  """Markdown: per run tokens/s and step = attention + rest (ms); attention ÷ the first run's."""
  head = ["method", "context × B"] + [f"{l}: tokens/s, step ms (attention + rest)"
                                       for l in labels]
  head += [f"attention {l} ÷ {labels[0]}" for l in labels[1:]]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows_:
    cells = []
    for c in r.cells:
      split = ("" if c.attention_ms is None
               else f" ({c.attention_ms:.2f} + {c.rest_ms:.2f})")
      cells.append(f"{c.tokens_per_s:.1f}, {c.step_ms:.2f}{split}")
    cells += ["—" if x is None else f"{x:.2f}" for x in r.attention_ratios()[1:]]
    lines.append(f"| {r.method} | {context_label(r.context)} × {r.batch} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows_: Sequence[Row], labels: Sequence[str], path: str, title: str = ""):
  """One group per row, one bar per run: attention (solid) under the rest (hatched), the
  attention ratio to the first run over each later bar."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  n = len(labels)
  width = 0.8 / n
  fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(rows_) * max(1, n / 2), 4.2))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, lab in enumerate(labels):
    xs = [j + i * width for j in range(len(rows_))]
    attn = [r.cells[i].attention_ms or 0.0 for r in rows_]
    rest = [r.cells[i].step_ms - (r.cells[i].attention_ms or 0.0) for r in rows_]
    color = colors[i % len(colors)]
    ax.bar(xs, attn, width, color=color, label=f"{lab}: attention")
    ax.bar(xs, rest, width, bottom=attn, color=color, alpha=0.35, hatch="//",
           label=f"{lab}: rest of the step")
    if i:
      for x, r in zip(xs, rows_):
        ratio = r.attention_ratios()[i]
        if ratio is not None:
          ax.text(x, r.cells[i].step_ms, f"{ratio:.2f}×", ha="center", va="bottom",
                  fontsize=7)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows_))],
                [f"{r.method}\n{context_label(r.context)} × {r.batch}" for r in rows_],
                fontsize=8)
  ax.set_ylabel("decode step ms")
  ax.set_title(title or "decode step: attention + rest (× = attention vs the first run)",
               fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
