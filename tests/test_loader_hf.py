"""HF checkpoint loader: logits parity with HF transformers (torch CPU, fp32) for tiny random
Llama, Llama-3 (rope_scaling llama3, sharded), Mistral (sliding window) and Qwen2 (qkv
biases, tied embeddings) checkpoints written with save_pretrained; prefill and
token-by-token decode through the dense cache; tokenizer.json + chat template vs HF."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvlowrank.methods import DenseSpec, init_caches
from kvlowrank.loaders import load_model
from kvlowrank.model import forward
from kvlowrank.model.rope import permute_heads_to_half

TOL = 1e-4  # fp32 vs torch fp32
T, PREFIX, B = 12, 5, 2
_fwd = jax.jit(forward, static_argnames=("spec",))

_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=64, attn_implementation="eager")
CASES = {
    # name: (config class, kwargs, save_pretrained kwargs)
    "llama_gqa4-2": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                         rope_theta=10000.0), {}),
    "llama3_gqa6-2_sharded": ("LlamaConfig", dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        attention_bias=True,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=4.0,
                                               low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8)),
        dict(max_shard_size="40KB")),
    "mistral_gqa4-1_window5": ("MistralConfig", dict(num_attention_heads=4,
                                                     num_key_value_heads=1, sliding_window=5),
                               {}),
    "qwen2_mha4_bias_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=4,
                                                 tie_word_embeddings=True), {}),
}


def _randomize(model, seed):
  """Overwrites every parameter (biases and norms too; HF zero-inits biases) with seeded
  values scaled so attention is far from uniform and logits are O(1)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      r = torch.randn(p.shape, generator=g, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * r)
      elif name.endswith("bias"):
        p.copy_(0.3 * r)
      elif "embed" in name:
        p.copy_(r)
      else:
        p.copy_(r * 1.5 / p.shape[-1] ** 0.5)


def _write(tmp_path, case, seed=0):
  cls_name, kw, save_kw = CASES[case]
  cfg = getattr(transformers, cls_name)(**{**_SMALL, **kw})
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
  _randomize(model, seed)
  d = tmp_path / case
  model.save_pretrained(d, **save_kw)
  return d, model


def _tokens(vocab, seed=3):
  return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def _positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


def _decode_logits(m, tokens):
  """Prefill PREFIX tokens into a dense fp32 cache, then one token at a time."""
  caches = init_caches("dense", DenseSpec(), m.spec, m.params, batch=B, capacity=T,
                       dtype=jnp.float32)
  out, caches = _fwd(m.params, jnp.asarray(tokens[:, :PREFIX]), _positions(B, PREFIX),
                     caches, m.spec)
  outs = [out]
  for t in range(PREFIX, T):
    out, caches = _fwd(m.params, jnp.asarray(tokens[:, t:t + 1]), _positions(B, 1, t),
                       caches, m.spec)
    outs.append(out)
  return np.asarray(jnp.concatenate(outs, axis=1))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_prefill_and_cached_decode(tmp_path, case):
  d, model = _write(tmp_path, case)
  m = load_model(d)
  tokens = _tokens(m.spec.vocab_size)
  ref = _hf_logits(model, tokens)
  assert np.abs(ref).max() > 1.0  # logits are not trivially small
  prefill, _ = _fwd(m.params, jnp.asarray(tokens), _positions(B, T), None, m.spec)
  d_prefill = np.abs(np.asarray(prefill) - ref).max()
  d_decode = np.abs(_decode_logits(m, tokens) - ref).max()
  print(f"{case}: max|dlogit| prefill {d_prefill:.2e} decode {d_decode:.2e}")
  assert d_prefill < TOL and d_decode < TOL


