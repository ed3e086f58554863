"""Loading llama2.c checkpoints (`.bin`, Karpathy's legacy export, e.g. stories260K).

Layout (llama2.c run.c `read_checkpoint` / `memory_map_weights`): a 7 x int32 header
(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means an unshared classifier), then float32 arrays in this order:
token_embedding [V, D], rms_att [L, D], wq [L, N*H, D], wk [L, K*H, D], wv [L, K*H, D],
wo [L, D, N*H], rms_ffn [L, D], w1 [L, F, D], w2 [L, D, F], w3 [L, F, D], rms_final [D],
freq_cis_real / freq_cis_imag [seq_len, H/2] (unused: RoPE is recomputed), and
wcls [V, D] when unshared. Matrices are torch-layout [out, in]; head_dim = dim / n_heads.

RoPE layout: llama2.c rotates adjacent pairs (2j, 2j+1) of each head. We convert
wq / wk rows to the HF half-rotation layout (pair j -> (j, j + H/2)) with
`permute_heads_to_half`, so every model in kvlowrank uses `rope_layout="half"`;
attention scores are unchanged because Q and K get the same permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from kvlowrank.loaders.llama2c_tokenizer import BOS_ID, EOS_ID, Llama2cTokenizer
from kvlowrank.loaders.progress import layer_range
from kvlowrank.model.rope import permute_heads_to_half
from kvlowrank.spec import ModelSpec

HEADER_INTS = 7


def read_header(path: Path) -> tuple[ModelSpec, bool]:
  """(spec, shared_classifier) from the 7-int header; ValueError naming the file."""
  raw = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
  if raw.size < HEADER_INTS:
    raise ValueError(f"{path}: truncated llama2.c checkpoint (header needs {HEADER_INTS} int32)")
  dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = (int(x) for x in raw)
  fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
                n_kv_heads=n_kv, seq_len=seq_len)
  for k, v in fields.items():
    if v <= 0:
      raise ValueError(f"{path}: llama2.c header field {k} = {v} must be positive")
  if vocab == 0 or dim % n_heads or n_heads % n_kv:
    raise ValueError(f"{path}: inconsistent llama2.c header {dict(fields, vocab_size=vocab)}")
  spec = ModelSpec(vocab_size=abs(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=n_kv, head_dim=dim // n_heads, ffn_dim=hidden, norm_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=vocab > 0, max_seq_len=seq_len,
                   bos_id=BOS_ID, eos_ids=(EOS_ID,), arch="llama")
  return spec, vocab > 0


def _sections(spec: ModelSpec, shared: bool) -> list[tuple[str, tuple[int, ...]]]:
  """(name, shape) of every float32 array in file order."""
  v, d, l, f = spec.vocab_size, spec.dim, spec.n_layers, spec.ffn_dim
  q, kv, half = spec.q_dim, spec.kv_dim, spec.head_dim // 2
  out = [("token_embedding", (v, d)), ("rms_att", (l, d)), ("wq", (l, q, d)),
         ("wk", (l, kv, d)), ("wv", (l, kv, d)), ("wo", (l, d, q)), ("rms_ffn", (l, d)),
         ("w1", (l, f, d)), ("w2", (l, d, f)), ("w3", (l, f, d)), ("rms_final", (d,)),
         ("freq_cis_real", (spec.max_seq_len, half)), ("freq_cis_imag", (spec.max_seq_len, half))]
  return out if shared else out + [("wcls", (v, d))]


def read_llama2c_arrays(path: Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
  """The raw llama2.c arrays by name (torch layout, interleaved RoPE), size-checked."""
  path = Path(path)
  spec, shared = read_header(path)
  sections = _sections(spec, shared)
  expected = 4 * (HEADER_INTS + sum(int(np.prod(s)) for _, s in sections))
  size = path.stat().st_size
  if size != expected:
    raise ValueError(f"{path}: llama2.c checkpoint has {size} bytes, expected {expected} for "
                     f"its header (truncated or corrupt file?)")
  flat = np.memmap(path, dtype="<f4", mode="r", offset=4 * HEADER_INTS)
  arrays, off = {}, 0
  for name, shape in sections:
    n = int(np.prod(shape))
    arrays[name] = np.asarray(flat[off:off + n], dtype=np.float32).reshape(shape)
    off += n
  return spec, arrays


def find_tokenizer(path: Path, vocab_size: int, explicit: Optional[Path]) -> Optional[Path]:
  """The tokenizer file: `explicit`, else tokenizer.bin or tok<V>.bin beside `path`."""
  if explicit is not None:
    explicit = Path(explicit)
    if not explicit.is_file():
      raise FileNotFoundError(f"llama2.c tokenizer not found: {explicit}")
    return explicit
  for name in ("tokenizer.bin", f"tok{vocab_size}.bin"):
    if (path.parent / name).is_file():
      return path.parent / name
  return None


def load_llama2c(path: Path, tokenizer: Optional[Path] = None, progress: bool = False):
  """Reads a llama2.c checkpoint and its tokenizer.

  Args:
    path: the model .bin.
    tokenizer: explicit tokenizer file (default: tokenizer.bin / tok<V>.bin beside it).
  Returns:
    (spec, float32 numpy params in half RoPE layout, Llama2cTokenizer or None).
  """
  path = Path(path)
  spec, a = read_llama2c_arrays(path)
  lin = lambda w: np.ascontiguousarray(w.T)  # [out, in] -> [in, out]
  layers = []
  for i in layer_range(spec.n_layers, progress, path):
    layers.append({
        "attn_norm": a["rms_att"][i],
        "wq": lin(permute_heads_to_half(a["wq"][i], spec.n_heads)),
        "wk": lin(permute_heads_to_half(a["wk"][i], spec.n_kv_heads)),
        "wv": lin(a["wv"][i]), "wo": lin(a["wo"][i]), "mlp_norm": a["rms_ffn"][i],
        "w_gate": lin(a["w1"][i]), "w_up": lin(a["w3"][i]), "w_down": lin(a["w2"][i])})
  params = {"embed": a["token_embedding"], "final_norm": a["rms_final"], "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = lin(a["wcls"])
  tok_path = find_tokenizer(path, spec.vocab_size, tokenizer)
  tok = None
  if tok_path is not None:
    tok = Llama2cTokenizer.from_file(tok_path)
    if tok.vocab_size != spec.vocab_size:
      raise ValueError(f"{tok_path}: tokenizer has {tok.vocab_size} tokens but {path} has a "
                       f"vocabulary of {spec.vocab_size}")
  return spec, params, tok
