"""GGUF loader: SmolLM2-135M logits and tokenizer vs HF transformers loading the same GGUF;
a tiny synthetic GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, untied output, llama-bpe
pre-tokenizer) vs HF; dequantizers vs hand-built blocks and gguf.quants; errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q

from kvlowrank import resources
from kvlowrank.loaders import load_model
from kvlowrank.loaders.gguf_file import GGUFFile
from kvlowrank.loaders.gguf_quants import dequantize
from kvlowrank.model import forward
from kvlowrank.model.rope import interleaved_to_half_perm

_fwd = jax.jit(forward, static_argnames=("spec",))
PROMPT = "The capital of France is Paris. The capital of Italy is"


def _smollm2_path():
  try:
    return resources.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


def _logits(params, spec, ids):
  ids = jnp.asarray([ids], jnp.int32)
  pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
  return np.asarray(_fwd(params, ids, pos, None, spec)[0][0])


# --------------------------------------------------------------------- SmolLM2 (real)


def _gguf_parsed_once(mp):
  """transformers' GGUF loading (the reference) parses the file's metadata once for the
  config, once for the weights and once for the tokenizer (a Python loop over SmolLM2's
  49152 vocabulary strings: ~8 s each on the 2-core CI box), and rebuilds gguf's tensor-name
  map for each of the model's ~400 modules (~9 s in all). Both are pure functions of their
  arguments: here one reader per file and one map per (arch, layers) serve every call; the
  reference is still transformers' own loading of the file."""
  readers = {}
  reader = gguf.GGUFReader

  def one_reader(path, *args, **kwargs):
    key = (str(path), args, tuple(sorted(kwargs.items())))
    if key not in readers:
      readers[key] = reader(path, *args, **kwargs)
    return readers[key]

  mp.setattr(gguf, "GGUFReader", one_reader)
  mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(
      gguf.get_tensor_name_map))


@pytest.fixture(scope="module")
def smollm2():
  """(ours, HF model, HF tokenizer), each loaded once for the module."""
  p = _smollm2_path()
  ours = load_model("smollm2")
  with pytest.MonkeyPatch.context() as mp:
    _gguf_parsed_once(mp)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                           dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
  return ours, hf, hf_tok


@pytest.mark.slow
def test_smollm2_logits_match_hf(smollm2):
  ours, hf, _ = smollm2
  ids = ours.tokenizer.encode(PROMPT)
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits[0].numpy()
  got = _logits(ours.params, ours.spec, ids)
  diff = np.abs(got - ref).max()
  print(f"SmolLM2 GGUF fp32 max|dlogit| = {diff:.2e} (max|logit| {np.abs(ref).max():.1f})")
  assert diff < 1e-3
  assert ours.tokenizer.decode([int(got[-1].argmax())]) == " Rome"
  # Negative control: skipping the un-permute (Q/K rows left in llama.cpp's
  # interleaved order) must break parity.
  inv = np.argsort(interleaved_to_half_perm(ours.spec.head_dim))
  def interleave(w, heads):  # [in, heads*H] columns back to the interleaved order
    d = w.shape[0]
    return w.reshape(d, heads, -1)[:, :, inv].reshape(d, -1)
  bad = dict(ours.params, layers=[dict(lp, wq=interleave(lp["wq"], ours.spec.n_heads),
                                       wk=interleave(lp["wk"], ours.spec.n_kv_heads))
                                  for lp in ours.params["layers"]])
  assert np.abs(_logits(bad, ours.spec, ids) - ref).max() > 1.0


@pytest.mark.slow
def test_smollm2_spec_and_tokenizer_match_hf(smollm2):
  ours, hf, hf_tok = smollm2
  s, c = ours.spec, hf.config
  assert (s.n_layers, s.dim, s.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim, s.vocab_size) == (
      c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
      c.head_dim, c.intermediate_size, c.vocab_size)
  assert s.tie_embeddings and s.rope_theta == 100000.0 and s.rope_layout == "half"
  tok = ours.tokenizer
  assert tok.bos_id == hf_tok.bos_token_id and tok.eos_ids[0] == hf_tok.eos_token_id
  texts = [PROMPT, "Hello world!", " The year 2024 had 365 days.", "naïve café 😀\n\n  tabs\t!",
           "<|im_start|>user\nHi<|im_end|>", "don't I'LL won't", "x = f(a[1], {'k': 2})"]
  for text in texts:
    ids = tok.encode(text)
    assert ids == hf_tok(text)["input_ids"], text
    assert tok.decode(ids) == hf_tok.decode(ids) == text
  msgs = [{"role": "user", "content": "What is 2+2?"}]
  assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(
      msgs, tokenize=False, add_generation_prompt=True)
  chat = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "4"}],
                                 add_generation_prompt=False)
  assert chat.startswith("<|im_start|>system\n") and chat.endswith("4<|im_end|>\n")


