"""Bad configs fail early with errors naming the field; every configs/*.py loads."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kvlowrank import ModelSpec
from kvlowrank.methods import KiviCache, KiviSpec
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment.spec import from_config
from kvlowrank.methods import get_method
from kvlowrank.resources import shared_dir
from docs_check import cites_results

REPO = Path(__file__).resolve().parents[1]
SMOL = ModelSpec(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                 head_dim=64, ffn_dim=1536, tie_embeddings=True)


def config_module(name):
  spec = importlib.util.spec_from_file_location(f"_cfg_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def kivi_config(**kivi):
  c = config_module("kivi").get_config("bits=4")
  return config_lib.apply_overrides(c, {f"kivi.{k}": v for k, v in kivi.items()})


def test_valid_kivi_config():
  exp = from_config(kivi_config(), SMOL)
  assert (exp.method_spec.bits, exp.method_spec.group_size, exp.method_spec.residual) == \
      (4, 32, 128)
  assert exp.eval.modes == ("prefill", "decode")
  # KIVI-4 on SmolLM2: 30 layers x 3 kv heads x (32 + 32 B of K/V codes + 8 B of K
  # scales/zeros (2 x 2 B x 64 channels / 32 tokens) + 8 B of V scales/zeros).
  kivi = get_method("kivi")
  assert kivi.kv_bytes_per_token(SMOL, exp.method_spec, None, None) == 7200.0
  # Same as the cache's own accounting (independent code in kvlowrank.methods.kivi.cache).
  cache = KiviCache.init(exp.method_spec, SMOL, batch=1, capacity=32)
  assert cache.bytes_per_token() * SMOL.n_layers == 7200.0
  k2 = KiviSpec(bits=2)
  assert kivi.kv_bytes_per_token(SMOL, k2, None, None) == 4320.0 == \
      KiviCache.init(k2, SMOL, batch=1, capacity=32).bytes_per_token() * SMOL.n_layers
  assert get_method("dense").kv_bytes_per_token(SMOL, None, None, "bfloat16") == 23040.0


@pytest.mark.parametrize("overrides,match", [
    ({"bits": 5}, r"bits must be one of \(2, 3, 4, 8\), got 5"),
    ({"residual": -32}, r"residual must be an int >= 0, got -32"),
    ({"residual": 48}, r"residual \(48\) must be a multiple of KiviSpec.group_size"),
])
def test_bad_kivi_knobs(overrides, match):
  with pytest.raises(ValueError, match=match):
    from_config(kivi_config(**overrides), SMOL)


def test_group_size_must_divide_head_dim():
  c = kivi_config(group_size=24, residual=96)
  from_config(c)  # fine without a model...
  with pytest.raises(ValueError, match=r"config.kivi.group_size \(24\) must divide the "
                                       r"model's head_dim \(64\)"):
    from_config(c, SMOL)  # ...caught as soon as the model is known


def test_unknown_method_and_keys():
  c = config_lib.base_config()
  c.method = "kivy"
  with pytest.raises(ValueError, match=r"unknown config.method 'kivy'; known: .*dense.*kivi"):
    from_config(c)
  c = config_lib.base_config()
  c.kivi = dict(bits=2, bitz=3)
  c.method = "kivi"
  with pytest.raises(ValueError, match=r"config.kivi: unknown config key\(s\) 'bitz'"):
    from_config(c)
  c = config_lib.base_config()
  c.evaluation = dict(seq_len=3)
  with pytest.raises(ValueError, match=r"unknown config key\(s\) 'evaluation'"):
    from_config(c)
  c = config_lib.base_config()
  c.eval.window = 3
  with pytest.raises(ValueError, match=r"config.eval: unknown config key\(s\) 'window'"):
    from_config(c)
  with pytest.raises(ValueError, match=r"override key 'kivi.bitz': config has no "
                                       r"'kivi.bitz'"):
    config_lib.apply_overrides(kivi_config(), {"kivi.bitz": 2})


@pytest.mark.parametrize("section,key,value,match", [
    ("eval", "modes", ("prefill", "greedy"), "config.eval.modes"),
    ("eval", "seq_len", 1, "config.eval.seq_len must be >= 2"),
    ("eval", "batch_size", 0, "config.eval.batch_size must be positive"),
    ("eval", "drift_tokens", -1, "config.eval.drift_tokens must be >= 0"),
    ("data", "dataset", "c4", "config.data.dataset/split 'c4'/'test' unknown"),
    ("data", "source", "web", "config.data.source must be one of"),
    ("calib", "split", "test", "calib.split must not be 'test'"),
    ("model", "dtype", "float16", "config.model.dtype must be float32|bfloat16"),
    (None, "cache_dtype", "int8", "config.cache_dtype must be one of"),
])
def test_bad_fields(section, key, value, match):
  c = config_lib.base_config()
  (c[section] if section else c)[key] = value
  with pytest.raises(ValueError, match=match):
    from_config(c)


def test_bad_drift_fields():
  c = config_lib.base_config()
  c.eval.update(seq_len=64, drift_tokens=8, drift_prompts=0)
  with pytest.raises(ValueError, match="config.eval.drift_prompts must be >= 1"):
    from_config(c)
  c.eval.update(drift_prompts=2, drift_prompt_len=65)
  with pytest.raises(ValueError, match="config.eval.drift_prompt_len must be in"):
    from_config(c)
  c.eval.drift_prompt_len = 0
  assert from_config(c).eval.drift_prompt_length == 32  # seq_len // 2
  c.eval.prompt_len = 16
  assert from_config(c).eval.drift_prompt_length == 16


@pytest.mark.parametrize("name", ["baseline", "kivi", "main"])
def test_config_files(name):
  module = config_module(name)
  assert "python experiments/" in module.__doc__ and cites_results(module.__doc__)
  from_config(module.get_config())
  if shared_dir() is not None:
    from_config(module.get_config("smoke"))
  with pytest.raises(ValueError, match="unknown config arg 'bitz'"):
    module.get_config("bitz=3")


def test_launcher_rejects_unknown_override(tmp_path):
  """The absl launcher's locked config: a typo'd --config.x is a one-line error."""
  out = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "evaluate.py"),
       "--config=configs/kivi.py", "--config.kivi.bitz=3", f"--workdir={tmp_path}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "bitz" in out.stderr and "Traceback" not in out.stderr
