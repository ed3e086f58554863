"""`kvlowrank.compress(model, method, **knobs)`: a method spec, calibrated when the method
calibrates, wrapped as a CompressedModel.

The method may be given as
  * a registered name ("dense", "kivi", "palu", "xquant", "xquant_cl", and any method
    registered later) with its knobs as keyword arguments: compress(m, "kivi", bits=2);
  * a method spec instance (KiviSpec(bits=2), PaluSpec(...)); keywords override fields;
  * an experiment config (a ConfigDict of configs/*.py, or "configs/palu.py:smoke"):
    its `method`, that method's section, `calib` and `cache_dtype` are used.
Knobs are validated by the method registry (kvlowrank.methods.Method.build_spec plus the
method's model checks) before any work: an unknown or bad knob is one ValueError naming
the field. Calibration goes through the harness (kvlowrank.experiment.evaluate
.calibrated_params): its result is saved with orbax under
<cache_dir>/calib/<calibration hash> and restored on the next call with the same model,
resolved method spec (every knob, defaults included) and calibration data.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import ml_collections

from kvlowrank.api.compressed import CompressedModel
from kvlowrank.api.load import load
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment.evaluate import calibrated_params
from kvlowrank.experiment.spec import from_config
from kvlowrank.loaders import LoadedModel
from kvlowrank.methods import get_method, methods


def default_cache_dir() -> Path:
  """$KVLOWRANK_CACHE, else ~/.cache/kvlowrank (calibrations live in <it>/calib/<hash>)."""
  return Path(os.environ.get("KVLOWRANK_CACHE") or Path.home() / ".cache" / "kvlowrank")


def _config_file(path: str):
  module, arg = config_lib.load_file(path)
  return module.get_config(arg or None)


def _method_of_spec(spec) -> str:
  for name in methods():
    if type(spec) is get_method(name).spec_cls:  # pylint: disable=unidiomatic-typecheck
      return name
  raise ValueError(f"compress: {type(spec).__name__} is not the spec of a registered method "
                   f"({', '.join(methods())})")


def _resolve(method, knobs: dict) -> tuple[str, dict, Optional[dict], Optional[str]]:
  """(method name, knob section, calib section or None, cache dtype or None)."""
  if isinstance(method, str) and ".py" in method:
    method = _config_file(method)
  if isinstance(method, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    d = method.to_dict()
    if "method" not in d:
      raise ValueError("compress: the config has no 'method' field")
    name = d["method"]
    get_method(name)  # unknown name: one line listing the known ones
    return name, {**(d.get(name) or {}), **knobs}, d.get("calib"), d.get("cache_dtype")
  if isinstance(method, str):
    get_method(method)
    return method, dict(knobs), None, None
  if dataclasses.is_dataclass(method) and not isinstance(method, type):
    name = _method_of_spec(method)
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}
    return name, {**fields, **knobs}, None, None
  raise ValueError(f"compress: method must be a registered name ({', '.join(methods())}), a "
                   f"method spec or an experiment config, got {type(method).__name__}")


def compress(model: Union[str, LoadedModel], method: Any = "dense", *,
             calib: Optional[Union[Mapping, Any]] = None, cache_dtype: Optional[str] = None,
             cache_dir: Optional[Union[str, Path]] = None, progress: bool = True,
             **knobs) -> CompressedModel:
  """Applies a KV-cache method to a model.

  Args:
    model: a LoadedModel (kvlowrank.load) or anything kvlowrank.load accepts.
    method: a registered method name, a method spec, or an experiment config / config
      file path (see the module docstring).
    calib: calibration data for methods that calibrate: a mapping of
      kvlowrank.data.calib.CalibSpec fields (dataset, split, n_samples, seq_len, seed,
      path, max_chars, ...) or a CalibSpec; default CalibSpec() (16 x 512 tokens of
      WikiText-2 validation). Ignored by methods that do not calibrate.
    cache_dtype: storage dtype of exact K/V and residual windows ("bfloat16" default,
      "float32", "float16").
    cache_dir: where calibrations are cached (default: default_cache_dir()).
    progress: progress bars (calibration, and later generation/evaluation).
    **knobs: the method's spec fields (e.g. bits=2, residual=0 for KIVI).
  Returns:
    CompressedModel.
  Raises:
    ValueError naming an unknown method, an unknown or invalid knob or calib field, or a
    knob that does not fit the model — before any calibration.
  """
  model = load(model, progress=progress)
  name, section, calib_cfg, cfg_dtype = _resolve(method, knobs)
  if dataclasses.is_dataclass(calib) and not isinstance(calib, type):
    calib = dataclasses.asdict(calib)
  if calib is not None and not isinstance(calib, Mapping):
    raise ValueError(f"compress: calib must be a mapping of CalibSpec fields or a CalibSpec, "
                     f"got {type(calib).__name__}")
  # The harness config of this compression: its calibration hash keys the orbax cache.
  config = config_lib.base_config()
  config.model.path = str(model.source)
  config.model.dtype = str(model.params["embed"].dtype)
  config.method = name
  config.cache_dtype = cache_dtype or cfg_dtype or "bfloat16"
  config[name] = ml_collections.ConfigDict(section)
  for key, value in {**(calib_cfg or {}), **dict(calib or {})}.items():
    try:
      config.calib[key] = value
    except TypeError as e:  # ml_collections' type check: one line naming the field
      raise ValueError(f"calib.{key}: {e}") from None
  # The harness's default lengths (eval 2048, calibration windows) are capped at the model's
  # trained context; a calibration length given explicitly is checked as given.
  config.eval.seq_len = min(config.eval.seq_len, model.spec.max_seq_len)
  if "seq_len" not in dict(calib or {}) and "seq_len" not in (calib_cfg or {}):
    config.calib.seq_len = min(config.calib.seq_len, model.spec.max_seq_len)
  exp = from_config(config, model.spec)  # every knob checked here, before any work
  # Hash the resolved spec, so equal specs given differently share one calibration.
  config[name] = ml_collections.ConfigDict(
      {f.name: getattr(exp.method_spec, f.name)
       for f in dataclasses.fields(exp.method_spec) if f.init})
  calibrates = get_method(name).calibrate is not None
  bar = None
  if calibrates and progress:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=1, desc=f"calibrating {name}", unit="step", leave=False)
  start = time.perf_counter()
  try:
    params, info = calibrated_params(config, exp, model, Path(cache_dir or default_cache_dir()))
  finally:
    if bar is not None:
      bar.update(1)
      bar.close()
  if info is not None and progress:
    how = "restored from" if info["restored"] else "saved to"
    print(f"{name}: calibration {how} {info['path']} ({time.perf_counter() - start:.1f} s)")
  return CompressedModel(model=model, method=name, spec=exp.method_spec, params=params,
                         cache_dtype=exp.cache_dtype, calibration=info)
