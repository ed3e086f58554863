"""GPU: every method's decode path runs its kernel, and agrees with the jnp reference.

Model: a 2-layer Llama of head dim 128 (the kernels' head dim), GQA 8/2, random bf16 weights
(Palu: random factors of the compressed shapes, as the decode benchmark). For each method:

1. Dispatch: a decode step with implementation None picks the method's kernel on this GPU
   (`choose_implementation`), not the reference.
2. Attention (one layer, the cache after a 96-token prefill, one decode query): kernel vs
   reference on the same cache, within a bound derived from the kernels' roundings. The
   reference computes in fp32 from the stored values; a kernel rounds q and the keys it
   reads (or reconstructs, or dequantizes) to 16 bits, the probabilities to 16 bits and the
   values to 16 bits, accumulating in fp32, then rounds the output to the cache dtype. With
   u = 2^-8 (bf16; fp16 scales round less), |q.k| changes by at most
   ds = scale * 2u * max|q| * max|k| (Cauchy-Schwarz), so each probability by a factor within
   exp(+-2 ds); o = sum p_i v_i then changes by at most
       max|v| * (exp(2 ds) - 1 + u/2 (p) + u/2 (v) + u/2 (output) + S 2^-23 (fp32 sums)).
   Negative control: the reference over the cache with its first half of tokens dropped is
   outside the bound.
3. Generation: greedy 64 tokens from a 96-token prompt with the kernels and with
   implementation="reference": the logits along the reference's tokens agree within a
   stated bf16 bound, and the tokens are identical up to a near tie
   (`test_greedy_generation_kernels_match_reference`). Negative control: one changed
   prompt token moves the logits outside the bound.
XQuant-CL and eviction run 3 only (GENERATION_ONLY): their layers attend inside `step`.
"""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvlowrank.bench.decode import random_params, BenchMethod  # noqa: E402
from kvlowrank.cache import dispatch  # noqa: E402
from kvlowrank.cache.base import init_caches  # noqa: E402
from kvlowrank.generate.loop import generate  # noqa: E402
from kvlowrank.methods import (DenseSpec, EvictSpec, GearSpec, KiviSpec,  # noqa: E402
                               PaluSpec, RotatedSpec, XQuantCLSpec, XQuantSpec)
from kvlowrank.model.transformer import forward  # noqa: E402
from kvlowrank.spec import ModelSpec  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(vocab_size=512, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128,
                 ffn_dim=1024, max_seq_len=4096, eos_ids=())
PROMPT, NEW = 96, 64
U = 2.0 ** -8

METHODS = {
    "dense": ("dense", DenseSpec(), ("cudnn", "triton")),
    "kivi2-warp": ("kivi", KiviSpec(bits=2, residual=32), ("mosaic",)),
    "kivi2-planar": ("kivi", KiviSpec(bits=2, residual=32, layout="planar"), ("triton",)),
    "kivi4": ("kivi", KiviSpec(bits=4, residual=32), ("triton",)),
    "palu": ("palu", PaluSpec(), ("mosaic",)),
    "palu-4bit-window": ("palu", PaluSpec(bits=4, window=16), ("mosaic",)),
    "palu-2bit": ("palu", PaluSpec(bits=2), ("mosaic",)),
    "xquant2": ("xquant", XQuantSpec(bits=2, group_size=128), ("xla",)),
    "xquant2-fused": ("xquant", XQuantSpec(bits=2, group_size=128, implementation="triton"),
                      ("triton",)),
    "xquant2-latent": ("xquant", XQuantSpec(bits=2, group_size=128, path="latent"), ("xla",)),
    # The "xla" path in chunks (`decode_chunk`; the default 2048 exceeds these caches).
    "xquant2-chunked": ("xquant", XQuantSpec(bits=2, group_size=128, decode_chunk=64),
                        ("xla",)),
    "gear2": ("gear", GearSpec(), ("triton",)),
    "gearl2": ("gear", GearSpec(sparsity=0.0), ("mosaic",)),
    "gearl2-g32": ("gear", GearSpec(sparsity=0.0, group_size=32), ("mosaic",)),
    "fdc50": ("fdc", RotatedSpec(), ("triton",)),
    "zack50": ("zack", RotatedSpec(), ("triton",)),
    # 4-bit K'/V': the kernel on the prefix dequantized to bf16, the exact ring by jnp.
    "zack50-4bit": ("zack", RotatedSpec(bits=4), ("triton",)),
    # Generation only (no per-layer `attend` of their own: XQuant-CL's layers need the
    # cross-layer carry; eviction's attention is its inner cache's plus the window's).
    "xquant_cl2": ("xquant_cl", XQuantCLSpec(bits=2, group_size=128), ("xla",)),
    "xquant_cl2-chunked": ("xquant_cl", XQuantCLSpec(bits=2, group_size=128, decode_chunk=64),
                           ("xla",)),
    "evict-kivi2": ("evict", EvictSpec(inner="kivi", budget=128, window=16,
                                       inner_specs={"kivi": {"residual": 32}}), ("mosaic",)),
}
GENERATION_ONLY = ("xquant_cl2", "xquant_cl2-chunked", "evict-kivi2")


