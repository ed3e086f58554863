"""The model-level FDC rate search (`search.run_config_search` -> `search_model_rate`) on the
random tiny model of configs/fdc.py:smoke: it terminates after the stated evaluations, its
bound is (1 + tolerance) x the dense PPL, and the returned rate's PPL, re-measured through
the method registry's calibration and `perplexity`, is within the bound while the nearest
failing rate's is above it (negative control: the bound does separate the two)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from kvlowrank.data import calib as calib_lib, held_out
from kvlowrank.eval.perplexity import perplexity
from kvlowrank.experiment import models
from kvlowrank.experiment.spec import from_config
from kvlowrank.methods import get_method
from kvlowrank.methods.rotated import search
from kvlowrank.resources import shared_dir

ROOT = Path(__file__).resolve().parents[1]
TOL, HI, STEPS = 0.01, 0.5, 2


def _smoke_config():
  spec = importlib.util.spec_from_file_location("_fdc_cfg", ROOT / "configs" / "fdc.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("smoke")      # random:tiny (head dim 32), byte tokenizer


@pytest.mark.skipif(shared_dir() is None, reason="../shared not available (held-out text)")
def test_config_search_terminates_within_tolerance(tmp_path):
  config = _smoke_config()
  lines = []
  rec = search.run_config_search(config, tmp_path, tolerance=TOL, hi=HI, steps=STEPS,
                                 held_out_windows=2, progress=lines.append)
  hist = [(h["rate"], h["ppl"], h["passed"]) for h in rec["history"]]
  # Termination: lo, hi, then STEPS bisections unless hi already passed.
  assert len(hist) == (2 if hist[1][2] else STEPS + 2)
  assert hist[0][0] == 0.0 and hist[1][0] == HI and len(lines) >= len(hist)
  assert json.loads((tmp_path / "search_fdc.json").read_text()) == json.loads(json.dumps(
      {k: v for k, v in rec.items() if k != "path"}))

  # Independent re-measurement on the same held-out windows.
  exp = from_config(config)
  model = models.load(exp.model.path, exp.model.dtype)
  tok = model.require_tokenizer()
  ho = held_out.held_out_windows(tok, exp.calib, dataset=exp.data.dataset,
                                 source=exp.data.source, seq_len=exp.eval.seq_len,
                                 n_windows=2, max_chars=exp.data.max_chars)
  assert list(ho.starts) == rec["held_out"]["starts"]
  calib_tokens, _ = calib_lib.calibration_tokens(tok, exp.calib)
  rspec = exp.method_spec.replace(target_ratio=None, allocation="adaptive")

  def ppl(rate):
    method = "dense" if rate is None else "fdc"
    ms = None if rate is None else rspec.replace(rate=rate)
    params = model.params if rate is None else get_method("fdc").calibrate(
        model.params, model.spec, ms, calib_tokens, workdir=tmp_path)
    return perplexity(params, ho.windows, spec=model.spec, method=method, method_spec=ms,
                      cache_dtype=exp.jnp_cache_dtype, batch_size=2).ppl

  dense = ppl(None)
  np.testing.assert_allclose(rec["dense_ppl"], dense, rtol=1e-6)
  np.testing.assert_allclose(rec["bound"], (1 + TOL) * dense, rtol=1e-6)
  # The returned rate is the largest that passed, and it really is within the bound.
  assert rec["rate"] == max(r for r, _, ok in hist if ok)
  got = ppl(rec["rate"])
  np.testing.assert_allclose(got, rec["ppl"], rtol=1e-5)
  assert got <= rec["bound"]
  # Negative control: the nearest failing rate above it exceeds the bound (re-measured),
  # within the bisection's resolution.
  fails = [r for r, _, ok in hist if not ok and r > rec["rate"]]
  assert fails, "the search never failed: the bound separates nothing on this model"
  nearest = min(fails)
  assert nearest - rec["rate"] <= HI / 2 ** STEPS + 1e-12
  assert ppl(nearest) > rec["bound"]
  # Every recorded verdict matches its value and the bound.
  assert all(ok == (v <= rec["bound"]) for _, v, ok in hist)


def test_search_refuses_a_fixed_target(tmp_path):
  config = _smoke_config()
  exp = from_config(config)
  model = models.load(exp.model.path, exp.model.dtype)
  with pytest.raises(ValueError, match=r"RotatedSpec.target_ratio must be None"):
    search.search_model_rate(model.params, model.spec, exp.method_spec, None, "fdc",
                             np.zeros((1, 8), np.int32), progress=None)
  config.method = "dense"
  with pytest.raises(ValueError, match=r"config.method must be fdc or zack"):
    search.run_config_search(config, tmp_path, progress=None)
