"""Every user-facing loader failure is a FileNotFoundError / ValueError naming the bad file,
field or tensor: missing paths, corrupt/truncated checkpoints (safetensors, GGUF,
llama2.c, tokenizer.bin), unsupported config values, missing or mis-shaped tensors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import resources
from kvlowrank.loaders import load_model
from kvlowrank.loaders.safetensors_io import SafetensorsFile

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


@pytest.fixture
def hf_dir(tmp_path):
  """A valid tiny Llama checkpoint (single safetensors file); loads cleanly."""
  cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)
  torch.manual_seed(0)
  d = tmp_path / "hf"
  transformers.LlamaForCausalLM(cfg).save_pretrained(d)
  load_model(d)  # the control: unmodified, it loads
  return d


def _edit_config(d, **changes):
  cfg = json.loads((d / "config.json").read_text())
  cfg.update(changes)
  (d / "config.json").write_text(json.dumps(cfg))


def test_missing_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="model not found.*nope"):
    load_model(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="model not found: smollm3"):
    load_model("smollm3")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_model(tmp_path)
  (tmp_path / "weights.pt").write_bytes(b"x")
  with pytest.raises(ValueError, match="weights.pt: unknown checkpoint type"):
    load_model(tmp_path / "weights.pt")


def test_bad_dtype(hf_dir):
  with pytest.raises(ValueError, match="dtype.*float16"):
    load_model(hf_dir, dtype=jnp.float16)


@pytest.mark.parametrize("changes, pattern", [
    (dict(model_type="gpt2"), r"config\.json: model_type 'gpt2' is not supported"),
    (dict(hidden_size=None), r"config\.json: missing field 'hidden_size'"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4)),
     r"config\.json: rope_parameters\.rope_type 'yarn'"),
    (dict(hidden_act="gelu"), r"config\.json: hidden_act 'gelu'"),
    (dict(intermediate_size=20), r"layers\.0\.w_gate.*shape"),
])
def test_bad_config_values(hf_dir, changes, pattern):
  _edit_config(hf_dir, **changes)
  with pytest.raises(ValueError, match=pattern):
    load_model(hf_dir)


def test_malformed_config_json(hf_dir):
  (hf_dir / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"config\.json: malformed JSON"):
    load_model(hf_dir)


def test_missing_tensor(hf_dir):
  from safetensors.numpy import save_file
  f = SafetensorsFile(hf_dir / "model.safetensors")
  tensors = {k: np.array(f.get(k)) for k in f.keys() if k != "model.layers.0.mlp.up_proj.weight"}
  save_file(tensors, str(hf_dir / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
    load_model(hf_dir)


def test_truncated_and_missing_safetensors(hf_dir):
  p = hf_dir / "model.safetensors"
  data = p.read_bytes()
  p.write_bytes(data[:len(data) - 100])
  with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors"):
    load_model(hf_dir)
  p.write_bytes(data[:5])
  with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file"):
    load_model(hf_dir)
  p.unlink()
  with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
    load_model(hf_dir)


def test_sharded_index_names_missing_shard(hf_dir):
  index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "shard-2.safetensors"}}
  (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(FileNotFoundError, match=r"shard 'shard-2\.safetensors'"):
    load_model(hf_dir)


def _stories_dir():
  d = resources.shared_dir()
  if d is None or not (d / "models/stories260K/stories260K.bin").exists():
    pytest.skip("../shared/models/stories260K not available")
  return d / "models/stories260K"


def test_llama2c_truncated_and_bad_header(tmp_path):
  src = _stories_dir()
  data = (src / "stories260K.bin").read_bytes()
  p = tmp_path / "model.bin"
  p.write_bytes(data[:-4])
  with pytest.raises(ValueError, match=r"model\.bin: llama2\.c checkpoint has \d+ bytes, expected"):
    load_model(p)
  p.write_bytes(data[:12])
  with pytest.raises(ValueError, match=r"model\.bin: truncated llama2\.c checkpoint"):
    load_model(p)
  p.write_bytes(np.array([64, 172, 5, 8, 3, 512, 512], "<i4").tobytes() + data[28:])
  with pytest.raises(ValueError, match="inconsistent llama2.c header"):
    load_model(p)  # 8 heads are not a multiple of 3 KV heads


def test_llama2c_corrupt_tokenizer(tmp_path):
  src = _stories_dir()
  p = tmp_path / "tok.bin"
  p.write_bytes((src / "tok512.bin").read_bytes()[:-3])
  with pytest.raises(ValueError, match=r"tok\.bin: .*llama2\.c tokenizer"):
    load_model(src / "stories260K.bin", tokenizer=p)
  with pytest.raises(FileNotFoundError, match="tokenizer not found"):
    load_model(src / "stories260K.bin", tokenizer=tmp_path / "absent.bin")


def test_gguf_bad_magic_and_truncated(tmp_path):
  p = tmp_path / "m.gguf"
  p.write_bytes(b"GGML" + b"\0" * 64)
  with pytest.raises(ValueError, match=r"m\.gguf: not a GGUF file"):
    load_model(p)
  try:
    src = resources.smollm2_gguf_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  with open(src, "rb") as f:
    head = f.read(4_000_000)
  p.write_bytes(head[:200_000])  # inside the vocabulary metadata
  with pytest.raises(ValueError, match=r"m\.gguf: truncated GGUF file"):
    load_model(p)
  p.write_bytes(head)  # metadata complete, tensor data cut off
  with pytest.raises(ValueError, match=r"m\.gguf: truncated GGUF file: tensor '.*' needs bytes"):
    load_model(p)


def _minimal_gguf(path, arch="llama"):
  """Metadata and an embedding only: every layer tensor is missing."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(1)
  w.add_embedding_length(32)
  w.add_feed_forward_length(32)
  w.add_head_count(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(8)
  w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_gguf_missing_tensor_and_unsupported_arch(tmp_path):
  with pytest.raises(ValueError, match=r"a\.gguf: missing tensor 'blk\.0\.attn_norm\.weight'"):
    load_model(_minimal_gguf(tmp_path / "a.gguf"))
  with pytest.raises(ValueError, match=r"b\.gguf: general\.architecture 'gpt2'"):
    load_model(_minimal_gguf(tmp_path / "b.gguf", arch="gpt2"))


def test_tokenizer_argument_only_for_llama2c(hf_dir):
  with pytest.raises(ValueError, match="tokenizer= is only for llama2.c"):
    load_model(hf_dir, tokenizer="tok.bin")