def test_dequantize_matches_gguf_on_real_tensors():
  f = GGUFFile(_smollm2_path())
  seen = set()
  for t in f.tensors.values():
    if t.ggml_type in seen or t.ggml_type not in (Q.Q8_0, Q.Q4_1):
      continue
    seen.add(t.ggml_type)
    rows = 48  # a slice of whole rows keeps this fast (the embedding is 28M values)
    raw = t.data.reshape(t.shape[0], -1)[:rows]
    ours = dequantize(raw, t.ggml_type, (rows, t.shape[1]), t.name)
    ref = gguf.quants.dequantize(raw, Q(t.ggml_type))
    assert ref.shape == (rows, t.shape[1])
    np.testing.assert_array_equal(ours, ref)
  assert seen == {Q.Q8_0, Q.Q4_1}


def _f16(x):
  return np.float16(x).tobytes()


def test_dequantize_hand_built_blocks():
  """Block layouts from ggml-common.h, written by hand with known values."""
  low, high = np.arange(16) % 16, (15 - np.arange(16)) % 16
  qs = (low | (high << 4)).astype(np.uint8).tobytes()
  nib = np.concatenate([low, high]).astype(np.float32)  # value j: low nibble, j+16: high
  q4_0 = np.frombuffer(_f16(0.5) + qs, np.uint8)
  np.testing.assert_array_equal(dequantize(q4_0, Q.Q4_0, (32,), "q4_0"), 0.5 * (nib - 8))
  q4_1 = np.frombuffer(_f16(0.25) + _f16(-1.5) + qs, np.uint8)
  np.testing.assert_array_equal(dequantize(q4_1, Q.Q4_1, (32,), "q4_1"), 0.25 * nib - 1.5)
  q8 = np.arange(-16, 16, dtype=np.int8)
  q8_0 = np.frombuffer(_f16(0.125) + q8.tobytes(), np.uint8)
  np.testing.assert_array_equal(dequantize(q8_0, Q.Q8_0, (32,), "q8_0"), 0.125 * q8)
  vals = np.array([1.5, -2.25, 3e-3, 65504.0], np.float32)
  bf16 = np.frombuffer((vals.view(np.uint32) >> 16).astype("<u2").tobytes(), np.uint8)
  np.testing.assert_allclose(dequantize(bf16, Q.BF16, (2, 2), "bf"), vals.reshape(2, 2),
                             rtol=2 ** -8)
  np.testing.assert_array_equal(dequantize(vals.astype(np.float16), Q.F16, (4,), "f"),
                                vals.astype(np.float16).astype(np.float32))
  # Negative control: the other nibble order gives different values.
  swapped = np.frombuffer(_f16(0.5) + (high | (low << 4)).astype(np.uint8).tobytes(), np.uint8)
  assert not np.array_equal(dequantize(swapped, Q.Q4_0, (32,), "x"), 0.5 * (nib - 8))
  with pytest.raises(ValueError, match="'q8_0'.*bytes"):
    dequantize(q8_0[:-1], Q.Q8_0, (32,), "q8_0")


# ------------------------------------------------------------ tiny synthetic GGUF


