"""The launchers in experiments/ on bad input: exit status 1, ONE line on stderr naming the
bad field or file, no traceback, and the workdir untouched (kvlowrank.experiment.cli).

Each case is a real subprocess (absl flag parsing, config files, model loading); they
start together in a module fixture (each imports JAX: seconds) and the parametrized
tests read their outcomes. The stories260K smoke configs load in a second.
"""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlowrank.resources import shared_dir

REPO = Path(__file__).resolve().parents[1]
# absl's log lines (I1125 09:00:00.0 ...), which go to stderr too, and the transient
# model-loading bar (tqdm, leave=False: a terminal erases it; a pipe keeps its first frame).
_LOG = re.compile(r"^[IWEF]\d{4} |^loading \S+: +\d+%\|")

# (name, launcher, args, what the one line must contain). {tmp}: a scratch folder with
# empty.txt; {w}: the workdir, which must not exist afterwards.
CASES = [
    ("unknown_key", "evaluate", ["--config=configs/kivi.py:smoke", "--config.kivi.bitz=3"],
     "unknown config key 'bitz' in --config.kivi.bitz (did you mean 'bits'?)"),
    ("unknown_config_arg", "evaluate", ["--config=configs/kivi.py:smoke,bitz=3"],
     "unknown config arg 'bitz'; known: bits"),
    ("missing_data_path", "evaluate", ["--config=configs/kivi.py:smoke",
                                       "--config.data.path={tmp}/nope.txt"],
     "config.data.path: no such file {tmp}/nope.txt"),
    ("empty_data_path", "evaluate", ["--config=configs/kivi.py:smoke",
                                     "--config.data.path={tmp}/empty.txt"],
     "config.data.path: {tmp}/empty.txt is empty"),
    ("missing_calib_path", "evaluate", ["--config=configs/palu.py:smoke",
                                        "--config.calib.path={tmp}/nope.txt"],
     "config.calib.path: no such file"),
    ("beyond_max_seq_len", "evaluate", ["--config=configs/kivi.py:smoke",
                                        "--config.eval.seq_len=1024"],
     "config.eval.seq_len=1024 exceeds the model's max_seq_len=512"),
    ("infeasible_palu", "evaluate", ["--config=configs/palu.py:smoke",
                                     "--config.palu.granularity=m"],
     "with rank_multiple=8 is infeasible"),
    ("missing_model", "generate", ["--config=configs/generate.py:smoke",
                                   "--config.model.path={tmp}/nomodel.bin"],
     "model not found: {tmp}/nomodel.bin"),
    ("missing_sweep_file", "sweep", ["--config=configs/nope.py"],
     "config file not found: configs/nope.py"),
    ("empty_report", "report", [], "no results to report in {w}/results.jsonl"),
]
NEEDS_SHARED = {name for name, _, args, _ in CASES if any(":smoke" in a for a in args)}


def _run(argv, tmp):
  del tmp
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get(
                 "PYTHONPATH")])))
  # SIGINT as a terminal delivers it, even where pytest runs with it ignored.
  return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env,
                        timeout=240,
                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("launchers")
  (tmp / "empty.txt").write_text("")
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    for name, launcher, args, _ in CASES:
      if name in NEEDS_SHARED and shared_dir() is None:
        continue
      w = tmp / f"w_{name}"
      argv = [sys.executable, str(REPO / "experiments" / f"{launcher}.py"),
              *[a.format(tmp=tmp, w=w) for a in args], f"--workdir={w}"]
      jobs[name] = pool.submit(_run, argv, tmp)
    # Control: --debug shows the traceback of the same error.
    jobs["debug"] = pool.submit(_run, [
        sys.executable, str(REPO / "experiments" / "sweep.py"), "--config=configs/nope.py",
        f"--workdir={tmp / 'w_debug'}", "--debug"], tmp)
  return tmp, {k: f.result() for k, f in jobs.items()}


@pytest.mark.parametrize("name, launcher, args, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(outcomes, name, launcher, args, expected):
  del launcher, args
  tmp, results = outcomes
  if name not in results:
    pytest.skip("needs the shared folder (stories260K)")
  proc = results[name]
  w = tmp / f"w_{name}"
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _LOG.match(ln)]
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert lines == [f"error: {lines[0][7:]}"] and len(lines) == 1, proc.stderr[-2000:]
  assert expected.format(tmp=tmp, w=w) in lines[0]
  assert "Traceback" not in proc.stderr
  assert not w.exists(), sorted(os.listdir(w))


def test_debug_shows_the_traceback(outcomes):
  proc = outcomes[1]["debug"]
  assert proc.returncode == 1
  assert "Traceback" in proc.stderr and "config file not found: configs/nope.py" in proc.stderr


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
  """A real SIGINT in a launcher's main: one line, status 130, no traceback; a result
  written before it is intact."""
  script = tmp_path / "launcher.py"
  script.write_text(textwrap.dedent(f"""
      import os, signal, time
      from kvlowrank.experiment import cli, records

      def main(argv):
        records.append({str(tmp_path / 'r.jsonl')!r}, {{"key": "done"}})
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)

      cli.run(main, uses_jax=False)
      """))
  proc = _run([sys.executable, str(script)], tmp_path)
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _LOG.match(ln)]
  assert proc.returncode == 130, proc.stderr
  assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)")
  assert (tmp_path / "r.jsonl").read_text() == '{"key": "done"}\n'


@pytest.mark.parametrize("handler", ["cli", "python"])
def test_ctrl_c_inside_a_gc_callback_is_not_lost(tmp_path, handler):
  """JAX runs a callback at every garbage collection; Python drops a KeyboardInterrupt
  raised inside one ("Exception ignored in ...") and the program went on. The launcher's
  handler re-delivers it. Control: Python's own handler loses it."""
  script = tmp_path / "launcher.py"
  restore = ("signal.signal(signal.SIGINT, signal.default_int_handler)"
             if handler == "python" else "pass")
  script.write_text(textwrap.dedent(f"""
      import gc, os, signal, sys, time
      from kvlowrank.experiment import cli

      def main(argv):
        {restore}
        def cb(phase, info):
          if phase == "start" and not getattr(cb, "sent", False):
            cb.sent = True
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200000):  # the signal handler runs inside this callback
              pass
        gc.callbacks.append(cb)
        gc.collect()
        gc.callbacks.remove(cb)
        t = time.time()
        while time.time() - t < 3:
          pass
        print("not interrupted", file=sys.stderr)

      cli.run(main, uses_jax=False)
      """))
  proc = _run([sys.executable, str(script)], tmp_path)
  if handler == "cli":
    assert proc.returncode == 130 and "not interrupted" not in proc.stderr, proc.stderr
  else:
    assert proc.returncode == 0 and "not interrupted" in proc.stderr, proc.stderr
