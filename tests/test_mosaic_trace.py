"""experiments/mosaic_trace.py: Mosaic GPU profiler traces folded into per-scope shares."""

import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "mosaic_trace.py"
_spec = importlib.util.spec_from_file_location("mosaic_trace", _PATH)
mosaic_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mosaic_trace)


def _ev(name, ph, cycles, tid):
  return dict(name=name, ph=ph, ts=cycles / 1e3, pid=1, tid=tid)


def _write(tmp_path, events):
  path = tmp_path / "t-trace.json"
  path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
  return str(path)


def _trace():
  """Two CTAs x (compute, producer). Compute: 2 tiles of mma (30, 50 cycles) and softmax
  (10 each), with a nested re-opened 'mma' scope (as Pallas emits for run_scoped bodies)
  that must count once; 20 idle cycles between the tiles. Producer: one wait of 40."""
  ev = []
  for cta in range(2):
    c, p = 1 + 2 * cta, 2 + 2 * cta
    ev += [_ev("mma", "B", 0, c), _ev("mma", "B", 5, c), _ev("mma", "E", 25, c),
           _ev("mma", "E", 30, c), _ev("softmax", "B", 30, c), _ev("softmax", "E", 40, c),
           _ev("mma", "B", 60, c), _ev("mma", "E", 110, c), _ev("softmax", "B", 110, c),
           _ev("softmax", "E", 120, c)]
    ev += [_ev("wait", "B", 0, p), _ev("wait", "E", 40, p), _ev("issue", "B", 40, p),
           _ev("issue", "E", 50, p)]
  return ev


def test_summarize_shares_and_means(tmp_path):
  s = mosaic_trace.summarize(_write(tmp_path, _trace()), 2, ["compute", "producer"])
  comp = s["compute"]
  assert comp["warpgroups"] == 2 and comp["span_cycles"] == pytest.approx(120)
  mma = comp["scopes"]["mma"]
  assert mma["calls_per_wg"] == 2 and mma["mean_cycles"] == pytest.approx(40)
  assert mma["share"] == pytest.approx(80 / 120)
  assert comp["scopes"]["softmax"]["share"] == pytest.approx(20 / 120)
  assert comp["scopes"]["(outside scopes)"]["share"] == pytest.approx(20 / 120)
  prod = s["producer"]["scopes"]
  assert prod["wait"]["mean_cycles"] == pytest.approx(40)
  assert prod["wait"]["share"] == pytest.approx(0.8)
  assert "| compute (2, 120 cycles each) | mma | 2.0 | 40 | 66.7% |" in mosaic_trace.table(s)


def test_summarize_rejects_bad_traces(tmp_path):
  ev = _trace()
  with pytest.raises(ValueError, match="unbalanced event 'softmax'"):
    mosaic_trace.summarize(_write(tmp_path, ev[:4] + ev[5:]), 2, ["compute", "producer"])
  with pytest.raises(ValueError, match="roles"):
    mosaic_trace.summarize(_write(tmp_path, ev), 3, ["compute", "producer"])
  with pytest.raises(ValueError, match="no events"):
    mosaic_trace.summarize(_write(tmp_path, []), 2, ["compute", "producer"])
  with pytest.raises(ValueError, match="never ends"):
    mosaic_trace.summarize(_write(tmp_path, ev[:-1]), 2, ["compute", "producer"])
