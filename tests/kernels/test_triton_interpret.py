"""The Triton kernels under Triton's CPU interpreter, against their jnp references.

Each check (`interpret_checks.py`) runs in its own process because
TRITON_INTERPRET must be set before the kernels are decorated. Skipped where
Triton or torch is not installed (the CI image has neither; the GPU tests cover
the kernels on the device). Install the CPU wheels to run these locally.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (CPU wheels) for the interpreter")


def _names():
  with open(os.path.join(HERE, "interpret_checks.py"), encoding="utf-8") as f:
    return [line.split("(")[0][len("def check_"):] for line in f
            if line.startswith("def check_")]


@pytest.mark.parametrize("name", _names())
def test_kernel_under_interpreter(name):
  proc = subprocess.run([sys.executable, os.path.join(HERE, "interpret_checks.py"), name],
                        capture_output=True, text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
