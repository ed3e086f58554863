"""The experiment pipeline's user path, in process: infeasible sweep points are recorded
as failed and the sweep goes on; a finished point is skipped (or overwritten); nothing
is written to a workdir before its inputs validate; results files get normal modes."""

import hashlib
import json
import os
import stat

import ml_collections
import pytest

from kvlowrank import ModelSpec
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, records, report, sweep
from kvlowrank.methods import get_method
from test_sweep import tiny_config

# A KIVI group of 64 channels cannot divide random:tiny's head dim 32: infeasible only
# once the model is known (the spec alone is valid).
INFEASIBLE = {"method": "kivi", "kivi.group_size": 64, "kivi.residual": 64}
POINTS = [{"method": "dense"}, INFEASIBLE, {"method": "kivi", "kivi.bits": 4}]


@pytest.fixture
def text(tmp_path):
  p = tmp_path / "text.txt"
  p.write_text("".join(f"The {i}th line of a small test corpus.\n" for i in range(40)))
  return p


def _counting(monkeypatch):
  real, calls = evaluate.run, []

  def counted(cfg, wd, **kw):
    calls.append(cfg.method)
    return real(cfg, wd, **kw)

  monkeypatch.setattr(evaluate, "run", counted)
  return calls


def test_sweep_records_infeasible_point_and_goes_on(tmp_path, text, monkeypatch):
  config = tiny_config(text)
  calls = _counting(monkeypatch)
  # fail_fast: stops at the check, before any point runs and before anything is written.
  with pytest.raises(ValueError, match=r"sweep point 1 .*group_size \(64\) must divide"):
    sweep.run(config, tmp_path / "ff", POINTS, fail_fast=True)
  assert calls == [] and not (tmp_path / "ff").exists()

  workdir = tmp_path / "w"
  summary = sweep.run(config, workdir, POINTS)
  assert calls == ["dense", "kivi"] and summary["ran"] == 2
  assert [p for p, _ in summary["failed"]] == [INFEASIBLE]
  recs = records.read(workdir / records.RESULTS)
  bad = [r for r in recs if records.failed(r)]
  assert len(recs) == 3 and len(bad) == 1 and "group_size (64) must divide" in bad[0]["error"]
  md = open(summary["markdown"]).read()
  assert "### Failed points (1)" in md and "kivi.group_size=64" in md
  assert md.count("| kivi |") == 1  # the failed point has no table row
  # A rerun retries only the failed point (still infeasible: one record, replaced).
  calls.clear()
  again = sweep.run(config, workdir, POINTS)
  assert calls == [] and again["skipped"] == 2 and len(again["failed"]) == 1
  assert len(records.read(workdir / records.RESULTS)) == 3


def test_evaluate_skips_or_overwrites_a_finished_point(tmp_path, text):
  cfg, workdir = tiny_config(text), tmp_path / "w"
  first = evaluate.run(cfg, workdir)
  results = workdir / records.RESULTS
  again = evaluate.run(cfg, workdir)
  assert again["skipped"] and again["key"] == first["key"]
  assert len(results.read_text().splitlines()) == 1
  replaced = evaluate.run(cfg, workdir, overwrite=True)
  assert "skipped" not in replaced
  lines = results.read_text().splitlines()
  assert len(lines) == 1 and json.loads(lines[0])["seconds"] == replaced["seconds"]
  # Control: another point is appended, not confused with the first.
  cfg.eval.seq_len = 16
  evaluate.run(cfg, workdir)
  assert len(results.read_text().splitlines()) == 2


@pytest.mark.parametrize("case", ["empty_file", "missing_file", "short_text"])
def test_nothing_written_before_inputs_validate(tmp_path, text, case):
  cfg, workdir = tiny_config(text), tmp_path / "w"
  if case == "empty_file":
    (tmp_path / "empty.txt").write_text("")
    cfg.data.path, match = str(tmp_path / "empty.txt"), r"config.data.path: .*empty.txt is empty"
  elif case == "missing_file":
    cfg.data.path, match = str(tmp_path / "nope.txt"), r"config.data.path: no such file .*nope"
  else:  # readable but shorter than one window: the message names the file
    cfg.eval.seq_len, match = 4000, r"the text of .*text.txt has \d+ tokens, fewer than one"
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    evaluate.run(cfg, workdir)
  assert not workdir.exists()