def _llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py LlamaModel.permute: HF half layout -> interleaved rows."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _train_bpe():
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|end|>", "<|start|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  text = ["Hello world, it's 2024 and 123456 cats ran.", "THE'S I'LL we've done it"] * 30
  tok.train_from_iterator(text, trainer)
  import json
  model = json.loads(tok.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges


QTYPES = {"wq": Q.Q8_0, "wk": Q.Q4_0, "wv": Q.Q4_1, "wo": Q.F16, "w_gate": Q.BF16,
          "w_up": Q.Q8_0, "w_down": Q.Q4_0}
_HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
_GGUF_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def _write_tiny_gguf(path, pre="llama-bpe", bad_tensor_type=None, seed=0):
  tokens, merges = _train_bpe()
  cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                                 max_position_embeddings=64, tie_word_embeddings=False)
  torch.manual_seed(seed)
  hf = transformers.LlamaForCausalLM(cfg).float()
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in hf.named_parameters():
      r = torch.randn(p.shape, generator=g)
      p.copy_(1 + 0.2 * r if "norm" in name else r * (1.0 if "embed" in name
                                                      else 1.5 / p.shape[-1] ** 0.5))
  sd = {k: v.numpy() for k, v in hf.state_dict().items()}
  w = gguf.GGUFWriter(str(path), "llama")
  for method, value in [
      ("block_count", 2), ("context_length", 64), ("embedding_length", 64),
      ("feed_forward_length", 96), ("head_count", 4), ("head_count_kv", 2),
      ("rope_freq_base", 10000.0), ("layer_norm_rms_eps", 1e-5), ("vocab_size", len(tokens)),
      ("rope_dimension_count", 16), ("tokenizer_model", "gpt2"), ("tokenizer_pre", pre),
      ("token_list", tokens), ("token_merges", merges),
      ("token_types", [3 if t.startswith("<|") else 1 for t in tokens]),
      ("bos_token_id", 1), ("eos_token_id", 0)]:
    getattr(w, "add_" + method)(value)

  def put(name, arr, qtype):
    if qtype == Q.F32:
      w.add_tensor(name, arr.astype(np.float32))
    elif qtype == Q.F16:
      w.add_tensor(name, arr.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)

  put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
  put("output_norm.weight", sd["model.norm.weight"], Q.F32)
  put("output.weight", sd["lm_head.weight"], Q.F16)
  for i in range(2):
    pre_hf, pre_g = f"model.layers.{i}.", f"blk.{i}."
    put(pre_g + "attn_norm.weight", sd[pre_hf + "input_layernorm.weight"], Q.F32)
    put(pre_g + "ffn_norm.weight", sd[pre_hf + "post_attention_layernorm.weight"], Q.F32)
    for k, hn in _HF_NAMES.items():
      arr = sd[pre_hf + hn + ".weight"]
      if k in ("wq", "wk"):
        arr = _llama_cpp_permute(arr, 4 if k == "wq" else 2)
      name = pre_g + _GGUF_NAMES[k] + ".weight"
      if bad_tensor_type is not None and name == "blk.1.ffn_up.weight":
        block, size = gguf.GGML_QUANT_SIZES[bad_tensor_type]
        w.add_tensor(name, np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8),
                     raw_dtype=bad_tensor_type)
        continue
      put(name, arr, QTYPES[k])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_tiny_gguf_all_types_matches_hf(tmp_path):
  path = _write_tiny_gguf(tmp_path / "tiny.gguf")
  ours = load_model(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                         dtype=torch.float32).eval()
  assert not ours.spec.tie_embeddings and ours.spec.n_kv_heads == 2
  ids = np.random.default_rng(0).integers(0, ours.spec.vocab_size, 14).tolist()
  with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits[0].numpy()
  diff = np.abs(_logits(ours.params, ours.spec, ids) - ref).max()
  print(f"tiny GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_1) max|dlogit| = {diff:.2e}")
  assert np.abs(ref).max() > 1.0 and diff < 1e-4


def test_gguf_file_matches_gguf_reader(tmp_path):
  """Our fast container parser vs gguf-py's GGUFReader on the same file."""
  path = _write_tiny_gguf(tmp_path / "tiny.gguf")
  ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
  ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
  assert ours.metadata == ref_meta and len(ref_meta["tokenizer.ggml.tokens"]) > 256
  assert list(ours.tensors) == [t.name for t in ref.tensors]
  for t in ref.tensors:
    mine = ours.tensors[t.name]
    assert mine.ggml_type == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
    np.testing.assert_array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8))


def test_tiny_gguf_pre_tokenizer_matches_hf(tmp_path):
  texts = ["Hello world, it's 2024 and 123456 cats.", "THE'S I'LL<|end|> ran  \n x"]
  ids = {}
  for pre in ("llama-bpe", "smollm"):
    path = _write_tiny_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    ours = load_model(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ids[pre] = [ours.encode(t) for t in texts]
    assert ids[pre] == [ref(t)["input_ids"] for t in texts], pre
    assert [ours.decode(i) for i in ids[pre]] == texts
  # Negative control: the llama3 split regex really changes the tokenization.
  assert ids["llama-bpe"] != ids["smollm"]


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
  path = _write_tiny_gguf(tmp_path / "bad.gguf", bad_tensor_type=Q.Q5_0)
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q5_0"):
    load_model(path)