def test_spec_fields_from_config(tmp_path):
  specs = {c: load_model(_write(tmp_path, c)[0]).spec for c in CASES}
  s = specs["llama3_gqa6-2_sharded"]
  assert (s.n_heads, s.n_kv_heads, s.head_dim, s.rope_theta) == (6, 2, 8, 500000.0)
  assert s.rope_scaling is not None and s.rope_scaling.factor == 4.0 and s.qkv_bias
  assert (tmp_path / "llama3_gqa6-2_sharded" / "model.safetensors.index.json").exists()
  assert specs["mistral_gqa4-1_window5"].sliding_window == 5
  q = specs["qwen2_mha4_bias_tied"]
  assert q.qkv_bias and q.tie_embeddings and q.sliding_window is None
  assert specs["llama_gqa4-2"].rope_scaling is None and not specs["llama_gqa4-2"].qkv_bias


def test_negative_controls(tmp_path):
  """Wrong RoPE pairing, dropped llama3 scaling and a wrong window must break parity."""
  d, model = _write(tmp_path, "llama3_gqa6-2_sharded")
  m = load_model(d)
  tokens = _tokens(m.spec.vocab_size)
  ref = _hf_logits(model, tokens)
  run = lambda params, spec: np.asarray(_fwd(params, jnp.asarray(tokens), _positions(B, T),
                                             None, spec)[0])
  # Q/K rows permuted as if the checkpoint were in the interleaved layout.
  bad = jax.tree.map(lambda x: x, m.params)
  for lp in bad["layers"]:
    lp["wq"] = permute_heads_to_half(np.asarray(lp["wq"]).T, m.spec.n_heads).T
    lp["wk"] = permute_heads_to_half(np.asarray(lp["wk"]).T, m.spec.n_kv_heads).T
  assert np.abs(run(bad, m.spec) - ref).max() > 100 * TOL
  assert np.abs(run(m.params, m.spec.replace(rope_scaling=None)) - ref).max() > 100 * TOL
  dm, mm = _write(tmp_path, "mistral_gqa4-1_window5")
  mw = load_model(dm)
  ref_w = _hf_logits(mm, tokens)
  got = np.asarray(_fwd(mw.params, jnp.asarray(tokens), _positions(B, T), None,
                        mw.spec.replace(sliding_window=None))[0])
  assert np.abs(got - ref_w).max() > 100 * TOL


def test_bf16_load(tmp_path):
  d, model = _write(tmp_path, "llama_gqa4-2")
  m = load_model(d, dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
  tokens = _tokens(m.spec.vocab_size)
  got = np.asarray(_fwd(m.params, jnp.asarray(tokens), _positions(B, T), None, m.spec)[0])
  ref = _hf_logits(model, tokens)
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert 1e-4 < err < 0.1  # bf16 rounding is visible but small


def _write_tokenizer(d):
  """A small trained byte-level BPE tokenizer.json plus tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  text = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "a tokenizer for tests: 12345 and café"] * 20
  tok.train_from_iterator(text, trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  tok.save(str(d / "tokenizer.json"))
  template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
              "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
              "{% endif %}")
  (d / "tokenizer_config.json").write_text(json.dumps(dict(
      bos_token="<s>", eos_token="</s>", chat_template=template,
      tokenizer_class="PreTrainedTokenizerFast")))


def test_tokenizer_and_chat_template_match_hf(tmp_path):
  d, _ = _write(tmp_path, "llama_gqa4-2")
  _write_tokenizer(d)
  tok = load_model(d).tokenizer
  ref = transformers.AutoTokenizer.from_pretrained(str(d))
  assert tok.adds_bos and tok.bos_id == 0 and 1 in tok.eos_ids
  texts = ["the lazy fox", " hello  world\n", "café 12345!", "<s>the</s> dog", ""]
  for s in texts:
    assert tok.encode(s) == ref(s)["input_ids"], s
    assert tok.encode(s, add_bos=False) == ref(s, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(s, add_bos=False)) == s
  msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
  for gen in (True, False):
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
  # Negative control: the tokenizer's ids differ from a naive byte split.
  assert tok.encode("the lazy fox", add_bos=False) != list("the lazy fox".encode())


def test_no_tokenizer_json_gives_none(tmp_path):
  d, _ = _write(tmp_path, "qwen2_mha4_bias_tied")
  m = load_model(d)
  assert m.tokenizer is None
  with pytest.raises(FileNotFoundError, match="no tokenizer"):
    m.require_tokenizer()
