"""experiments/bench_xquant.py on CPU: its command line, --shapes parsing and its inputs.

The benchmark itself needs a GPU with jax-triton; these tests cover what runs before the
device is needed (argument parsing, one-line errors) and the random inputs it builds with
`kvlowrank.bench` (layout, ranges, seeding) on tiny shapes.
"""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.quant import packed_words
from kvlowrank_kernels.xquant import reference as ref

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench_xquant.py"


def _module():
  spec = importlib.util.spec_from_file_location("bench_xquant", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


bx = _module()


def _run(*argv):
  return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                        timeout=300, check=False)


def test_help_lists_the_cited_flags():
  proc = _run("--help")
  assert proc.returncode == 0, proc.stderr
  for flag in ("--out", "--budget_s", "--shapes", "--models", "--quick"):
    assert flag in proc.stdout


@pytest.mark.skipif(bx.tb.available(), reason="a GPU with jax-triton would run the benchmark")
def test_cli_errors_are_one_line():
  good = _run("--out", "/dev/null", "--budget_s", "400",
              "--shapes", "llama3.1-8b:8:32768,llama3.1-8b:32:32768")
  assert good.returncode != 0
  assert good.stderr.strip() == "bench_xquant needs a CUDA GPU with jax-triton (none found)"
  bad = _run("--shapes", "llama3.1-8b:8")
  assert bad.returncode != 0
  assert bad.stderr.strip().count("\n") == 0, bad.stderr
  assert bad.stderr.startswith("--shapes: bad entry 'llama3.1-8b:8'")
  models = _run("--models", "llama2-7b,gpt9")
  assert models.stderr.strip().count("\n") == 0, models.stderr
  assert models.stderr.startswith("--models: unknown ['gpt9']")


def test_parse_shapes():
  assert bx.parse_shapes("llama3.1-8b:8:32768,llama2-7b:1:1024", ["llama3.1-8b"]) == [
      ("llama3.1-8b", 8, 32768)]
  assert bx.parse_shapes("", ["llama2-7b"]) == [x for x in bx.SHAPES if x[0] == "llama2-7b"]
  assert len(bx.parse_shapes("", list(bx.MODELS))) == len(bx.SHAPES)
  for bad in ("llama2-7b:1", "llama2-7b:one:1024", "gpt9:1:1024", "llama2-7b:1:-5"):
    with pytest.raises(SystemExit, match="--shapes: bad entry"):
      bx.parse_shapes(bad, list(bx.MODELS))


@pytest.mark.parametrize("model", ["llama2-7b", "llama3.1-8b"])
def test_setup_inputs(model):
  b, s, bits = 2, 256, 2
  d = bx.setup(model, b, s, bits, jax.random.key(3))
  q, k_rows, v_rows, wk, wv = d["args"][:5]
  spec = d["spec"]
  rows = [k_rows] if v_rows is None else [k_rows, v_rows]
  c = wk.shape[0]
  assert c == (spec.dim if model == "llama2-7b" else spec.kv_dim)
  for r in rows:
    assert r.codes.dtype == jnp.uint32 and r.codes.shape == (b, s, packed_words(c, bits))
    ref.check_layout(r.codes.reshape(b * s, -1), r.scale.reshape(-1, r.scale.shape[-1]),
                     r.zero.reshape(-1, r.zero.shape[-1]), wk, bits=bits,
                     axis=r.axis, group=r.group)
    scale = np.asarray(r.scale, np.float64)
    assert scale.min() >= 0.01 - 1e-5 and scale.max() < 0.1
    np.testing.assert_allclose(np.asarray(r.zero, np.float64), -scale * 1.5, rtol=2e-3)
    # Random words: every byte value appears (not zeros, not a constant fill).
    assert len(np.unique(np.asarray(r.codes).view(np.uint8))) == 256
  np.testing.assert_allclose(np.std(np.asarray(q, np.float64)), 1.0, rtol=0.05)
  for w in (wk, wv):
    np.testing.assert_allclose(np.std(np.asarray(w, np.float64)), c ** -0.5, rtol=0.05)
  same = bx.setup(model, b, s, bits, jax.random.key(3))["args"]
  other = bx.setup(model, b, s, bits, jax.random.key(4))["args"]
  np.testing.assert_array_equal(np.asarray(same[1].codes), np.asarray(k_rows.codes))
  assert not np.array_equal(np.asarray(other[1].codes), np.asarray(k_rows.codes))
  assert not np.array_equal(np.asarray(other[0]), np.asarray(q))
