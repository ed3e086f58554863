"""Loading llama-architecture GGUF files (llama.cpp format), e.g. the embedded SmolLM2.

Q/K layout: llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj / k_proj
per head from HF's half-rotation layout into the interleaved (adjacent-pair) layout
its RoPE kernel uses (`permute(w, n_head)`: row p*H/2 + j -> row 2j + p). We undo it
with `kvlowrank.model.rope.permute_heads_to_half` so the parameters are in the HF
half layout, exactly what HF transformers' GGUF loader produces
(`_reverse_permute_weights`); K uses the KV head count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlowrank.loaders.gguf_file import GGUFFile
from kvlowrank.loaders.gguf_quants import dequantize
from kvlowrank.loaders.gguf_tokenizer import build_gpt2_tokenizer
from kvlowrank.loaders.progress import layer_range
from kvlowrank.model.rope import permute_heads_to_half
from kvlowrank.spec import ModelSpec

_LAYER_TENSORS = {  # kvlowrank layer key -> GGUF tensor suffix
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}
_BIASES = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
           "bo": "attn_output.bias"}


def _required(meta, key, path):
  if key not in meta:
    raise ValueError(f"{path}: missing GGUF field {key!r}")
  return meta[key]


def spec_from_metadata(meta: dict[str, Any], tensor_names: set[str], path: Path) -> ModelSpec:
  """ModelSpec from `llama.*` metadata; ValueError naming any unsupported field."""
  arch = _required(meta, "general.architecture", path)
  if arch != "llama":
    raise ValueError(f"{path}: general.architecture {arch!r} is not supported (only 'llama')")
  get = lambda k: _required(meta, f"llama.{k}", path)
  dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
  n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
  head_dim = int(meta.get("llama.attention.key_length", dim // n_heads))
  if int(meta.get("llama.attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"{path}: llama.attention.value_length != key_length is not supported")
  rot = int(meta.get("llama.rope.dimension_count", head_dim))
  if rot != head_dim:
    raise ValueError(f"{path}: llama.rope.dimension_count {rot} != head dim {head_dim} "
                     "(partial rotary) is not supported")
  scaling = meta.get("llama.rope.scaling.type", "none")
  if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
    raise ValueError(f"{path}: RoPE scaling (llama.rope.scaling.type={scaling!r} or a "
                     "rope_freqs.weight tensor) is not supported for GGUF")
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = int(meta.get("llama.vocab_size", len(tokens) if tokens else 0))
  if vocab <= 0:
    raise ValueError(f"{path}: missing GGUF field 'llama.vocab_size' (and no tokenizer tokens)")
  bos = meta.get("tokenizer.ggml.bos_token_id")
  eos = tuple(dict.fromkeys(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id",
                                                   "tokenizer.ggml.eot_token_id") if k in meta))
  return ModelSpec(
      vocab_size=vocab, dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
      n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(get("feed_forward_length")),
      norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
      tie_embeddings="output.weight" not in tensor_names,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      max_seq_len=int(meta.get("llama.context_length", 2048)),
      bos_id=None if bos is None else int(bos), eos_ids=eos, arch="llama")


def load_gguf(path: Path, progress: bool = False):
  """Reads a llama GGUF.

  Args:
    path: the .gguf file.
    progress: show a per-layer tqdm bar.
  Returns:
    (spec, params as float32 numpy pytree, tokenizer or None when the file has no
    tokenizer metadata).
  """
  path = Path(path)
  f = GGUFFile(path)
  meta, tensors = f.metadata, f.tensors
  spec = spec_from_metadata(meta, set(tensors), path)

  def get(name: str) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"{path}: missing tensor {name!r}")
    t = tensors[name]
    return dequantize(t.data, t.ggml_type, t.shape, name)

  def linear(name: str, heads: int = 0) -> np.ndarray:
    w = get(name)  # [out, in], torch layout
    if heads:
      w = permute_heads_to_half(w, heads)
    return np.ascontiguousarray(w.T)  # input-major: y = x @ w

  layers = []
  for i in layer_range(spec.n_layers, progress, path):
    b = f"blk.{i}."
    lp = {}
    for key, suffix in _LAYER_TENSORS.items():
      heads = {"wq": spec.n_heads, "wk": spec.n_kv_heads}.get(key, 0)
      lp[key] = get(b + suffix) if key.endswith("norm") else linear(b + suffix, heads)
    for key, suffix in _BIASES.items():
      if (spec.qkv_bias and key != "bo") or (key == "bo" and b + suffix in tensors):
        v = get(b + suffix)
        heads = {"bq": spec.n_heads, "bk": spec.n_kv_heads}.get(key, 0)
        lp[key] = permute_heads_to_half(v, heads) if heads else v
    layers.append(lp)
  params = {"embed": get("token_embd.weight"), "final_norm": get("output_norm.weight"),
            "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = np.ascontiguousarray(get("output.weight").T)
  tokenizer = None
  if "tokenizer.ggml.model" in meta:
    tokenizer = build_gpt2_tokenizer(
        {k: v for k, v in meta.items() if k.startswith("tokenizer.")}, str(path))
  return spec, params, tokenizer
