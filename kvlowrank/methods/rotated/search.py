"""Binary search of the largest removal rate r whose perplexity stays within a tolerance of
the dense model's (FDC §6.4 / ZACK §5.2: "the maximum p that achieves 99% of the baseline
accuracy").

Translation: the papers bound a task ACCURACY at >= 99% of the uncompressed model's; our
harness measures perplexity, where lower is better, so the bound here is
PPL(r) <= (1 + tolerance) · PPL(dense), tolerance = 0.01 by default ("within 1%"), on a
held-out split: WikiText-2 validation windows (not the test split the reports use) that
share no token with the calibration windows, which are drawn from the same validation
split (`kvlowrank.data.held_out`: one token stream, disjoint index ranges).

The search runs on r (the overall compression is monotone non-decreasing in r, and the
papers search it through r's map F_p). Perplexity need not be exactly monotone in r, so the
search keeps the largest rate it has SEEN pass and bisects between it and the smallest seen
failure; it stops after `steps` evaluations (r resolution (hi - lo) / 2^steps), so it always
terminates, and the returned rate always satisfied the bound when it was measured.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np

from kvlowrank.eval.perplexity import perplexity
from kvlowrank.methods.rotated.compression import compress, factorise
from kvlowrank.methods.rotated.spec import RotatedSpec


@dataclasses.dataclass(frozen=True)
class SearchResult:
  rate: float                  # largest rate seen within tolerance
  value: float                 # its perplexity
  baseline: float              # dense perplexity
  bound: float                 # (1 + tolerance) · baseline
  history: tuple               # ((rate, value, passed), ...) in evaluation order


def binary_search_rate(evaluate: Callable[[float], float], baseline: float, *,
                       tolerance: float = 0.01, lo: float = 0.0, hi: float = 0.5,
                       steps: int = 8, progress: Optional[Callable[[str], None]] = print
                       ) -> SearchResult:
  """Largest r in [lo, hi] with evaluate(r) <= (1 + tolerance) · baseline (module doc).

  Args:
    evaluate: r -> perplexity (lower is better).
    baseline: the dense perplexity.
    tolerance: relative bound (0.01 = within 1%).
    lo, hi: the search interval, 0 <= lo < hi < 1; `lo` is evaluated first and must pass.
    steps: evaluations after lo and hi (the bisection depth).
    progress: called with one line per evaluation (None: silent).
  Raises:
    ValueError: bad arguments, or `lo` itself exceeds the bound.
  """
  if not 0.0 <= lo < hi < 1.0:
    raise ValueError(f"search interval must satisfy 0 <= lo < hi < 1, got [{lo}, {hi}]")
  if not tolerance >= 0:
    raise ValueError(f"search tolerance must be >= 0, got {tolerance}")
  if steps < 0:
    raise ValueError(f"search steps must be >= 0, got {steps}")
  bound = (1.0 + tolerance) * baseline
  history = []

  def probe(r):
    v = float(evaluate(r))
    ok = bool(np.isfinite(v) and v <= bound)
    history.append((float(r), v, ok))
    if progress is not None:
      progress(f"[rate search {len(history)}] r={r:.5f}: ppl {v:.4f} "
               f"{'<=' if ok else '>'} {bound:.4f} ({'pass' if ok else 'fail'})")
    return ok

  if not probe(lo):
    raise ValueError(f"rate search: r={lo} already exceeds the bound ({history[-1][1]:.4f} > "
                     f"{bound:.4f}); nothing to search")
  good, bad = lo, hi
  if probe(hi):
    good = hi
  else:
    for _ in range(steps):
      mid = 0.5 * (good + bad)
      if probe(mid):
        good = mid
      else:
        bad = mid
  value = next(v for r, v, ok in reversed(history) if ok and r == good)
  return SearchResult(rate=good, value=value, baseline=float(baseline), bound=bound,
                      history=tuple(history))


def search_model_rate(params, spec, rspec: RotatedSpec, calib, recipe: str, windows, *,
                      tolerance: float = 0.01, hi: float = 0.5, steps: int = 8,
                      cache_dtype=jnp.bfloat16, batch_size: int = 1,
                      progress: Optional[Callable[[str], None]] = print):
  """Binary-searches RotatedSpec.rate on held-out `windows` (prefill-mode perplexity).

  Args:
    params: dense parameters; spec: model spec; rspec: the spec whose `rate` is searched
      (target_ratio must be None, allocation adaptive); calib: `statistics(...)` output;
    recipe: "fdc" | "zack"; windows: int [W, T] held-out windows.
  Returns:
    (SearchResult, the compressed params at the found rate, its RotatedLayout).
  """
  if rspec.target_ratio is not None or rspec.allocation != "adaptive":
    raise ValueError("rate search: RotatedSpec.target_ratio must be None and allocation "
                     "'adaptive' (the search sets the rate)")
  ppl = lambda p, method, ms: perplexity(p, windows, spec=spec, method=method, method_spec=ms,
                                         cache_dtype=cache_dtype, mode="prefill",
                                         batch_size=batch_size).ppl
  baseline = ppl(params, "dense", None)
  if progress is not None:
    progress(f"[rate search] dense ppl {baseline:.4f} on {len(windows)} held-out windows")
  factors = factorise(params, spec, rspec, calib, recipe)

  def evaluate(r):
    cparams, layout, _ = compress(params, spec, rspec.replace(rate=r), calib, recipe, factors)
    if progress is not None:
      progress(f"[rate search] r={r:.5f}: KV dims removed {layout.compression_ratio():.4f}")
    return ppl(cparams, "rotated", rspec.replace(rate=r))

  res = binary_search_rate(evaluate, baseline, tolerance=tolerance, hi=hi, steps=steps,
                           progress=progress)
  cparams, layout, _ = compress(params, spec, rspec.replace(rate=res.rate), calib, recipe,
                                factors)
  return res, cparams, layout


def run_config_search(config, workdir, *, tolerance: float = 0.01, hi: float = 0.5,
                      steps: int = 8, held_out_windows: int = 4, progress=print) -> dict:
  """The rate search of an fdc/zack evaluation config (experiments/search_rate.py).

  Loads the config's model, calibrates on its calib section (Grams cached in workdir),
  takes `held_out_windows` windows of eval.seq_len tokens of the data.dataset validation
  split that share no token with the calibration windows (`kvlowrank.data.held_out`: the
  calib windows are random offsets of that same split, the evaluation reports use the test
  split), searches the rate and writes workdir/search_<method>.json.

  Returns:
    the JSON record (rate, its PPL, dense PPL, bound, widths, removed fraction, history,
    the held-out and calibration windows' token offsets).
  """
  # Imported here: kvlowrank.experiment imports the methods package.
  import json  # pylint: disable=C0415
  from pathlib import Path  # pylint: disable=C0415
  from kvlowrank.data import calib as calib_lib, held_out  # pylint: disable=C0415
  from kvlowrank.experiment import models  # pylint: disable=C0415
  from kvlowrank.experiment.spec import from_config  # pylint: disable=C0415
  from kvlowrank.methods.rotated.method import statistics  # pylint: disable=C0415
  exp0 = from_config(config)
  if exp0.method not in ("fdc", "zack"):
    raise ValueError(f"config.method must be fdc or zack for the rate search, got "
                     f"{exp0.method!r}")
  model = models.load(exp0.model.path, exp0.model.dtype)
  exp = from_config(config, model.spec)
  rspec = exp.method_spec.replace(target_ratio=None, allocation="adaptive")
  tok = model.require_tokenizer()
  calib_tokens, _ = calib_lib.calibration_tokens(tok, exp.calib)
  ho = held_out.held_out_windows(tok, exp.calib, dataset=exp.data.dataset,
                                 source=exp.data.source, seq_len=exp.eval.seq_len,
                                 n_windows=held_out_windows, max_chars=exp.data.max_chars)
  windows = ho.windows
  stats = statistics(model.params, model.spec, rspec, calib_tokens, workdir, exp.method)
  res, _, layout = search_model_rate(model.params, model.spec, rspec, stats, exp.method,
                                     windows, tolerance=tolerance, hi=hi, steps=steps,
                                     cache_dtype=exp.jnp_cache_dtype,
                                     batch_size=len(windows), progress=progress)
  record = {"method": exp.method, "rate": res.rate, "ppl": res.value,
            "dense_ppl": res.baseline, "bound": res.bound, "tolerance": tolerance,
            "held_out": {"source": ho.where, "windows": int(len(windows)),
                         "seq_len": exp.eval.seq_len, "starts": list(ho.starts),
                         "calib_starts": list(ho.calib_starts),
                         "calib_seq_len": exp.calib.seq_len,
                         "same_token_stream": ho.shared_text},
            "kv_dims_removed": layout.compression_ratio(),
            "k_widths": layout.k_widths, "v_widths": layout.v_widths,
            "calibration": rspec.calibration,
            "history": [dict(rate=r, ppl=v, passed=ok) for r, v, ok in res.history]}
  out = Path(workdir) / f"search_{exp.method}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(record, indent=1))
  record["path"] = str(out)
  return record
