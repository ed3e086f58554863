"""The long-context job on stories260K: a hand-checked dense case, the launcher end to end
(resumable, plots), config validation, and the offline LongBench / RULER one-line error."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from kvlowrank.eval import passkey
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import longctx, models, records
from kvlowrank.experiment.sweep import load_points
from kvlowrank.generate.loop import generate
from kvlowrank.resources import shared_dir

# WikiText-2 filler / stories260K live in ../shared (absent: skipped, as the other tests).
NEEDS_SHARED = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "longctx.py"


def _smoke_config(**longctx_overrides):
  spec = importlib.util.spec_from_file_location("_lc_cfg", CONFIG)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config("smoke")
  c.progress = False
  return config_lib.apply_overrides(
      c, {f"longctx.{k}": v for k, v in longctx_overrides.items()})


def _launch(tmp_path, *args, env=None):
  e = dict(os.environ, **(env or {}))
  e["PYTHONPATH"] = os.pathsep.join([str(REPO / ".pk"), str(REPO), e.get("PYTHONPATH", "")])
  return subprocess.run([sys.executable, str(REPO / "experiments" / "longctx.py"), *args],
                        capture_output=True, text=True, env=e, cwd=tmp_path, timeout=300)


@NEEDS_SHARED
def test_dense_smoke_hand_checked(tmp_path):
  """stories260K (a TinyStories model) does not copy the pass key: its greedy answer at
  context 512, depth 0 is the story-like 'just a small bird. I' (checked by hand: the
  prompt ends '... What is the pass key? The pass key is'), so the score is 0; the
  record's text equals an independent greedy decode of the same prompt."""
  cfg = _smoke_config(tasks=("passkey",), contexts=(512,), depths=(0.0,))
  out = longctx.run(cfg, tmp_path, [{"method": "dense", "longctx.label": "dense"}])
  assert out["ran"] == 1 and out["skipped"] == 0
  (rec,) = records.read(tmp_path / records.RESULTS)
  assert rec["generated"] == "just a small bird. I"
  assert rec["score"] == 0.0 and rec["answer"] == "57286"
  assert rec["prompt_tokens"] == 512 - 12 and rec["depth_actual"] == 0.0
  m = models.load(cfg.model.path, "float32")
  tok = m.require_tokenizer()
  s = passkey.sample(tok, context=512, depth=0.0)
  assert s.answer == rec["answer"]
  res = generate(m.params, m.spec, [list(s.tokens)], max_new_tokens=12,
                 cache_dtype=jnp.bfloat16, eos_ids=tok.eos_ids, capacity=512)
  assert tok.decode(list(res.tokens[0])) == rec["generated"]
  # Rerun: nothing left to do.
  assert longctx.run(cfg, tmp_path, [{"method": "dense", "longctx.label": "dense"}]
                     )["ran"] == 0


@NEEDS_SHARED
@pytest.mark.slow
def test_launcher_smoke_end_to_end(tmp_path):
  work = tmp_path / "lc"
  r = _launch(tmp_path, f"--config={CONFIG}:smoke", f"--workdir={work}")
  assert r.returncode == 0, r.stderr[-2000:]
  recs = records.read(work / records.RESULTS)
  # 2 methods x 2 tasks x 2 contexts x 2 depths.
  assert len(recs) == 16
  assert {r["label"] for r in recs} == {"dense", "KIVI-2"}
  assert {(r["task"], r["context"], r["depth"]) for r in recs} == {
      (t, c, d) for t in ("passkey", "needle") for c in (256, 512) for d in (0.0, 1.0)}
  assert all(r["score"] in (0.0, 1.0) for r in recs)
  for name in ("longctx.md", "longctx_accuracy.png", "heatmap_dense.png",
               "heatmap_KIVI-2.png"):
    assert (work / name).stat().st_size > 0, name
  assert "16 prompts run, 0 already finished" in r.stdout
  r2 = _launch(tmp_path, f"--config={CONFIG}:smoke", f"--workdir={work}")
  assert r2.returncode == 0 and "0 prompts run, 16 already finished" in r2.stdout
  assert len(records.read(work / records.RESULTS)) == 16


@pytest.mark.parametrize("task,dataset", [("longbench", "Xnhyacinth/LongBench/narrativeqa"),
                                          ("ruler", "simonjegou/ruler/4096")])
@NEEDS_SHARED
def test_launcher_offline_hf_is_one_line(tmp_path, task, dataset):
  work = tmp_path / "never"
  r = _launch(tmp_path, f"--config={CONFIG}:smoke,tasks={task}", f"--workdir={work}",
              env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "HF_HOME": str(tmp_path / "hf")})
  assert r.returncode == 1
  err = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(err) == 1, r.stderr
  assert err[0].startswith("error: ") and dataset in err[0] and "offline" in err[0]
  assert "Traceback" not in r.stderr and not work.exists()


@NEEDS_SHARED
def test_config_errors_name_the_field(tmp_path):
  with pytest.raises(ValueError, match=r"config.longctx.depths .* \[0, 1\]"):
    longctx.run(_smoke_config(depths=(0.0, 1.5)), tmp_path, [{}])
  with pytest.raises(ValueError, match="config.longctx.tasks"):
    longctx.run(_smoke_config(tasks=("passkee",)), tmp_path, [{}])
  with pytest.raises(ValueError, match=r"contexts \[1024\] exceed the model's max_seq_len=512"):
    longctx.run(_smoke_config(contexts=(256, 1024)), tmp_path, [{}])
  with pytest.raises(ValueError, match="point 0 .*KiviSpec.bits"):
    longctx.run(_smoke_config(), tmp_path, [{"method": "kivi", "kivi.bits": 5}])
  # Methods by registry name: an unregistered one is refused before any work.
  pts = load_points(f"{CONFIG}:methods=KIVI-2+nosuch")
  assert pts[1] == {"method": "nosuch", "longctx.label": "nosuch"}
  with pytest.raises(ValueError, match="point 1 .*unknown config.method 'nosuch'"):
    longctx.run(_smoke_config(), tmp_path, pts)
  assert not (tmp_path / records.RESULTS).exists()
  lc = longctx.LongCtxSpec(contexts=(1024, 8192), depths=(0.0, 1.0),
                           depth_overrides=((8192, (0.5,)),),
                           task_overrides=((8192, ("passkey",)),))
  assert list(longctx._grid(lc)) == [  # pylint: disable=protected-access
      ("passkey", 1024, 0.0, 0), ("passkey", 1024, 1.0, 0), ("passkey", 8192, 0.5, 0),
      ("needle", 1024, 0.0, 0), ("needle", 1024, 1.0, 0)]
  with pytest.raises(ValueError, match="config.longctx.task_overrides: tasks must be"):
    longctx.LongCtxSpec(task_overrides=((8192, ("pk",)),))
  with pytest.raises(ValueError, match="config.longctx.depth_overrides must be"):
    longctx.LongCtxSpec(depth_overrides=(4096,))
