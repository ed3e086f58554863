"""Samplers (fake logits), the jitted generation loop against an explicit argmax loop
over the uncached forward, ragged batches, EOS stopping, capacity errors, and the config
boundary (parse_arg, to_dataclass, the launcher's locked config)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kvlowrank import ModelSpec, config_lib
from kvlowrank.generate import (Greedy, SamplerConfig, Temperature, TopK, TopP, generate,
                                make_sampler, sampler_from_config)
from kvlowrank.generate import loop
from kvlowrank.generate.loop import bucket
from kvlowrank.generate.runner import GenerateConfig
from kvlowrank.model import init_params
from kvlowrank.resources import shared_dir
from np_reference import np_forward

REPO = Path(__file__).resolve().parents[1]
N_SAMPLES = 20000  # rows sampled at once; 4-sigma band of a frequency ≤ 4*sqrt(.25/N)=0.014

# ---------------------------------------------------------------- samplers


def _fake_logits(n, seed=0):
  """n identical rows of logits whose order is not the id order (exercises the sorts)."""
  rng = np.random.default_rng(seed)
  probs = np.array([0.05, 0.30, 0.02, 0.45, 0.15, 0.03])  # id 3 > 1 > 4 > 0 > 5 > 2
  logits = np.log(probs) + rng.normal()  # a common shift must not matter
  return jnp.asarray(np.broadcast_to(logits, (n, len(probs))), jnp.float32), probs


def _freqs(tokens, v):
  return np.bincount(np.asarray(tokens), minlength=v) / len(tokens)


def _renorm(p, keep):
  q = np.where(keep, p, 0.0)
  return q / q.sum()


def test_greedy_picks_argmax_per_row():
  logits = jnp.asarray([[0.0, 2.0, 1.0], [5.0, -1.0, 4.0], [0.0, 0.0, 3.0]])
  out = Greedy().next_tokens(logits, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out), [1, 0, 2])
  assert out.dtype == jnp.int32


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampler_frequencies(temperature):
  logits, probs = _fake_logits(N_SAMPLES)
  out = Temperature(temperature).next_tokens(logits, jax.random.key(1))
  want = probs ** (1 / temperature) / np.sum(probs ** (1 / temperature))
  np.testing.assert_allclose(_freqs(out, 6), want, atol=0.015)
  # Negative control: the frequencies distinguish another temperature.
  other = probs ** 2 / np.sum(probs ** 2) if temperature == 1.0 else probs
  assert np.abs(_freqs(out, 6) - other).max() > 0.05


def test_top_k_sampler_only_top_k_with_renormalised_frequencies():
  logits, probs = _fake_logits(N_SAMPLES)
  out = TopK(k=2).next_tokens(logits, jax.random.key(2))
  f = _freqs(out, 6)
  assert set(np.unique(np.asarray(out))) == {1, 3}
  np.testing.assert_allclose(f, _renorm(probs, np.isin(np.arange(6), [1, 3])), atol=0.015)
  assert np.abs(f - probs).max() > 0.1  # negative control: not the untruncated softmax


@pytest.mark.parametrize("p,nucleus", [(0.7, [1, 3]), (0.85, [1, 3, 4]), (0.4, [3])])
def test_top_p_sampler_nucleus(p, nucleus):
  # sorted probs .45 .30 .15 .05 ...: mass before each = 0, .45, .75, .90 → kept while < p
  logits, probs = _fake_logits(N_SAMPLES)
  out = TopP(p).next_tokens(logits, jax.random.key(3))
  f = _freqs(out, 6)
  assert set(np.unique(np.asarray(out))) == set(nucleus)
  np.testing.assert_allclose(f, _renorm(probs, np.isin(np.arange(6), nucleus)), atol=0.015)


def test_low_temperature_samplers_approach_greedy():
  logits, _ = _fake_logits(64)
  for s in (Temperature(1e-3), TopK(3, temperature=1e-3), TopP(0.99, temperature=1e-3)):
    np.testing.assert_array_equal(np.asarray(s.next_tokens(logits, jax.random.key(4))), 3)


@pytest.mark.parametrize("build,field", [
    (lambda: Temperature(0.0), "temperature"), (lambda: TopK(0), "k"),
    (lambda: TopP(0.0), "p"), (lambda: TopP(1.5), "p"),
    (lambda: TopK(5, temperature=-1.0), "temperature"),
    (lambda: make_sampler("beam"), "beam"), (lambda: make_sampler("top_k"), "top_k")])
def test_sampler_validation(build, field):
  with pytest.raises(ValueError, match=field):
    build()


def test_sampler_from_config():
  cfg = ml_collections.ConfigDict(dict(name="top_k", temperature=0.7, top_k=5, top_p=0.9))
  assert sampler_from_config(cfg) == TopK(5, 0.7)
  assert sampler_from_config({"name": "greedy"}) == Greedy()
  with pytest.raises(ValueError, match="sampler: unknown config key.*'topk'"):
    sampler_from_config({"name": "top_k", "topk": 5})


# ---------------------------------------------------------------- generation loop

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64, qkv_bias=True)
PARAMS = init_params(SPEC, jax.random.key(0), scale=0.3)
PROMPTS = [[5, 9, 2, 33, 7, 1, 60], [12, 4, 4], [40, 8, 17, 3, 22]]
MAX_NEW = 8


def _argmax_reference(prompt, n):
  """Explicit greedy loop: uncached float64 numpy forward over the whole sequence."""
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(np.argmax(np_forward(PARAMS, seq, SPEC)[-1])))
  return seq[len(prompt):]


@pytest.fixture(scope="module")
def reference():
  return [_argmax_reference(p, MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def batched():
  return generate(PARAMS, SPEC, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=(),
                  cache_dtype=jnp.float32)


def test_greedy_generation_equals_argmax_loop(batched, reference):
  assert [list(t) for t in batched.tokens] == reference
  assert batched.lengths == (MAX_NEW,) * 3
  assert batched.stop_reasons == ("max_new_tokens",) * 3
  assert batched.decode_steps == MAX_NEW - 1
  # Negative control: an off-by-one prompt (last token dropped, a typical prefill bug)
  # changes the continuation, so the comparison above can see such bugs.
  assert _argmax_reference(PROMPTS[0][:-1], MAX_NEW) != reference[0]


def test_ragged_batch_equals_one_by_one(batched):
  for p, toks in zip(PROMPTS, batched.tokens):
    alone = generate(PARAMS, SPEC, [p], max_new_tokens=MAX_NEW, eos_ids=(),
                     cache_dtype=jnp.float32, capacity=15)  # one compile for all rows
    assert alone.tokens[0] == toks


def test_bucket_rounds_up_by_at_most_an_eighth():
  ns = np.arange(1, 70000)
  got = np.array([bucket(int(n)) for n in ns])
  assert np.all(got >= ns) and np.all(np.diff(got) >= 0)
  assert np.all(got - ns < np.maximum(16, ns / 8))
  assert [bucket(n) for n in (1, 16, 17, 100, 300, 32769)] == [16, 16, 32, 112, 320, 36864]


def test_nearby_lengths_share_one_compiled_loop(reference):
  """max_new_tokens 5 and 8 (prompts of 7 tokens: capacities 12 and 15) fall in one bucket:
  one prefill and one decode loop serve both, and each stops at its own max_new_tokens."""
  jax.clear_caches()
  short = generate(PARAMS, SPEC, PROMPTS, max_new_tokens=5, eos_ids=(),
                   cache_dtype=jnp.float32)
  full = generate(PARAMS, SPEC, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=(),
                  cache_dtype=jnp.float32)
  assert (loop._prefill._cache_size(), loop._decode._cache_size()) == (1, 1)
  assert [list(t) for t in full.tokens] == reference
  assert [list(t) for t in short.tokens] == [r[:5] for r in reference]
  assert short.decode_steps == 4 and short.lengths == (5,) * 3
  # Negative control: 60 new tokens (capacity 67 → 80, the dense cache's 128 slots) is
  # another bucket, so both compile anew.
  generate(PARAMS, SPEC, PROMPTS, max_new_tokens=60, eos_ids=(), cache_dtype=jnp.float32)
  assert (loop._prefill._cache_size(), loop._decode._cache_size()) == (2, 2)


def test_eos_stops_rows_and_the_loop(reference):
  # One EOS id per row, chosen from the greedy reference: each row must stop at its first
  # EOS occurrence (exclusive), and the loop must end once the last row is done.
  eos = (reference[0][2], reference[1][4], reference[2][1])
  stops = [next(i for i, t in enumerate(r) if t in eos) for r in reference]
  res = generate(PARAMS, SPEC, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=eos,
                 cache_dtype=jnp.float32, capacity=24)  # spare capacity changes nothing
  assert [list(t) for t in res.tokens] == [r[:s] for r, s in zip(reference, stops)]
  assert res.stop_reasons == ("eos",) * 3
  assert res.decode_steps == max(stops) < MAX_NEW - 1
  # A row without EOS runs to max_new_tokens while the others stop.
  res2 = generate(PARAMS, SPEC, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=(reference[0][2],),
                  cache_dtype=jnp.float32)
  assert res2.tokens[0] == tuple(reference[0][:stops[0]]) and res2.stop_reasons[0] == "eos"
  for r, toks, why in zip(reference[1:], res2.tokens[1:], res2.stop_reasons[1:]):
    cut = r.index(reference[0][2]) if reference[0][2] in r else MAX_NEW
    assert list(toks) == r[:cut]
    assert why == ("eos" if cut < MAX_NEW else "max_new_tokens")


def test_sampled_generation_is_seeded():
  kw = dict(max_new_tokens=6, sampler=TopK(8), eos_ids=(), cache_dtype=jnp.float32)
  a = generate(PARAMS, SPEC, PROMPTS, rng=jax.random.key(7), **kw)
  b = generate(PARAMS, SPEC, PROMPTS, rng=jax.random.key(7), **kw)
  c = generate(PARAMS, SPEC, PROMPTS, rng=jax.random.key(8), **kw)
  assert a.tokens == b.tokens
  assert a.tokens != c.tokens


def test_capacity_and_prompt_errors():
  with pytest.raises(ValueError, match=r"prompt 0 \(7 tokens\) \+ max_new_tokens=3 .*capacity=9"):
    generate(PARAMS, SPEC, PROMPTS, max_new_tokens=3, capacity=9)
  with pytest.raises(ValueError, match=r"prompt 1 has 6 tokens, more than .*capacity=5"):
    generate(PARAMS, SPEC, [[1, 2], [1, 2, 3, 4, 5, 6]], max_new_tokens=1, capacity=5)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate(PARAMS, SPEC, [[1], []], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 64\)"):
    generate(PARAMS, SPEC, [[1, 64]], max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(PARAMS, SPEC, [[1]], max_new_tokens=0)
  with pytest.raises(ValueError, match="unknown cache method 'nope'"):
    generate(PARAMS, SPEC, [[1]], max_new_tokens=2, cache_method="nope")


# ---------------------------------------------------------------- config boundary


def test_parse_arg_types_and_errors():
  cfg = config_lib.parse_arg("n=3,lr=0.5,name=x,flag", n=1, lr=1.0, name="a", flag=False,
                             other=True)
  assert (cfg.n, cfg.lr, cfg.name, cfg.flag, cfg.other) == (3, 0.5, "x", True, True)
  assert isinstance(cfg.lr, float) and isinstance(cfg.n, int)
  assert config_lib.parse_arg("flag=false", flag=True).flag is False
  assert config_lib.parse_arg(None, a=1).a == 1
  for arg, msg in [("bogus=1", "unknown config arg 'bogus'"), ("flag=yes please", "bool"),
                   ("n=1.5", "expected an int"), ("n", "needs a value"),
                   ("n=1,n=2", "given twice")]:
    with pytest.raises(ValueError, match=msg):
      config_lib.parse_arg(arg, n=1, flag=False)


@dataclasses.dataclass(frozen=True)
class _Inner:
  rank: int
  dims: tuple[int, ...] = (1,)


@dataclasses.dataclass(frozen=True)
class _Outer:
  inner: _Inner
  name: str = "x"
  scale: float = 1.0


def test_to_dataclass_converts_and_rejects():
  cfg = ml_collections.ConfigDict(dict(inner=dict(rank=4, dims=[2, 3]), scale=2))
  out = config_lib.to_dataclass(cfg, _Outer)
  assert out == _Outer(_Inner(4, (2, 3)), "x", 2.0)
  hash(out)  # frozen, tuple-converted: usable as a jit static arg
  for bad, msg in [(dict(inner=dict(rank=4), bogus=1), r"_Outer: unknown config key.*'bogus'"),
                   (dict(inner=dict(rank=4, bogus=1)), r"_Outer.inner: unknown.*'bogus'"),
                   (dict(inner=dict(rank="4")), r"_Outer.inner.rank: expected an int"),
                   (dict(inner=dict(rank=True)), r"_Outer.inner.rank: expected an int"),
                   (dict(inner={}), r"missing config key.*'rank'"),
                   (dict(inner=dict(rank=1), name=3), r"_Outer.name: expected a str")]:
    with pytest.raises(ValueError, match=msg):
      config_lib.to_dataclass(bad, _Outer)


def _load_config(arg=None):
  import importlib.util
  spec = importlib.util.spec_from_file_location("gen_cfg", REPO / "configs" / "generate.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def test_generate_config_converts_and_rejects_unknown_keys():
  cfg = config_lib.to_dataclass(_load_config(), GenerateConfig, where="config")
  assert cfg.model.path == "smollm2" and cfg.sampler == SamplerConfig()
  assert sampler_from_config(cfg.sampler) == Greedy()
  if shared_dir() is not None:
    smoke = config_lib.to_dataclass(_load_config("smoke"), GenerateConfig)
    assert smoke.model.path.endswith("stories260K.bin")
  bad = _load_config()
  bad.model.unlock()
  bad.model.bogus = 1
  from kvlowrank.generate import run
  with pytest.raises(ValueError, match=r"config.model: unknown config key.*'bogus'"):
    run(bad)  # fails at the boundary, before any model is loaded


def test_launcher_rejects_unknown_config_key():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "generate.py"),
       f"--config={REPO / 'configs' / 'generate.py'}", "--config.bogus=1"],
      capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
  assert proc.returncode != 0
  assert "unknown config key 'bogus'" in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr


class _FakeTokenizer:
  """Records how encode_prompt uses the tokenizer protocol (kvlowrank.loaders.types)."""

  def __init__(self):
    self.calls = []

  def apply_chat_template(self, messages, add_generation_prompt=True):
    self.calls.append(("template", tuple(m["role"] for m in messages), add_generation_prompt))
    return "<user>" + messages[0]["content"] + "<assistant>"

  def encode(self, text, add_bos=True):
    self.calls.append(("encode", text, add_bos))
    return [len(text)]


def test_encode_prompt_chat_template_wiring():
  from kvlowrank.generate.runner import encode_prompt
  tok = _FakeTokenizer()
  assert encode_prompt(tok, "hi", chat=False) == [2]
  assert tok.calls == [("encode", "hi", True)]
  tok = _FakeTokenizer()
  assert encode_prompt(tok, "hi", chat=True) == [len("<user>hi<assistant>")]
  # The template writes its own special tokens: no second BOS on top of it.
  assert tok.calls == [("template", ("user",), True), ("encode", "<user>hi<assistant>", False)]
