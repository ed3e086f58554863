"""The one-call API (kvlowrank.load / compress / CompressedModel) on 3 of stories260K's layers
(skipped without ../shared): for every registered method, compress -> generate equals the
lower-level path (build_spec, calibrate, init_caches + forward, kvlowrank.generate); the
calibration is cached and restored; the KIVI exact-window note (and that its claim
holds); bad knobs are one-line errors raised before any calibration; bytes and
perplexity against independent computations."""

import dataclasses
import importlib.util
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlowrank
from kvlowrank.data import calib as calib_lib
from kvlowrank.data import text as text_lib
from kvlowrank.generate import generate
from kvlowrank.methods import get_method, init_caches, methods
from kvlowrank.model import forward
from kvlowrank.resources import shared_dir, shared_path
from np_reference import np_forward

pytestmark = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")
REPO = Path(__file__).resolve().parents[1]
CALIB = dict(n_samples=2, seq_len=64, max_chars=2000)
N_NEW = 40  # > the smoke KIVI window (32): quantized tokens are exercised
# Of stories260K's 5 layers: a 3-layer model that still writes varied text (greedy from the
# first 3 layers repeats one token, which would make equal generations a weaker check).
LAYERS = (0, 3, 4)


def _main_smoke():
  spec = importlib.util.spec_from_file_location("_api_main", REPO / "configs" / "main.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("smoke")


@pytest.fixture(scope="module")
def full_model():
  return kvlowrank.load(str(shared_path("models", "stories260K", "stories260K.bin")),
                        progress=False)


@pytest.fixture(scope="module")
def model(full_model):
  """stories260K's layers LAYERS: most of this file's time is XLA compiling each method's
  prefill and decode programs, which grow with the depth, and no test here is about the
  depth (3 layers keep XQuant-CL's smoke recipe, base layer 1, with a cross-layer layer)."""
  m = full_model
  return dataclasses.replace(m, spec=m.spec.replace(n_layers=len(LAYERS)),
                             params=dict(m.params, layers=[m.params["layers"][i]
                                                           for i in LAYERS]))


@pytest.fixture(scope="module")
def prompts(model):
  tok = model.require_tokenizer()
  return [tok.encode("Once upon a time"), tok.encode("The little dog ran to the park and")]


def _knobs(name):
  """configs/main.py:smoke's section for the method (stories260K-sized), else defaults.
  Eviction wraps KIVI here (main's ZACK inner calibrates, which test_rotated_stack covers);
  its inner_specs still hold the ZACK section, a nested spec the calibration hash must
  serialise."""
  main = _main_smoke()
  knobs = main[name].to_dict() if name in main else {}
  if name == "evict":
    knobs = dict(knobs, inner="kivi", inner_specs=dict(
        knobs["inner_specs"], kivi=dict(bits=2, group_size=8, residual=32)))
  return knobs


@pytest.mark.parametrize("name", methods())
def test_round_trip_equals_the_lower_level_path(name, model, prompts, tmp_path):
  knobs = _knobs(name)
  cm = kvlowrank.compress(model, name, calib=CALIB, cache_dtype="float32",
                          cache_dir=tmp_path / "api", progress=False, **knobs)
  got = cm.generate_tokens(prompts, N_NEW, eos_ids=(), progress=False)
  # The lower-level path, by hand.
  method = get_method(name)
  spec = method.build_spec(knobs, model.spec)
  params = model.params
  if method.calibrate is not None:
    tokens, _ = calib_lib.calibration_tokens(model.require_tokenizer(),
                                             calib_lib.CalibSpec(**CALIB))
    params = method.calibrate(model.params, model.spec, spec, tokens,
                              workdir=str(tmp_path / "low"))
  assert cm.spec == spec and cm.cache == method.cache
  want = generate(params, model.spec, prompts, max_new_tokens=N_NEW, eos_ids=(),
                  cache_method=method.cache, cache_spec=spec, cache_dtype=jnp.float32)
  assert got.tokens == want.tokens and got.lengths == (N_NEW, N_NEW)
  # The first token is the argmax of one forward call over the prompt with a fresh cache.
  p = prompts[1]
  caches = init_caches(method.cache, spec, model.spec, params, batch=1,
                       capacity=len(p) + 1, dtype=jnp.float32)
  logits, _ = jax.jit(forward, static_argnums=4)(params, jnp.asarray([p]),
                                                  jnp.arange(len(p))[None], caches, model.spec)
  assert int(jnp.argmax(logits[0, -1])) == got.tokens[1][0]
  # evict passes its inner cache's calibration through (configs/main.py:smoke wraps ZACK);
  # around an uncalibrated cache nothing is checkpointed.
  if method.calibrate is not None and (name != "evict"
                                       or get_method(spec.inner).calibrate is not None):
    assert cm.calibration["restored"] is False
    again = kvlowrank.compress(model, name, calib=CALIB, cache_dtype="float32",
                               cache_dir=tmp_path / "api", progress=False, **knobs)
    assert again.calibration["restored"] is True
    assert again.calibration["hash"] == cm.calibration["hash"]
    assert again.generate_tokens(prompts, N_NEW, eos_ids=(), progress=False).tokens == \
        want.tokens
  else:
    assert cm.calibration is None and not (tmp_path / "api").exists()


def test_spec_and_config_forms_agree(model, tmp_path):
  by_name = kvlowrank.compress(model, "kivi", bits=2, group_size=8, residual=32,
                               progress=False)
  by_spec = kvlowrank.compress(model, kvlowrank.methods.KiviSpec(bits=4, group_size=8,
                                                                 residual=32),
                               bits=2, progress=False)
  config = _main_smoke()
  config.method, config.kivi.bits = "kivi", 2
  by_config = kvlowrank.compress(model, config, progress=False)
  by_file = kvlowrank.compress(model, f"{REPO / 'configs' / 'kivi.py'}:smoke,bits=2",
                               progress=False)
  assert by_name.spec == by_spec.spec == by_config.spec == by_file.spec
  with pytest.raises(FileNotFoundError, match="nope.py"):
    kvlowrank.compress(model, "configs/nope.py", progress=False)
  assert by_name.cache_dtype == by_config.cache_dtype == "bfloat16"


def test_kivi_window_note(model, prompts, capsys):
  cm = kvlowrank.compress(model, "kivi", bits=2, group_size=8, residual=32,
                          cache_dtype="float32", progress=False)
  dense = kvlowrank.compress(model, "dense", cache_dtype="float32", progress=False)
  short = cm.generate_tokens(prompts[:1], 16, eos_ids=())
  note = capsys.readouterr().out
  assert "KiviSpec.residual=32" in note and "fits in that window" in note
  # The note's claim: the whole sequence stayed exact, so the output is the dense one.
  assert short.tokens == dense.generate_tokens(prompts[:1], 16, eos_ids=(),
                                               progress=False).tokens
  cm.generate_tokens(prompts[:1], 30, eos_ids=())  # 5 + 30 > 32: prompt partly quantized
  assert "shorter than that window" in capsys.readouterr().out
  # Negative controls: no note past the window, nor without one.
  cm.generate_tokens(prompts[:1], N_NEW, eos_ids=())
  kvlowrank.compress(model, "kivi", bits=2, group_size=8, residual=0,
                     progress=False).generate_tokens(prompts[:1], 8, eos_ids=())
  assert "note" not in capsys.readouterr().out


@pytest.mark.parametrize("args,knobs,match", [
    (("kivi",), dict(bitz=2), r"config.kivi: unknown config key\(s\) 'bitz'"),
    (("kivi",), dict(group_size=3), "group_size"),
    (("kivy",), {}, "unknown config.method 'kivy'"),
    (("palu",), dict(group_size=3), "group_size"),
    (("palu",), dict(calib=dict(n_sample=4), rank_multiple=8),
     r"config.calib: unknown config key\(s\) "
                                             "'n_sample'"),
    (("palu",), dict(calib=dict(n_samples="4")), "calib.n_samples"),
    ((3,), {}, "compress: method must be"),
])
def test_bad_knob_is_one_line_before_any_work(model, tmp_path, args, knobs, match):
  with pytest.raises((ValueError, TypeError)) as e:
    kvlowrank.compress(model, *args, cache_dir=tmp_path, progress=False, **knobs)
  assert e.type is ValueError
  assert len(str(e.value).splitlines()) == 1
  e.match(match)
  assert not os.listdir(tmp_path)  # nothing calibrated or written


def test_nbytes_and_evaluate(model):
  s = model.spec
  dense = kvlowrank.compress(model, "dense", cache_dtype="float32", progress=False)
  # K and V [B, S, K, H] fp32 plus the per-row lengths (int32) of each layer.
  assert dense.nbytes(256, batch=2) == s.n_layers * (2 * 2 * 256 * s.n_kv_heads * s.head_dim
                                                     * 4 + 2 * 4)
  assert dense.kv_bytes_per_token() == 2 * s.n_layers * s.n_kv_heads * s.head_dim * 4
  kivi = kvlowrank.compress(model, "kivi", bits=2, group_size=8, residual=32,
                            progress=False)
  assert kivi.nbytes(256) > kivi.kv_bytes_per_token() * 256  # + the exact window
  assert kivi.nbytes(256) < dense.nbytes(256)
  r = dense.evaluate(seq_len=128, max_windows=2, max_chars=2000, modes=("prefill",),
                     drift_tokens=4, progress=False)
  # Independent float64 numpy perplexity on the same windows.
  tok = model.require_tokenizer()
  txt, _ = text_lib.load_text("wikitext2", "test")
  windows = text_lib.windows(text_lib.tokenize(tok, txt, max_chars=2000), 128, 2)
  nll = 0.0
  for w in windows:
    logits = np_forward(model.params, w, s)[:-1]
    m = logits.max(-1, keepdims=True)
    nll += float((m[:, 0] + np.log(np.exp(logits - m).sum(-1))
                  - logits[np.arange(127), w[1:]]).sum())
  assert r["ppl_prefill"] == pytest.approx(math.exp(nll / 254), rel=1e-5)
  assert r["windows"] == 2 and "ppl_decode" not in r
  assert r["drift"]["greedy_match"] == 1.0 and r["drift"]["kl"] == 0.0
  assert r["drift"]["prompt_len"] == 64 and r["drift"]["n_tokens"] == 4
  with pytest.raises(ValueError, match="config.eval.seq_len|eval.seq_len"):
    dense.evaluate(seq_len=1, progress=False)
  assert dataclasses.is_dataclass(dense) and dense.bits == "32"


def test_generate_launcher_library_with_a_method(full_model, tmp_path):
  """configs/generate.py:smoke,method=kivi through kvlowrank.generate.runner.run equals
  the API with configs/main.py:smoke's KIVI knobs (the whole stories260K, which the launcher
  loads); a bad method or knob is one line."""
  from kvlowrank.generate import runner
  spec = importlib.util.spec_from_file_location("_api_gen", REPO / "configs" / "generate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("smoke,method=kivi")
  config.kivi.residual = 0
  out = runner.run(config, str(tmp_path), progress=False)
  assert out["method"] == "kivi" and out["method_spec"]["group_size"] == 8
  cm = kvlowrank.compress(full_model, "kivi", cache_dtype="float32", progress=False,
                          **dict(_knobs("kivi"), residual=0))
  ids = out["prompt_ids"]
  want = cm.generate_tokens([ids], config.max_new_tokens, progress=False)
  assert out["completion_ids"] == list(want.tokens[0])
  with pytest.raises(ValueError, match="method='kivy'"):
    module.get_config("smoke,method=kivy")
  config.kivi.bits = 5
  with pytest.raises(ValueError, match="KiviSpec.bits") as e:
    runner.run(config, progress=False)
  assert len(str(e.value).splitlines()) == 1
