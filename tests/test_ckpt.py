"""kvlowrank.ckpt orbax round trip (bitwise), and the evaluation pipeline's calibration
cache: calibrate once, restore afterwards, identical results."""

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import logging as absl_logging

from kvlowrank import ModelSpec, ckpt
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, models, records
from kvlowrank.methods import Method, dense_kv_bytes_per_token, get_method, register_method
from kvlowrank.model import forward

from np_params import np_init_params

SPEC = ModelSpec(vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64)


def calibrated_tree():
  """A parameter pytree as a method would produce: bf16 weights, an added per-layer
  factor, an int8 leaf and a float32 leaf of a different layout."""
  params = np_init_params(SPEC, seed=0, scale=0.3, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  for i, lp in enumerate(params["layers"]):
    lp["k_factor"] = jnp.asarray(rng.standard_normal((SPEC.dim, 3 + i)), jnp.float32)
    lp["codes"] = jnp.asarray(rng.integers(-8, 8, (5,)), jnp.int8)
  return params


_forward = jax.jit(forward, static_argnames="spec")


def logits_of(params):
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 48, (2, 9)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  return np.asarray(_forward(params, tokens, pos, None, SPEC)[0])


def test_round_trip_bitwise(tmp_path):
  tree = calibrated_tree()
  meta = {"method": "test", "ranks": [3, 4], "nested": {"seed": 3}}
  path = ckpt.save(tmp_path / "c", tree, meta)
  assert ckpt.exists(path)
  back, meta_back = ckpt.restore(path)
  assert meta_back == meta
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  ref = logits_of(tree)
  np.testing.assert_array_equal(logits_of(back), ref)
  # Negative control: one ulp in one bf16 weight changes the logits bitwise.
  w = back["layers"][0]["wq"]
  bits = np.asarray(w).view(np.uint16).copy()
  bits[0, 0] += 1
  back["layers"][0]["wq"] = jnp.asarray(bits.view(jnp.bfloat16))
  assert not np.array_equal(logits_of(back), ref)


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no kvlowrank checkpoint"):
    ckpt.restore(tmp_path / "missing")
  with pytest.raises(ValueError, match="not an array"):
    ckpt.save(tmp_path / "a", {"x": 1.0})
  with pytest.raises(ValueError, match="JSON"):
    ckpt.save(tmp_path / "b", {"x": jnp.zeros(2)}, {"bad": object()})
  ckpt.save(tmp_path / "c", {"x": jnp.zeros(2)})
  with pytest.raises(FileExistsError):
    ckpt.save(tmp_path / "c", {"x": jnp.zeros(2)})


# A calibrating method for the pipeline test: scales every layer's wv by a factor that
# depends on the calibration tokens and stores it, so restored params must carry it.
CALLS = []


@dataclasses.dataclass(frozen=True)
class _ScaleSpec:
  strength: float = 0.5


def _calibrate(params, spec, mspec, calib_tokens, *, workdir):
  CALLS.append(np.asarray(calib_tokens).copy())
  f = 1.0 + mspec.strength * float(np.mean(calib_tokens)) / spec.vocab_size
  layers = [dict(lp, wv=lp["wv"] * f, calib_factor=jnp.full((1,), f, jnp.float32))
            for lp in params["layers"]]
  return dict(params, layers=layers)


def _method():
  try:
    return get_method("_test_scale")
  except ValueError:
    return register_method(Method(
        name="_test_scale", cache="dense", spec_cls=_ScaleSpec, calibrate=_calibrate,
        kv_bytes_per_token=lambda s, m, p, d: dense_kv_bytes_per_token(s, d)))


def test_pipeline_calibrates_once(tmp_path):
  _method()
  text = tmp_path / "text.txt"
  text.write_text("".join(f"line {i} of some calibration text\n" for i in range(60)))
  c = config_lib.base_config()
  c.model.path = "random:tiny"
  c.method = "_test_scale"
  c._test_scale = dict(strength=0.5)
  c.cache_dtype = "float32"
  c.data.path, c.calib.path = str(text), str(text)
  c.eval.update(seq_len=24, max_windows=2, modes=("prefill",), batch_size=2)
  c.calib.update(n_samples=3, seq_len=16, seed=5)
  c.progress = False
  CALLS.clear()
  r1 = evaluate.run(c, tmp_path / "w")
  assert len(CALLS) == 1 and CALLS[0].shape == (3, 16)
  assert r1["calibration"]["restored"] is False
  # The same point again is skipped; --overwrite evaluates it again, restoring the
  # calibration checkpoint.
  assert evaluate.run(c, tmp_path / "w")["skipped"]
  r2 = evaluate.run(c, tmp_path / "w", overwrite=True)
  assert len(CALLS) == 1, "second run must restore the checkpoint, not recalibrate"
  assert r2["calibration"]["restored"] is True
  assert r2["calibration"]["hash"] == r1["calibration"]["hash"]
  assert r2["results"]["prefill"]["nll_sum"] == r1["results"]["prefill"]["nll_sum"]
  # The calibration changed the model: uncalibrated params give another NLL.
  plain = models.load("random:tiny", "float32").params
  assert "calib_factor" not in plain["layers"][0]
  c.method = "dense"
  r3 = evaluate.run(c, tmp_path / "w")
  assert r3["results"]["prefill"]["nll_sum"] != r1["results"]["prefill"]["nll_sum"]
  # A different calibration seed is a different checkpoint.
  c.method = "_test_scale"
  c.calib.seed = 6
  r4 = evaluate.run(c, tmp_path / "w")
  assert len(CALLS) == 2 and r4["calibration"]["hash"] != r1["calibration"]["hash"]
  assert len(records.read(tmp_path / "w" / "results.jsonl")) == 3  # r2 replaced r1


def test_save_and_restore_drop_orbax_info_logs(tmp_path):
  """kvlowrank.ckpt drops orbax's INFO chatter while it saves or restores; orbax logs it when
  called directly (negative control), and other INFO records and orbax's filter-free state
  after the call are kept."""
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record)

  orbax_info = lambda: [r for r in seen if f"{os.sep}orbax{os.sep}" in r.pathname
                        and r.levelno < logging.WARNING]
  handler, root = Keep(logging.DEBUG), logging.getLogger()
  level, verbosity = root.level, absl_logging.get_verbosity()
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  absl_logging.set_verbosity(absl_logging.INFO)
  tree = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
      c.save(tmp_path / "direct", ocp.args.Composite(tree=ocp.args.StandardSave(tree)))
    assert orbax_info(), "orbax no longer logs INFO records: the negative control is void"
    seen.clear()
    ckpt.save(tmp_path / "quiet", tree, {"a": 1})
    back, meta = ckpt.restore(tmp_path / "quiet")
    assert not orbax_info(), [r.getMessage()[:80] for r in orbax_info()[:3]]
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))
    assert meta == {"a": 1}
    assert not handler.filters
    logging.getLogger("kvlowrank.test").info("still printed")
    assert seen[-1].getMessage() == "still printed"
  finally:
    root.removeHandler(handler)
    root.setLevel(level)
    absl_logging.set_verbosity(verbosity)
