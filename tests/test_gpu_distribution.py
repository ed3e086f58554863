"""`pytest -m gpu` spreads a file's tests over the xdist workers (tests/conftest.py's
`pytest_configure`); the CPU suite keeps a file per worker (pyproject.toml's addopts)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _scheduler(*args):
  """The xdist scheduler a pytest run over this file picks (no test runs: all deselected)."""
  out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2",
                        "-k", "no_test_has_this_name", *args, pathlib.Path(__file__).name],
                       cwd=ROOT / "tests", capture_output=True, text=True, timeout=300,
                       check=False)
  lines = [l for l in out.stdout.splitlines() if l.startswith("scheduling tests via")]
  assert len(lines) == 1, out.stdout[-2000:] + out.stderr[-2000:]
  return lines[0].split()[-1]


@pytest.mark.parametrize("args,want", [
    (("-m", "gpu"), "LoadScheduling"),              # the GPU suite: a test per free worker
    (("-m", "not gpu"), "LoadFileScheduling"),      # negative control: the CPU suite's
    (("-m", "gpu", "--dist", "loadscope"), "LoadScopeScheduling"),  # an explicit choice stays
])
def test_gpu_marker_spreads_a_files_tests(args, want):
  assert _scheduler(*args) == want