def test_results_file_mode(tmp_path):
  old = os.umask(0o022)
  try:
    path = tmp_path / "r.jsonl"
    records.append(path, {"key": "a"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
    path.chmod(0o640)
    records.append(path, {"key": "b"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # an existing file keeps its mode
  finally:
    os.umask(old)


def test_new_eval_flag_keeps_old_hashes():
  """eval.allow_beyond_max_seq_len joined the config after results were recorded: at its
  default it is left out of the hash, so existing workdirs resume without reruns."""
  c = config_lib.base_config()
  old = config_lib.base_config()
  del old.eval["allow_beyond_max_seq_len"]
  assert config_lib.config_hash(c) == config_lib.config_hash(old)
  c.eval.allow_beyond_max_seq_len = True  # control: set, it is a different point
  assert config_lib.config_hash(c) != config_lib.config_hash(old)


def test_calibration_hash_keys_the_resolved_spec():
  """A default written out or left out is the same calibration; a knob whose default the
  checkpoint predates is not: the hash covers the resolved spec, not the section's text."""
  c = config_lib.base_config()
  c.method, c.palu = "palu", ml_collections.ConfigDict({"target_ratio": 0.5})
  explicit = config_lib.base_config()
  explicit.method = "palu"
  explicit.palu = ml_collections.ConfigDict({"target_ratio": 0.5, "value_fold": "auto"})
  assert config_lib.calibration_hash(c) == config_lib.calibration_hash(explicit)
  explicit.palu.value_fold = "always"  # control: a different calibration
  assert config_lib.calibration_hash(c) != config_lib.calibration_hash(explicit)
  # The section-only hash (before 2026-11-27) is not what keys the checkpoint any more.
  d = config_lib._canonical(c)  # pylint: disable=protected-access
  section_only = hashlib.sha256(json.dumps(
      {"model": d["model"], "method": "palu", "section": d["palu"], "calib": d["calib"]},
      sort_keys=True).encode()).hexdigest()[:16]
  assert config_lib.calibration_hash(c) != section_only


def test_report_lists_failures_until_they_finish(tmp_path):
  path = tmp_path / records.RESULTS
  records.append(path, {"key": "k", "status": "failed", "point": {"palu.ratio": 0.9},
                        "method": "palu", "error": "ValueError: infeasible"})
  assert [r["key"] for r in report.failures(records.read(path))] == ["k"]
  md = report.failures_markdown(report.failures(records.read(path)))
  assert "`palu.ratio=0.9`: ValueError: infeasible" in md
  records.append(path, {"key": "k", "status": "ok"}, replace=True)
  assert report.failures(records.read(path)) == [] and len(records.read(path)) == 1


SMOLLM2 = ModelSpec(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                    head_dim=64, ffn_dim=1536)


@pytest.mark.parametrize("section, match", [
    # M-LRD's group rank is the head dim 64: a multiple of 128 caps at 64 and 50% cannot
    # be met; the message names the value given.
    (dict(granularity="m", rank_multiple=128), r"target_ratio=0.5 with rank_multiple=128 is "
     r"infeasible"),
    # J-LRD ranks up to 192 in steps of 8 can land on 184 = 8 * 23: no Hadamard matrix.
    (dict(granularity="j", rank_multiple=8), r"rank_multiple=8 can give group rank 184"),
    (dict(granularity="g", group_size=2), r"group_size \(2\) must divide .*n_kv_heads \(3\)"),
])
def test_palu_feasibility_before_calibration(section, match):
  """Palu's model-dependent checks run in build_spec (before any calibration)."""
  palu = get_method("palu")
  with pytest.raises(ValueError, match=match):
    palu.build_spec(section, SMOLLM2)
  palu.build_spec(dict(section, rank_multiple=16, group_size=0), SMOLLM2)  # control