def _reference_spec(mspec):
  """The method spec with the jnp reference path (eviction: its inner method's spec)."""
  if isinstance(mspec, EvictSpec):
    inner = dict(mspec.inner_specs)
    fields = {} if mspec.inner not in inner else dataclasses.asdict(inner[mspec.inner])
    return dataclasses.replace(mspec, inner_specs={
        mspec.inner: dict(fields, implementation="reference")})
  return dataclasses.replace(mspec, implementation="reference")


@pytest.fixture(scope="module")
def gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")


def _setup(name):
  cache, mspec, kernels = METHODS[name]
  params = random_params(SPEC, jax.random.key(0), BenchMethod(name, cache, mspec))
  # Sharper next-token distributions than uniform-init weights give (greedy margins).
  params["lm_head"] = params["lm_head"] * 20
  return cache, mspec, kernels, params


def _prompt(seed=0):
  return np.random.default_rng(seed).integers(0, SPEC.vocab_size, size=(2, PROMPT)).tolist()


def _values_and_keys(c, lp):
  """(max|k|, max|v|) of what attention reads (keys post-RoPE; Palu: value latents)."""
  if hasattr(c, "stored"):        # rotated: attention reads K', V' as stored
    k, v = c.stored()
  elif hasattr(c, "rematerialize"):
    k, v = c.rematerialize(lp, SPEC, jnp.float32)
  elif hasattr(c, "latents"):
    k = c.materialize()[0]
    v = c.latents()[1]
  else:
    k, v = c.materialize()[:2]
  return float(jnp.max(jnp.abs(k))), float(jnp.max(jnp.abs(v)))


