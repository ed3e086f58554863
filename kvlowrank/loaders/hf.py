"""Loading HF transformers checkpoint directories (Llama, Llama-3, Mistral, Qwen2).

Reads config.json, `*.safetensors` (single or sharded) and, when present,
tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json).
torch Linear weights [out, in] are transposed to input-major [in, out]; HF weights
are already in the half-rotation RoPE layout, so Q/K need no permutation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import tokenizers

from kvlowrank.loaders.bpe_tokenizer import BPETokenizer
from kvlowrank.loaders.progress import layer_range
from kvlowrank.loaders.safetensors_io import SafetensorsCheckpoint
from kvlowrank.spec import ModelSpec, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER_TENSORS = {  # kvlowrank layer key -> HF name suffix
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def read_json(path: Path) -> dict:
  """Parsed JSON object; ValueError naming the file when it is malformed."""
  try:
    obj = json.loads(Path(path).read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: malformed JSON ({e})") from e
  if not isinstance(obj, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def _ids(x) -> list[int]:
  if x is None:
    return []
  return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


def _rope(cfg: dict, path: Path) -> tuple[float, Optional[RopeScaling]]:
  """(theta, scaling) from `rope_parameters` (transformers v5) or `rope_theta` +
  `rope_scaling` (v4)."""
  rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
  field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
  theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
  rtype = rp.get("rope_type", rp.get("type", "default"))
  if float(cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))) != 1.0:
    raise ValueError(f"{path}: partial_rotary_factor != 1 is not supported")
  if rtype == "default":
    return theta, None
  if rtype != "llama3":
    raise ValueError(f"{path}: {field}.rope_type {rtype!r} is not supported "
                     "(supported: default, llama3)")
  try:
    return theta, RopeScaling(
        factor=float(rp["factor"]), low_freq_factor=float(rp["low_freq_factor"]),
        high_freq_factor=float(rp["high_freq_factor"]),
        original_max_position_embeddings=int(rp["original_max_position_embeddings"]))
  except KeyError as e:
    raise ValueError(f"{path}: {field} of type llama3 is missing {e.args[0]!r}") from None


def _sliding_window(cfg: dict, mt: str, n_layers: int, path: Path) -> Optional[int]:
  """One window for all layers, or None; mixed per-layer windows are unsupported."""
  window = cfg.get("sliding_window")
  if "layer_types" in cfg and cfg["layer_types"] is not None:
    kinds = set(cfg["layer_types"])
    if kinds == {"full_attention"}:
      return None
    if kinds == {"sliding_attention"} and window:
      return int(window)
    raise ValueError(f"{path}: layer_types {sorted(kinds)} (per-layer attention kinds) is not "
                     "supported")
  if mt == "qwen2":
    if not cfg.get("use_sliding_window", False) or not window:
      return None
    first = int(cfg.get("max_window_layers", 0))  # Qwen2 slides layers >= this index
    if first >= n_layers:
      return None
    if first > 0:
      raise ValueError(f"{path}: use_sliding_window with max_window_layers > 0 is not supported")
    return int(window)
  if mt == "mistral" and window:
    return int(window)
  return None


def spec_from_config(cfg: dict, path: Path, extra_eos=()) -> ModelSpec:
  """ModelSpec from a HF config.json dict; ValueError naming the bad field."""
  mt = cfg.get("model_type")
  if mt not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{path}: model_type {mt!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)})")

  def need(k):
    if cfg.get(k) is None:
      raise ValueError(f"{path}: missing field {k!r}")
    return cfg[k]

  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
  if cfg.get("mlp_bias", False):
    raise ValueError(f"{path}: mlp_bias=true is not supported")
  dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
  n_layers = int(need("num_hidden_layers"))
  theta, scaling = _rope(cfg, path)
  qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias", False))
  return ModelSpec(
      vocab_size=int(need("vocab_size")), dim=dim, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
      head_dim=int(cfg.get("head_dim") or dim // n_heads),
      ffn_dim=int(need("intermediate_size")), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      rope_theta=theta, rope_scaling=scaling,
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
      sliding_window=_sliding_window(cfg, mt, n_layers, path),
      max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
      bos_id=cfg.get("bos_token_id"),
      eos_ids=tuple(dict.fromkeys(_ids(cfg.get("eos_token_id")) + list(extra_eos))), arch=mt)


def load_hf_params(directory: Path, spec: ModelSpec, progress: bool = False) -> dict:
  """Float32 numpy parameter pytree from the directory's safetensors."""
  ckpt = SafetensorsCheckpoint(directory)
  f32 = lambda name: np.asarray(ckpt.get(name), dtype=np.float32)
  linear = lambda name: np.ascontiguousarray(f32(name).T)  # torch [out,in] -> [in,out]
  layers = []
  for i in layer_range(spec.n_layers, progress, directory):
    pre = f"model.layers.{i}."
    lp = {k: (f32(pre + s) if k.endswith("norm") else linear(pre + s))
          for k, s in _LAYER_TENSORS.items()}
    if spec.qkv_bias:
      for k, s in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
        lp[k] = f32(f"{pre}self_attn.{s}.bias")
      if pre + "self_attn.o_proj.bias" in ckpt:  # Llama attention_bias also biases o_proj
        lp["bo"] = f32(pre + "self_attn.o_proj.bias")
    layers.append(lp)
  params = {"embed": f32("model.embed_tokens.weight"), "final_norm": f32("model.norm.weight"),
            "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = linear("lm_head.weight")
  return params


def _token_string(x) -> Optional[str]:
  return x.get("content") if isinstance(x, dict) else x


def load_hf_tokenizer(directory: Path, spec: ModelSpec) -> Optional[BPETokenizer]:
  """Tokenizer from tokenizer.json (+ tokenizer_config.json); None when there is none."""
  tj = directory / "tokenizer.json"
  if not tj.exists():
    return None
  try:
    backend = tokenizers.Tokenizer.from_file(str(tj))
  except Exception as e:  # tokenizers raises a bare Exception on malformed files
    raise ValueError(f"{tj}: cannot parse tokenizer ({e})") from e
  tc_path = directory / "tokenizer_config.json"
  tc: dict[str, Any] = read_json(tc_path) if tc_path.exists() else {}
  template = tc.get("chat_template")
  if isinstance(template, list):  # named templates: use "default"
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  jinja = directory / "chat_template.jinja"  # transformers >= 4.47 saves it separately
  if template is None and jinja.exists():
    template = jinja.read_text()
  bos_tok = _token_string(tc.get("bos_token"))
  bos = backend.token_to_id(bos_tok) if bos_tok else None
  bos = spec.bos_id if bos is None else bos
  eos_tok = _token_string(tc.get("eos_token"))
  eos_id = backend.token_to_id(eos_tok) if eos_tok else None
  eos = [] if eos_id is None else [eos_id]
  if "add_bos_token" in tc:
    adds_bos = bool(tc["add_bos_token"])
  else:  # no flag: ask the post-processor whether it prepends BOS
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    adds_bos = bos is not None and len(full) > len(plain) and full[0] == bos
  return BPETokenizer(backend, bos_id=bos, eos_ids=tuple(dict.fromkeys(eos + list(spec.eos_ids))),
                      adds_bos=adds_bos, chat_template=template, source=str(directory))


def load_hf(directory: Path, progress: bool = False):
  """Reads a HF checkpoint directory.

  Args:
    directory: folder holding config.json and *.safetensors.
  Returns:
    (spec, float32 numpy params, tokenizer or None).
  """
  directory = Path(directory)
  cfg_path = directory / "config.json"
  if not cfg_path.exists():
    raise FileNotFoundError(f"{directory}: no config.json (not a HF checkpoint directory)")
  cfg = read_json(cfg_path)
  gen_path = directory / "generation_config.json"
  extra_eos = _ids(read_json(gen_path).get("eos_token_id")) if gen_path.exists() else []
  spec = spec_from_config(cfg, cfg_path, extra_eos)
  params = load_hf_params(directory, spec, progress)
  return spec, params, load_hf_tokenizer(directory, spec)
