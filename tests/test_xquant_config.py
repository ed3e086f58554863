"""configs/xquant.py and the XQuant points of configs/main.py resolve on SmolLM2's shape;
the registry's bytes match the paper's accounting (GQA XQuant = KV quant at equal bits)."""

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import pytest

from kvlowrank import ModelSpec
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment.spec import from_config
from kvlowrank.methods import get_method
from kvlowrank.resources import shared_dir
from docs_check import cites_results

REPO = Path(__file__).resolve().parents[1]
SMOL = ModelSpec(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                 head_dim=64, ffn_dim=1536, tie_embeddings=True)


def _module(name):
  spec = importlib.util.spec_from_file_location(f"_cfg_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", ["xquant", "main"])
def test_every_sweep_point_resolves(name):
  module = _module(name)
  base = module.get_config()
  for point in module.get_sweep():
    exp = from_config(config_lib.apply_overrides(base, point), SMOL)
    assert exp.method == point["method"]
  if shared_dir() is not None:
    from_config(module.get_config("smoke"))
  with pytest.raises(ValueError, match="unknown config arg 'bitz'"):
    module.get_config("bitz=3")


def test_xquant_config_fields_and_bytes():
  module = _module("xquant")
  assert "python experiments/" in module.__doc__ and cites_results(module.__doc__)
  c = module.get_config("bits=2")
  xq = from_config(c, SMOL)
  kivi = from_config(config_lib.apply_overrides(c, {"method": "kivi"}), SMOL)
  bytes_of = lambda e: get_method(e.method).kv_bytes_per_token(SMOL, e.method_spec, None,
                                                                jnp.bfloat16)
  # GQA latent XQuant stores X·U_k and X·U_v (192 channels each): same bytes as KIVI at
  # equal bits and groups (paper §3.4): 30 x 3 heads x (2 x 16 B codes + 2 x 8 B scales).
  assert bytes_of(xq) == bytes_of(kivi) == 30 * 3 * (2 * 16 + 2 * 2 * 2 * 64 / 64)
  x4 = from_config(config_lib.apply_overrides(c, {"xquant.path": "x", "xquant.bits": 4}), SMOL)
  assert bytes_of(x4) == 30 * (4 * 576 / 8 + 2 * 2 * 576 / 64)   # one D-wide X per token
  with pytest.raises(ValueError, match="config.xquant.group_size"):
    from_config(config_lib.apply_overrides(c, {"xquant.group_size": 128}), SMOL)
  with pytest.raises(ValueError, match="config.xquant_cl.base_layer"):
    from_config(config_lib.apply_overrides(
        c, {"method": "xquant_cl", "xquant_cl.base_layer": 30}), SMOL)
