"""llama2.c loader: stories260K (and a synthetic unshared-classifier checkpoint) logits vs an
independent float64 numpy re-implementation of llama2.c's forward that reads the .bin
directly and rotates adjacent RoPE pairs natively; tokenizer vs an independent
re-implementation of llama2.c's encode, and round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import resources
from kvlowrank.methods import DenseSpec, init_caches
from kvlowrank.loaders import load_model
from kvlowrank.model import forward

_fwd = jax.jit(forward, static_argnames=("spec",))
TOL = 1e-4  # fp32 ours vs float64 reference


def _stories():
  d = resources.shared_dir()
  if d is None or not (d / "models/stories260K/stories260K.bin").exists():
    pytest.skip("../shared/models/stories260K not available")
  return d / "models/stories260K"


# ------------------------------------------------------------ float64 reference


def _read_bin(path):
  """llama2.c checkpoint -> dict of float64 arrays (run.c memory_map_weights order)."""
  dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = np.fromfile(path, "<i4", 7).tolist()
  flat = np.fromfile(path, "<f4", offset=28).astype(np.float64)
  hs = dim // n_heads
  kv_dim = n_kv * hs
  w, off = dict(dim=dim, n_heads=n_heads, n_kv=n_kv, hs=hs), 0
  shapes = [("emb", (abs(vocab), dim)), ("rms_att", (n_layers, dim)),
            ("wq", (n_layers, dim, dim)), ("wk", (n_layers, kv_dim, dim)),
            ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
            ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)),
            ("w2", (n_layers, dim, hidden)), ("w3", (n_layers, hidden, dim)),
            ("rms_final", (dim,)), ("freq", (2, seq_len, hs // 2))]
  if vocab < 0:
    shapes.append(("wcls", (-vocab, dim)))
  for name, shape in shapes:
    n = int(np.prod(shape))
    w[name] = flat[off:off + n].reshape(shape)
    off += n
  assert off == flat.size
  w["wcls"] = w.get("wcls", w["emb"])
  w["n_layers"] = n_layers
  return w


def _rmsnorm(x, g):
  return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5)


def _rope_adjacent(x, pos, hs, half_layout=False):
  """run.c: rotate pairs (i, i+1) of each head by pos * 10000^(-(i % hs) / hs).
  half_layout=True pairs (j, j + hs/2) instead (the negative control)."""
  t, n = x.shape[0], x.shape[1] // hs
  x = x.reshape(t, n, hs).copy()
  j = np.arange(hs // 2)
  ang = pos[:, None] * 10000.0 ** (-(2 * j) / hs)  # [T, hs/2]
  c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
  a, b = (j, j + hs // 2) if half_layout else (2 * j, 2 * j + 1)
  x0, x1 = x[..., a], x[..., b]
  x[..., a], x[..., b] = x0 * c - x1 * s, x0 * s + x1 * c
  return x.reshape(t, n * hs)


def _ref_logits(w, tokens, half_layout=False):
  """float64 llama2.c forward over all positions of `tokens` (causal)."""
  t, hs = len(tokens), w["hs"]
  pos = np.arange(t, dtype=np.float64)
  x = w["emb"][tokens]
  group = w["n_heads"] // w["n_kv"]
  causal = np.tril(np.ones((t, t), bool))
  for l in range(w["n_layers"]):
    xb = _rmsnorm(x, w["rms_att"][l])
    q = _rope_adjacent(xb @ w["wq"][l].T, pos, hs, half_layout)
    k = _rope_adjacent(xb @ w["wk"][l].T, pos, hs, half_layout)
    v = xb @ w["wv"][l].T
    out = np.zeros_like(q)
    for h in range(w["n_heads"]):
      kh = h // group
      qh, khh, vh = (a[:, s * hs:(s + 1) * hs] for a, s in ((q, h), (k, kh), (v, kh)))
      sc = np.where(causal, qh @ khh.T / np.sqrt(hs), -np.inf)
      p = np.exp(sc - sc.max(-1, keepdims=True))
      out[:, h * hs:(h + 1) * hs] = (p / p.sum(-1, keepdims=True)) @ vh
    x = x + out @ w["wo"][l].T
    xb = _rmsnorm(x, w["rms_ffn"][l])
    g = xb @ w["w1"][l].T
    x = x + ((g / (1 + np.exp(-g))) * (xb @ w["w3"][l].T)) @ w["w2"][l].T
  return _rmsnorm(x, w["rms_final"]) @ w["wcls"].T


# ------------------------------------------------------------------- logits


def _ours(m, tokens):
  ids = jnp.asarray([tokens], jnp.int32)
  pos = jnp.arange(len(tokens), dtype=jnp.int32)[None]
  prefill = np.asarray(_fwd(m.params, ids, pos, None, m.spec)[0][0])
  caches = init_caches("dense", DenseSpec(), m.spec, m.params, batch=1, capacity=len(tokens),
                       dtype=jnp.float32)
  steps = []
  for t in range(len(tokens)):
    out, caches = _fwd(m.params, ids[:, t:t + 1], pos[:, t:t + 1], caches, m.spec)
    steps.append(np.asarray(out[0, 0]))
  return prefill, np.stack(steps)


def test_stories260k_logits_match_float64_reference():
  d = _stories()
  m = load_model(d / "stories260K.bin")
  s = m.spec
  assert (s.dim, s.ffn_dim, s.n_layers, s.n_heads, s.n_kv_heads, s.vocab_size, s.max_seq_len) \
      == (64, 172, 5, 8, 4, 512, 512)
  assert s.tie_embeddings and s.rope_layout == "half" and s.head_dim == 8
  tokens = m.tokenizer.encode("Once upon a time, there was a little cat named Tom.")
  ref = _ref_logits(_read_bin(d / "stories260K.bin"), tokens)
  prefill, decode = _ours(m, tokens)
  dp, dd = np.abs(prefill - ref).max(), np.abs(decode - ref).max()
  print(f"stories260K max|dlogit| prefill {dp:.2e} decode {dd:.2e} (max|logit| "
        f"{np.abs(ref).max():.1f})")
  assert dp < TOL and dd < TOL
  # Negative control: pairing RoPE as (j, j + H/2) on the raw weights is a different model.
  bad = _ref_logits(_read_bin(d / "stories260K.bin"), tokens, half_layout=True)
  assert np.abs(bad - ref).max() > 100 * TOL


def test_unshared_classifier_gqa_synthetic(tmp_path):
  """A random llama2.c file with a negative vocab (wcls stored) and GQA 6/2."""
  dim, hidden, n_layers, n_heads, n_kv, vocab, seq = 48, 40, 2, 6, 2, 37, 16
  hs = dim // n_heads
  rng = np.random.default_rng(0)
  counts = [vocab * dim, n_layers * dim, n_layers * dim * dim, 2 * n_layers * n_kv * hs * dim,
            n_layers * dim * dim, n_layers * dim, 3 * n_layers * hidden * dim, dim,
            seq * hs, vocab * dim]
  body = np.concatenate([rng.standard_normal(c) * 0.4 for c in counts]).astype("<f4")
  path = tmp_path / "model.bin"
  path.write_bytes(np.array([dim, hidden, n_layers, n_heads, n_kv, -vocab, seq], "<i4")
                   .tobytes() + body.tobytes())
  m = load_model(path)
  assert not m.spec.tie_embeddings and m.tokenizer is None and m.spec.n_kv_heads == 2
  tokens = rng.integers(0, vocab, 11).tolist()
  w = _read_bin(path)
  assert not np.array_equal(w["wcls"], w["emb"])
  ref = _ref_logits(w, tokens)
  prefill, decode = _ours(m, tokens)
  assert np.abs(prefill - ref).max() < TOL and np.abs(decode - ref).max() < TOL
  # Negative control: using the embedding as classifier (ignoring wcls) must fail.
  w["wcls"] = w["emb"]
  assert np.abs(_ref_logits(w, tokens) - ref).max() > 100 * TOL


# ---------------------------------------------------------------- tokenizer


def _ref_encode(pieces, scores, text, bos=True, dummy_prefix=True, by_score=True):
  """Independent llama2.c `encode`: strings of bytes, merged by best score (leftmost
  pair on ties). by_score=False merges the leftmost mergeable pair instead (negative
  control: another merge order)."""
  index = {}
  for i, p in enumerate(pieces):
    index.setdefault(p, i)
  data = text.encode()
  syms = [b" "] if (data and dummy_prefix) else []
  cps, cur = [], b""
  for byte in data:
    if cur and (byte & 0xC0) != 0x80:
      cps.append(cur)
      cur = b""
    cur += bytes([byte])
  if cur:
    cps.append(cur)
  for cp in cps:
    syms += [cp] if cp in index else [b"<0x%02X>" % c for c in cp]
  while True:
    cands = [(scores[index[a + b]] if by_score else 0.0, -i)
             for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in index]
    if not cands:
      break
    i = -max(cands)[1]
    syms[i:i + 2] = [syms[i] + syms[i + 1]]
  return ([1] if bos else []) + [index[s] for s in syms]


TEXTS = ["Once upon a time, there was a little girl named Lily.", "", "a", " lead and trail ",
         "She said: \"Wow!\" 123\n\nThe end.", "naïve café — 😀 日本", "tab\there"]


def test_tokenizer_matches_reference_and_round_trips():
  d = _stories()
  tok = load_model(d / "stories260K.bin").tokenizer
  assert (tok.bos_id, tok.eos_ids, tok.vocab_size, tok.adds_bos) == (1, (2,), 512, True)
  rng = np.random.default_rng(0)
  alphabet = list("abcdefghij klmnop,.!?'\n") + ["é", "ß", "日", "😀"]
  texts = TEXTS + ["".join(rng.choice(alphabet, 30)) for _ in range(20)]
  for text in texts:
    ids = tok.encode(text)
    assert ids == _ref_encode(tok.pieces, tok.scores, text), text
    assert tok.decode(ids, skip_special=True) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text
  assert tok.encode("") == [1]
  # Byte fallback: 😀 is not a piece, so it becomes its 4 UTF-8 byte tokens (byte + 3).
  assert tok.encode("😀", add_bos=False)[-4:] == [b + 3 for b in "😀".encode()]
  # Negative control: without llama2.c's dummy prefix the ids differ.
  text = TEXTS[0]
  assert tok.encode(text) != _ref_encode(tok.pieces, tok.scores, text, dummy_prefix=False)
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenizer_long_text_matches_reference():
  """The heap-based merge (O(n log n)) makes the same merges as llama2.c's rescan loop
  on a long text (thousands of merges, many equal-score ties and repeated words)."""
  d = _stories()
  tok = load_model(d / "stories260K.bin").tokenizer
  rng = np.random.default_rng(1)
  words = ("Once upon a time there was a little girl named Lily . She liked to play in "
           "the park with her dog , Max ! \"Wow,\" said Tom. naïve café 日本 😀 the the "
           "aaaa bbbb    ").split(" ")
  text = " ".join(rng.choice(words, 800))
  assert len(text) > 3000
  ids = tok.encode(text)
  assert ids == _ref_encode(tok.pieces, tok.scores, text)
  assert tok.decode(ids, skip_special=True) == text
  # Negative control: another merge order (leftmost mergeable pair first, scores
  # ignored) gives other ids on this text.
  assert ids != _ref_encode(tok.pieces, tok.scores, text, by_score=False)


def test_explicit_tokenizer_path(tmp_path):
  d = _stories()
  model = tmp_path / "m.bin"
  model.symlink_to(d / "stories260K.bin")
  assert load_model(model).tokenizer is None  # nothing beside it
  m = load_model(model, tokenizer=d / "tok512.bin")
  assert m.tokenizer.encode("Once") == load_model(d / "stories260K.bin").tokenizer.encode("Once")
