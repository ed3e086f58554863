"""kvlowrank.bench.compare and experiments/decode_report.py: bench_decode runs side by side."""

import json
import pathlib
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from kvlowrank.bench import compare

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(device, recs):
  return {"model": "llama3-8b", "environment": {"device": f"NVIDIA {device}",
                                                "date": "2026-11-28"},
          "records": [dict(method=m, context=32768, batch=8, tokens_per_s=t, step_ms=s,
                           attention_ms=a) for m, t, s, a in recs]}


H200 = _run("H200", [("dense", 651.5, 12.28, 8.50), ("KIVI-2", 1039.5, 7.70, 3.06),
                     ("XQuant-CL-2", 11.0, 729.72, None), ("FDC-50%", 832.0, 9.61, 5.55)])
H100 = _run("H100 80GB HBM3", [("KIVI-2", 864.4, 9.25, 3.13), ("dense", 465.8, 17.17, 11.96),
                               ("XQuant-CL-2", 9.0, 800.0, None)])


def test_rows_match_by_key_in_the_first_runs_order():
  rows = compare.rows([H200, H100])
  assert [r.method for r in rows] == ["dense", "KIVI-2", "XQuant-CL-2"]  # FDC: H200 only
  dense = rows[0]
  assert dense.cells[1].attention_ms == 11.96
  assert dense.cells[0].rest_ms == pytest.approx(12.28 - 8.50)
  assert dense.attention_ratios() == pytest.approx((1.0, 11.96 / 8.50))
  assert rows[1].attention_ratios()[1] == pytest.approx(3.13 / 3.06)
  assert rows[2].attention_ratios() == (None, None)   # no attention split
  assert rows[2].cells[0].rest_ms is None


def test_table_and_labels():
  rows = compare.rows([H200, H100])
  labels = [compare.label(H200), compare.label(H100)]
  assert labels == ["H200 (2026-11-28)", "H100 80GB HBM3 (2026-11-28)"]
  text = compare.table(rows, labels)
  assert "| dense | 32K × 8 | 651.5, 12.28 (8.50 + 3.78) | 465.8, 17.17 (11.96 + 5.21) | 1.41 |" \
      in text
  assert "| XQuant-CL-2 | 32K × 8 | 11.0, 729.72 | 9.0, 800.00 | — |" in text
  assert compare.label({"records": []}, "/x/run.json") == "run.json"
  tiny = [dict(H200["records"][0], context=300), dict(H100["records"][1], context=300)]
  assert "| dense | 300 × 8 |" in compare.table(
      compare.rows([dict(H200, records=tiny[:1]), dict(H100, records=tiny[1:])]), labels)
  two = dict(H100, records=[dict(r, mesh=[1, 2]) for r in H100["records"]])
  assert compare.label(two) == "H100 80GB HBM3 [1x2] (2026-11-28)"
  assert [r.method for r in compare.rows([H200, two])] == ["dense", "KIVI-2", "XQuant-CL-2"]


def test_plot_stacks_attention_under_the_rest(tmp_path, monkeypatch):
  rows = compare.rows([H200, H100])[:2]
  saved = {}
  orig = plt.Figure.savefig
  def keep(fig, path, **kw):
    ax = fig.axes[0]
    saved["bars"] = [(round(p.get_y(), 2), round(p.get_height(), 2)) for p in ax.patches]
    saved["text"] = [t.get_text() for t in ax.texts]
    return orig(fig, path, **kw)
  monkeypatch.setattr(plt.Figure, "savefig", keep)
  compare.plot(rows, ["H200", "H100"], str(tmp_path / "c.png"))
  assert (tmp_path / "c.png").stat().st_size > 0
  # Per run: attention bars from 0, then the rest stacked on them (dense, KIVI-2).
  assert saved["bars"] == [(0, 8.5), (0, 3.06), (8.5, 3.78), (3.06, 4.64),
                           (0, 11.96), (0, 3.13), (11.96, 5.21), (3.13, 6.12)]
  assert saved["text"] == ["1.41×", "1.02×"]


def test_bad_inputs_are_one_line_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="--json: no file .*missing.json"):
    compare.load(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{")
  with pytest.raises(ValueError, match="bad.json is not JSON"):
    compare.load(str(bad))
  other = tmp_path / "other.json"
  other.write_text(json.dumps({"results": []}))
  with pytest.raises(ValueError, match="other.json has no 'records' list"):
    compare.load(str(other))
  with pytest.raises(ValueError, match="two or more runs"):
    compare.rows([H200])
  with pytest.raises(ValueError, match="no \\(method, context, batch\\) row is in every run"):
    compare.rows([H200, _run("H100", [("ZACK-50%", 1.0, 1.0, 0.5)])])


def test_launcher(tmp_path):
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps(H200))
  b.write_text(json.dumps(H100))
  script = str(ROOT / "experiments" / "decode_report.py")
  out = subprocess.run([sys.executable, script, f"--json={a},{b}",
                        f"--png={tmp_path / 'c.png'}"], capture_output=True, text=True,
                       timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "| KIVI-2 | 32K × 8 | 1039.5, 7.70 (3.06 + 4.64) |" in out.stdout
  assert (tmp_path / "c.png").stat().st_size > 0
  err = subprocess.run([sys.executable, script, f"--json={a},{tmp_path / 'nope.json'}"],
                       capture_output=True, text=True, timeout=120, check=False)
  assert err.returncode == 1
  [line] = err.stderr.strip().splitlines()   # one line, naming the file
  assert line.startswith("error: --json: no file") and "nope.json" in line
