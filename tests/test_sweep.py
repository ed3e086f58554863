"""Sweeps resume without losing or repeating points; atomic JSONL appends; the report."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, records, report, sweep

REPO = Path(__file__).resolve().parents[1]
POINTS = [{"method": "dense"}, {"method": "kivi", "kivi.bits": 4},
          {"method": "kivi", "kivi.bits": 2}, {"method": "dense", "cache_dtype": "float32"}]


def tiny_config(text_path):
  c = config_lib.base_config()
  c.model.path = "random:tiny"
  c.kivi = dict(bits=4, group_size=8, residual=8, v_bits=None, scale_dtype="float16")
  c.data.path = str(text_path)
  # Prefill mode only: this tests bookkeeping; each extra mode is more compilations.
  c.eval.update(seq_len=24, max_windows=2, batch_size=2, modes=("prefill",))
  c.progress = False
  return c


@pytest.fixture
def text(tmp_path):
  p = tmp_path / "text.txt"
  p.write_text("".join(f"The {i}th line of a small test corpus.\n" for i in range(40)))
  return p


def test_resume_after_interrupt(tmp_path, text, monkeypatch):
  config = tiny_config(text)
  workdir = tmp_path / "w"
  real_run, calls = evaluate.run, []

  def interrupted_run(cfg, wd, **kw):
    if len(calls) == 2:
      raise KeyboardInterrupt  # Ctrl-C during the third point
    calls.append(cfg.method)
    return real_run(cfg, wd, **kw)

  monkeypatch.setattr(evaluate, "run", interrupted_run)
  with pytest.raises(KeyboardInterrupt):
    sweep.run(config, workdir, POINTS)
  results = workdir / records.RESULTS
  first = results.read_text().splitlines()
  assert len(first) == 2 and not (workdir / "report.md").exists()

  calls.clear()
  monkeypatch.setattr(evaluate, "run", lambda cfg, wd, **kw: (calls.append(cfg.method),
                                                              real_run(cfg, wd, **kw))[1])
  summary = sweep.run(config, workdir, POINTS)
  assert summary["ran"] == 2 and summary["skipped"] == 2 and calls == ["kivi", "dense"]
  lines = results.read_text().splitlines()
  assert lines[:2] == first  # finished points untouched
  recs = [json.loads(x) for x in lines]
  keys = [r["key"] for r in recs]
  expected = [config_lib.config_hash(config_lib.apply_overrides(config, p)) for p in POINTS]
  assert sorted(keys) == sorted(expected) and len(set(keys)) == 4
  md = Path(summary["markdown"]).read_text()
  assert "| dense (baseline) | 16 |" in md and md.count("| kivi |") == 2
  assert md.count("| dense |") == 1  # the float32 dense cache is not the bf16 baseline
  for p in summary["plots"]:
    assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Third run: nothing left to do.
  calls.clear()
  assert sweep.run(config, workdir, POINTS)["ran"] == 0 and not calls
  # Negative control: a changed setting is a different point for every entry.
  config.eval.seq_len = 16
  assert sweep.run(config, workdir, [POINTS[0], POINTS[3]])["ran"] == 2


def test_report_table(tmp_path):
  """Rows, ratios and ordering from hand-made records."""
  base = {"model": {"path": "m"}, "data": {"dataset": "wikitext2", "split": "test"},
          "seq_len": 8, "windows": 2, "tokens": 14, "bf16_kv_bytes_per_token": 100.0}
  recs = [dict(base, key="b", method="kivi", bits="2", cache_dtype="bfloat16",
               kv_bytes_per_token=25.0, compression_vs_bf16=4.0, ppl_prefill=12.0,
               ppl_decode=11.0),
          dict(base, key="a", method="dense", bits="16", cache_dtype="bfloat16",
               kv_bytes_per_token=100.0, compression_vs_bf16=1.0, ppl_prefill=10.0,
               ppl_decode=10.5)]
  for r in recs:
    records.append(tmp_path / records.RESULTS, r)
  out = report.write(tmp_path)
  rows = [x for x in Path(out["markdown"]).read_text().splitlines() if x.startswith("| ")]
  assert rows[1] == "| dense (baseline) | 16 | 100 | 1.00x | 10.000 | 10.500 | — | — | 14 | 2 |"
  assert rows[2] == "| kivi | 2 | 25 | 4.00x | 12.000 | 11.000 | — | — | 14 | 2 |"
  drift = {"greedy_match": 0.75, "kl": 0.01234, "n_prompts": 2, "n_tokens": 8,
           "prompt_len": 4}
  records.append(tmp_path / records.RESULTS, dict(recs[0], drift=drift))
  text = Path(report.write(tmp_path)["markdown"]).read_text()
  assert "| kivi | 2 | 25 | 4.00x | 12.000 | 11.000 | 0.750 | 0.0123 | 14 | 2 |" in text
  assert "2 prompts x 8 tokens after 4 prompt tokens" in text
  assert report.pareto([(100, 10.0), (25, 12.0), (50, 13.0)]) == [(25, 12.0), (100, 10.0)]
  with pytest.raises(FileNotFoundError, match="no results"):
    report.write(tmp_path / "empty")


def test_drift_columns_through_the_sweep(tmp_path, text):
  """eval.drift_tokens > 0: every record carries its generation drift against the dense
  model; the bf16 dense point is exactly match 1 / KL 0, KIVI-2 (no exact window) is not."""
  config = tiny_config(text)
  config.eval.update(drift_tokens=4, drift_prompts=2)
  config.kivi.residual = 0
  points = [{"method": "dense"}, {"method": "kivi", "kivi.bits": 2}]
  summary = sweep.run(config, tmp_path, points)
  recs = {r["method"]: r for r in records.read(tmp_path / records.RESULTS)}
  dense, kivi = recs["dense"]["drift"], recs["kivi"]["drift"]
  assert (dense["n_prompts"], dense["n_tokens"], dense["prompt_len"]) == (2, 4, 12)
  assert dense["greedy_match"] == 1.0 and dense["kl"] == 0.0
  assert kivi["kl"] > 0  # negative control
  md = Path(summary["markdown"]).read_text()
  assert "| greedy match | KL |" in md and "| dense (baseline) | 16 | " in md
  assert "| 1.000 | 0 |" in md


def test_append_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "r.jsonl"
  records.append(path, {"key": "a"})
  before = path.read_bytes()

  def boom(*a, **k):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", boom)
  with pytest.raises(OSError):
    records.append(path, {"key": "b"})
  assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["r.jsonl"]
  monkeypatch.undo()
  path.write_text(path.read_text() + "{not json\n")
  with pytest.raises(ValueError, match=r"r.jsonl:2: malformed"):
    records.read(path)


def test_points_of_config_files():
  """configs/main.py's sweep covers the bf16 baseline, KIVI-4 and KIVI-2 (and later
  methods), and every point resolves to a valid config."""
  points = sweep.load_points(str(REPO / "configs" / "main.py"))
  for p in ({"method": "dense"}, {"method": "kivi", "kivi.bits": 4},
            {"method": "kivi", "kivi.bits": 2}):
    assert p in points
  spec = importlib.util.spec_from_file_location("_main_config", REPO / "configs" / "main.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  resolved = sweep.resolve(module.get_config(), points)
  assert len({key for _, _, key in resolved}) == len(points)
  with pytest.raises(ValueError, match="no get_sweep"):
    sweep.load_points(str(REPO / "configs" / "baseline.py"))
  with pytest.raises(ValueError, match=r"sweep point 0 .*'kivi.bitz'"):
    sweep.resolve(config_lib.base_config(), [{"kivi.bitz": 2}])