@pytest.mark.parametrize("name", [m for m in METHODS if m not in GENERATION_ONLY])
def test_decode_dispatch_and_attention_within_bound(gpu, name):
  cache_name, mspec, kernels, params = _setup(name)
  caches = init_caches(cache_name, mspec, SPEC, params, batch=2, capacity=PROMPT + NEW + 8,
                       dtype=jnp.bfloat16)
  tok = jnp.asarray(_prompt())
  pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), tok.shape)
  _, caches = jax.jit(lambda t, p, c: forward(params, t, p, c, SPEC))(tok, pos, caches)
  c, lp = caches[0], params["layers"][0]
  q = (0.1 * jax.random.normal(jax.random.key(3), (2, 1, SPEC.n_heads, SPEC.head_dim))
       ).astype(jnp.bfloat16)
  qpos = jnp.full((2, 1), PROMPT - 1, jnp.int32)
  impl, reason = c.choose_implementation(q.shape)
  assert impl in kernels, (impl, reason)
  assert c.choose_implementation((2, 4, SPEC.n_heads, SPEC.head_dim))[0] == dispatch.REFERENCE
  run = jax.jit(lambda c, q, impl: c.attend(q, qpos, lp, spec=SPEC, implementation=impl)[0],
                static_argnums=2)
  got = np.asarray(run(c, q, impl), np.float64)
  want = np.asarray(run(c, q, "reference"), np.float64)
  kmax, vmax = _values_and_keys(c, lp)
  ds = SPEC.head_dim ** -0.5 * 2 * U * float(jnp.max(jnp.linalg.norm(
      q.astype(jnp.float32), axis=-1))) * kmax * np.sqrt(SPEC.head_dim)
  bound = vmax * (np.expm1(2 * ds) + 1.5 * U + PROMPT * 2.0 ** -23)
  err = float(np.abs(got - want).max())
  assert err <= bound, (name, impl, err, bound)
  # Negative control: half of the history missing is outside the bound.
  if hasattr(c, "stores"):
    half = dataclasses.replace(c, stores=tuple(dataclasses.replace(s, lens=s.lens // 2)
                                               for s in c.stores))
  elif getattr(c, "quant", None) is not None:     # quantized rotated: the inner store's
    half = dataclasses.replace(c, lens=c.lens // 2,
                               quant=dataclasses.replace(c.quant, lens=c.quant.lens // 2))
  else:
    half = dataclasses.replace(c, lens=c.lens // 2)
  other = np.asarray(run(half, q, "reference"), np.float64)
  assert float(np.abs(other - want).max()) > bound, (name, bound)


# Params are an argument, not a closure constant: one compile per cache type and shape
# serves every call (the reference run and its negative control share theirs).
_step = jax.jit(lambda params, t, p, c: forward(params, t, p, c, SPEC))


def _teacher_forced(params, cache_name, mspec, prompts, tokens):
  """Next-token logits [B, NEW, V] along `tokens` [B, NEW]: the prompt's last position (a
  prefill), then each token fed alone (decode steps), as greedy generation makes them."""
  caches = init_caches(cache_name, mspec, SPEC, params, batch=len(prompts),
                       capacity=PROMPT + NEW + 8, dtype=jnp.bfloat16)
  tok = jnp.asarray(prompts, jnp.int32)
  logits, caches = _step(params, tok, jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32),
                                                       tok.shape), caches)
  out = [logits[:, -1]]
  tokens = jnp.asarray(tokens, jnp.int32)
  for i in range(NEW - 1):
    logits, caches = _step(params, tokens[:, i:i + 1],
                           jnp.full((len(prompts), 1), PROMPT + i, jnp.int32), caches)
    out.append(logits[:, 0])
  return np.asarray(jnp.stack(out, axis=1), np.float64)


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_generation_kernels_match_reference(gpu, name):
  """Greedy generation with the kernels vs implementation="reference".

  Bound: along the reference's greedy trajectory (teacher-forced), the kernels' logits
  differ from the reference's by at most tau = L * 4 * 2^-8 * max|logits| (L layers): each
  layer's attention output carries a kernel error of a few bf16 units of roundoff of the
  values it averages (test_decode_dispatch_and_attention_within_bound derives it), and the
  residual stream, renormalised by RMSNorm, carries a relative error to the logits without
  gain beyond its own scale. The generated tokens are identical up to the first step where
  the reference's margin between its token and the kernels' token is within 2x the
  measured logit difference (a near tie the kernels' bf16 rounding may flip); after that
  the two continuations are different texts and are not compared.
  Negative control: the reference logits along the same tokens after one changed prompt
  token differ by more than tau.
  """
  cache_name, mspec, kernels, params = _setup(name)
  ref_spec = _reference_spec(mspec)
  caches = init_caches(cache_name, mspec, SPEC, params, batch=2, capacity=PROMPT + NEW + 8,
                       dtype=jnp.bfloat16)
  impl = caches[-1].choose_implementation((2, 1, SPEC.n_heads, SPEC.head_dim))
  assert impl[0] in kernels, impl
  gen = lambda ms, prompts: generate(params, SPEC, prompts, max_new_tokens=NEW,
                                     cache_method=cache_name, cache_spec=ms,
                                     cache_dtype=jnp.bfloat16, eos_ids=()).tokens
  prompts = _prompt()
  kern, ref = gen(mspec, prompts), gen(ref_spec, prompts)
  assert all(len(t) == NEW for t in kern + ref)
  lr = _teacher_forced(params, cache_name, ref_spec, prompts, ref)
  lk = _teacher_forced(params, cache_name, mspec, prompts, ref)
  diff = float(np.abs(lk - lr).max())
  tau = SPEC.n_layers * 4 * U * float(np.abs(lr).max())
  assert diff <= tau, (name, diff, tau)
  for row in range(len(prompts)):
    k_row, r_row = np.asarray(kern[row]), np.asarray(ref[row])
    differ = np.nonzero(k_row != r_row)[0]
    if differ.size:
      t = int(differ[0])
      margin = lr[row, t, r_row[t]] - lr[row, t, k_row[t]]
      assert margin <= 2 * diff, (name, row, t, margin, diff)
  # Negative control: one changed prompt token moves the logits by more than tau.
  other = [list(p) for p in prompts]
  other[0][PROMPT // 2] = (other[0][PROMPT // 2] + 1) % SPEC.vocab_size
  lo = _teacher_forced(params, cache_name, ref_spec, other, ref)
  assert float(np.abs(lo - lr).max()) > tau, name
