"""One evaluation: config -> perplexity in each mode -> one JSONL record in the workdir.

Pipeline of `run(config, workdir)`:
  0. a point already in workdir/results.jsonl (same config hash) is skipped, unless
     `overwrite`;
  1. validate the whole config (kvlowrank.experiment.spec) before loading anything;
  2. load the model (memoised per process), run the checks that need it (the method's
     feasibility, context lengths vs max_seq_len), cut the evaluation text into windows
     and, when a calibration must run, sample its text: every input is read and checked
     before anything is written to the workdir;
  3. if the method calibrates: restore its calibrated parameters from
     workdir/calib/<calibration hash> (orbax, kvlowrank.ckpt), or calibrate on seeded
     samples of the calibration split and save them there;
  4. score every window in each mode of `eval.modes` (kvlowrank.eval.perplexity);
     with `eval.drift_tokens` > 0, measure generation drift against the dense model
     (kvlowrank.eval.drift) on the first `eval.drift_prompts` windows' first tokens;
  5. append the record to workdir/results.jsonl (atomically, replacing an earlier record
     of the point) and return it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import kvlowrank
from kvlowrank import ckpt
from kvlowrank.experiment import param_delta
from kvlowrank.cache.base import caches_nbytes, init_caches
from kvlowrank.data import calib as calib_lib
from kvlowrank.data import text as text_lib
from kvlowrank.eval import drift as drift_lib
from kvlowrank.eval.perplexity import perplexity
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import models, records
from kvlowrank.experiment.spec import DataSpec, Experiment, from_config
from kvlowrank.methods import dense_kv_bytes_per_token, get_method
from kvlowrank.model.params import count_params

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def eval_windows(model_path: str, model_dtype: str, data: DataSpec, seq_len: int,
                 max_windows: int) -> tuple[np.ndarray, str, int]:
  """(windows int32 [W, seq_len] (read-only), text source, tokens in the split)."""
  tok = models.load(model_path, model_dtype).require_tokenizer()
  txt, where = text_lib.load_text(data.dataset, data.split, source=data.source,
                                  path=data.path, path_format=data.path_format,
                                  joiner=data.joiner)
  ids = text_lib.tokenize(tok, txt, add_bos=data.add_bos, max_chars=data.max_chars)
  w = text_lib.windows(ids, seq_len, max_windows, source=where)
  w.setflags(write=False)
  return w, where, len(ids)


@functools.lru_cache(maxsize=4)
def calib_windows(model_path: str, model_dtype: str, calib: calib_lib.CalibSpec
                  ) -> tuple[np.ndarray, str]:
  """(calibration windows int32 [n_samples, seq_len] (read-only), text source)."""
  tokens, where = calib_lib.calibration_tokens(
      models.load(model_path, model_dtype).require_tokenizer(), calib)
  tokens.setflags(write=False)
  return tokens, where


def calibration_path(config, workdir) -> Path:
  """Where the calibration of `config` is checkpointed in `workdir`."""
  return Path(workdir) / "calib" / config_lib.calibration_hash(config)


@functools.lru_cache(maxsize=4)
def _drift_reference(model_path: str, model_dtype: str, data: DataSpec, seq_len: int,
                     max_windows: int, n_prompts: int, prompt_len: int, n_tokens: int,
                     cache_dtype: str):
  """(prompts, the dense model's reference rollout), memoised: a sweep computes it once."""
  windows = eval_windows(model_path, model_dtype, data, seq_len, max_windows)[0]
  if windows.shape[0] < n_prompts:
    raise ValueError(f"config.eval.drift_prompts={n_prompts} exceeds the {windows.shape[0]} "
                     "evaluation windows")
  prompts = np.asarray(windows[:n_prompts, :prompt_len])
  model = models.load(model_path, model_dtype)
  return prompts, drift_lib.reference(model.params, model.spec, prompts, n_tokens,
                                      jnp.dtype(cache_dtype))


def measure_drift(exp: Experiment, model, params) -> Optional[dict]:
  """Generation drift of the experiment's method against the dense model at the same
  cache dtype (None when eval.drift_tokens is 0)."""
  ev = exp.eval
  if not ev.drift_tokens:
    return None
  prompts, ref = _drift_reference(exp.model.path, exp.model.dtype, exp.data, ev.seq_len,
                                  ev.max_windows, ev.drift_prompts, ev.drift_prompt_length,
                                  ev.drift_tokens, exp.cache_dtype)
  res = drift_lib.drift(model.params, params, model.spec, prompts, ev.drift_tokens,
                        method=get_method(exp.method).cache, method_spec=exp.method_spec,
                        cache_dtype=exp.jnp_cache_dtype, ref=ref)
  log.info("%s drift: greedy match %.3f, KL %.4g over %d x %d tokens (%.1f s)", exp.method,
           res.greedy_match, res.kl, res.n_prompts, res.n_tokens, res.seconds)
  return res.asdict()


def calibrated_params(config, exp: Experiment, model, workdir, *, tokens=None
                      ) -> tuple[object, Optional[dict]]:
  """The parameters to evaluate: the model's, or the method's calibrated ones.

  A calibration is keyed by `calibration_hash(config)` (model, the method's resolved spec,
  calib section): an orbax checkpoint in workdir/calib/<hash> is restored when present,
  otherwise the method calibrates and the result is saved there.

  Args:
    tokens: optional (calibration windows, source) already sampled (`calib_windows`).
  Returns:
    (params, info dict or None when the method does not calibrate).
  """
  method = get_method(exp.method)
  if method.calibrate is None:
    return model.params, None
  h = config_lib.calibration_hash(config)
  path = calibration_path(config, workdir)
  start = time.perf_counter()
  if ckpt.exists(path):
    arrays, meta = ckpt.restore(path)
    changed = dict(zip(meta["changed"], arrays))
    params = param_delta.apply(model.params, changed, meta["removed"])
    log.info("restored calibration %s from %s", h, path)
    return params, {"hash": h, "path": str(path), "restored": True,
                    "seconds": time.perf_counter() - start, "source": meta.get("source")}
  tokens, where = tokens or calib_windows(exp.model.path, exp.model.dtype, exp.calib)
  params = method.calibrate(model.params, model.spec, exp.method_spec, tokens,
                            workdir=str(workdir))
  meta = {"method": exp.method, "method_spec": _jsonable(exp.method_spec),
          "calib": dataclasses.asdict(exp.calib), "source": where, "model": model.source}
  # Only what the calibration added or changed is saved; restore re-applies it to the
  # loaded model (bitwise identical).
  changed, meta["removed"] = param_delta.diff(model.params, params)
  if not changed and not meta["removed"]:   # e.g. evict around a cache that does not calibrate
    return params, None
  meta["changed"] = list(changed)
  ckpt.save(path, list(changed.values()), meta)
  return params, {"hash": h, "path": str(path), "restored": False,
                  "seconds": time.perf_counter() - start, "source": where}


def _jsonable(spec) -> dict:
  return dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else {}


def run(config, workdir, *, results_name: str = records.RESULTS,
        overwrite: bool = False) -> dict:
  """Evaluates one config and appends its record to workdir/results_name.

  Args:
    config: evaluation ConfigDict (kvlowrank.experiment.config layout).
    workdir: output folder (created once every input has been read and checked).
    results_name: JSONL file name inside workdir.
    overwrite: evaluate and replace a point that workdir/results_name already holds
      (default: return its record, marked "skipped": True, without running).
  Returns:
    the record (also written): key, config, method, bits, KV bytes/token, compression
    vs bf16, per-mode perplexity results, ppl_<mode>, tokens, windows, timings.
  Raises:
    ValueError / FileNotFoundError naming the bad field or file, before any calibration
    or evaluation work and before anything is written.
  """
  start = time.perf_counter()
  key = config_lib.config_hash(config)
  workdir = Path(workdir)
  if not overwrite:
    old = records.find(workdir / results_name, key)
    if old is not None:
      log.info("point %s is already in %s: skipped (overwrite=True replaces it)", key,
               workdir / results_name)
      return dict(old, skipped=True)
  exp0 = from_config(config)  # fail fast on config errors, before loading the model
  model = models.load(exp0.model.path, exp0.model.dtype)
  exp = from_config(config, model.spec)  # + checks that need the model
  method = get_method(exp.method)
  windows, text_source, n_text_tokens = eval_windows(
      exp.model.path, exp.model.dtype, exp.data, exp.eval.seq_len, exp.eval.max_windows)
  tokens = None
  if method.calibrate is not None and not ckpt.exists(calibration_path(config, workdir)):
    tokens = calib_windows(exp.model.path, exp.model.dtype, exp.calib)
  workdir.mkdir(parents=True, exist_ok=True)
  params, calib_info = calibrated_params(config, exp, model, workdir, tokens=tokens)
  cache_dtype = exp.jnp_cache_dtype
  bits = method.bits_label(exp.method_spec, cache_dtype)
  results = {}
  for mode in exp.eval.modes:
    res = perplexity(params, windows, spec=model.spec, method=method.cache,
                     method_spec=exp.method_spec, cache_dtype=cache_dtype, mode=mode,
                     batch_size=exp.eval.batch_size, prompt_len=exp.eval.prompt_len,
                     prefill_chunk=exp.eval.prefill_chunk, progress=bool(config.progress),
                     desc=f"{exp.method}-{bits} {mode}",
                     allow_beyond_max_seq_len=exp.eval.allow_beyond_max_seq_len)
    log.info("%s %s: ppl %.4f over %d tokens (%.1f s)", exp.method, mode, res.ppl,
             res.n_tokens, res.seconds)
    results[mode] = res.asdict()
  drift = measure_drift(exp, model, params)
  kv_bytes = method.kv_bytes_per_token(model.spec, exp.method_spec, params, cache_dtype)
  bf16_bytes = dense_kv_bytes_per_token(model.spec, jnp.bfloat16)
  caches = init_caches(method.cache, exp.method_spec, model.spec, params, batch=1,
                       capacity=exp.eval.seq_len, dtype=cache_dtype)
  record = {
      "key": config_lib.config_hash(config),
      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "config": config.to_dict(),
      "method": exp.method, "bits": bits, "method_spec": _jsonable(exp.method_spec),
      "cache_dtype": exp.cache_dtype,
      "model": {"path": exp.model.path, "source": model.source, "dtype": exp.model.dtype,
                "n_params": count_params(model.params)},
      "data": {"dataset": exp.data.dataset, "split": exp.data.split, "source": text_source,
               "text_tokens": n_text_tokens},
      "seq_len": exp.eval.seq_len, "windows": int(windows.shape[0]),
      "tokens": int(windows.shape[0] * (exp.eval.seq_len - 1)),
      "kv_bytes_per_token": kv_bytes, "bf16_kv_bytes_per_token": bf16_bytes,
      "compression_vs_bf16": bf16_bytes / kv_bytes,
      # Allocated cache bytes / capacity at capacity seq_len: includes residual windows
      # and padding, unlike the asymptotic kv_bytes_per_token.
      "allocated_bytes_per_token": caches_nbytes(caches) / exp.eval.seq_len,
      "results": results,
      **{f"ppl_{m}": r["ppl"] for m, r in results.items()},
      "drift": drift,
      "calibration": calib_info,
      "seconds": time.perf_counter() - start,
      "versions": {"jax": jax.__version__, "kvlowrank": kvlowrank.__version__,
                   "backend": jax.default_backend()},
  }
  records.append(workdir / results_name, record, replace=True)
  return record
