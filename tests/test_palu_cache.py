"""Palu latent cache against the dense oracle (random tiny models, fp32)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlowrank.methods.palu as palu
from kvlowrank_kernels import quant
from kvlowrank.cache import base, init_caches
from kvlowrank.methods.palu.cache import SCALE_DTYPE, LatentCache
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.model.params import layer_shapes
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec

TOL = 1e-4


def _spec(n=8, k=4, rope="half", bias=True, h=16):
  return ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=n, n_kv_heads=k, head_dim=h,
                   ffn_dim=48, qkv_bias=bias, rope_layout=rope)


def _init_params(spec, seed=0, scale=0.25):
  """Seeded numpy init (init_params' eager jax.random calls cost seconds of compiles)."""
  rng = np.random.default_rng(seed)
  mk = lambda shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
  layers = [{n: (jnp.ones(sh) if n.endswith("norm") else mk(sh))
             for n, sh in layer_shapes(spec).items()} for _ in range(spec.n_layers)]
  params = {"embed": mk((spec.vocab_size, spec.dim)), "final_norm": jnp.ones(spec.dim),
            "layers": layers}
  if not spec.tie_embeddings:
    params["lm_head"] = mk((spec.dim, spec.vocab_size))
  return params


@functools.lru_cache(maxsize=None)
def _model(spec):
  params = _init_params(spec)
  windows = np.random.default_rng(0).integers(0, spec.vocab_size, (8, 32))
  return params, palu.calibrate(params, spec, windows)


def _pspec(**kw):
  """Uniform rank search (Fisher has its own test), multiple 8 for tiny dims."""
  return palu.PaluSpec(**dict(dict(rank_search="uniform", rank_multiple=8), **kw))


@functools.partial(jax.jit, static_argnames=("spec",))
def _fwd(params, toks, pos, caches, spec):
  return forward(params, toks, pos, caches, spec)


def _tokens(spec, b=2, t=10, seed=1):
  toks = jnp.asarray(np.random.default_rng(seed).integers(0, spec.vocab_size, (b, t)))
  return toks, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _run(params, spec, method, mspec, toks, pos, mode):
  """Logits of a prefill (one forward) or decode (token by token) evaluation."""
  b, t = toks.shape
  caches = init_caches(method, mspec, spec, params, batch=b, capacity=t + 2,
                       dtype=jnp.float32)
  if mode == "prefill":
    return _fwd(params, toks, pos, caches, spec)[0]
  outs = []
  for i in range(t):
    o, caches = _fwd(params, toks[:, i:i + 1], pos[:, i:i + 1], caches, spec)
    outs.append(o)
  return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("n,k,gran", [(8, 8, "g"), (6, 2, "m"), (8, 1, "j")])
def test_full_rank_reproduces_dense_logits(n, k, gran):
  """GQA ratios 1, 3, 8 (4: the ragged test): full rank, no quantization == dense."""
  spec = _spec(n, k)
  params, calib = _model(spec)
  pspec = _pspec(granularity=gran, target_ratio=0.0)
  cparams, layout = palu.compress(params, spec, pspec, calib)
  assert layout.compression_ratio() == 0.0
  toks, pos = _tokens(spec)
  ref = _fwd(params, toks, pos, None, spec)[0]
  for mode in ("prefill", "decode"):
    got = _run(cparams, spec, "palu", pspec, toks, pos, mode)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
  if n == 8 and k == 8:
    # negative control: a truncated factorisation must NOT pass the same tolerance
    lossy, _ = palu.compress(params, spec, pspec.replace(target_ratio=0.5), calib)
    got = _run(lossy, spec, "palu", pspec, toks, pos, "prefill")
    assert float(jnp.max(jnp.abs(got - ref))) > 10 * TOL


def test_gqa_ratio_4_ragged_batch_matches_dense_cache():
  """Ragged rows (right padding −1), prefill then decode; oracle = DenseCache."""
  spec = _spec(8, 2)
  params, calib = _model(spec)
  pspec = _pspec(target_ratio=0.0)
  cparams, _ = palu.compress(params, spec, pspec, calib)
  toks, pos = _tokens(spec, b=3, t=9, seed=3)
  lens = np.array([9, 5, 7])
  pos = jnp.where(jnp.arange(9)[None] < lens[:, None], pos, -1)
  outs = {}
  for method, p, ms in (("palu", cparams, pspec), ("dense", params, None)):
    caches = init_caches(method, ms, spec, p, batch=3, capacity=16, dtype=jnp.float32)
    lo, caches = _fwd(p, toks, pos, caches, spec)
    steps = []
    for i in range(3):   # decode 3 tokens, each row at its own position
      tok = toks[:, i:i + 1]
      step_pos = jnp.asarray(lens + i, jnp.int32)[:, None]
      o, caches = _fwd(p, tok, step_pos, caches, spec)
      steps.append(o)
    outs[method] = (lo, jnp.concatenate(steps, 1), caches[0].lengths)
  valid = np.asarray(pos) >= 0
  np.testing.assert_allclose(np.asarray(outs["palu"][0])[valid],
                             np.asarray(outs["dense"][0])[valid], atol=TOL, rtol=0)
  np.testing.assert_allclose(outs["palu"][1], outs["dense"][1], atol=TOL, rtol=0)
  np.testing.assert_array_equal(outs["palu"][2], lens + 3)


@functools.partial(jax.jit, static_argnames=("spec", "bits", "window"))
def _fill(lp, x, pos, spec, bits, window):
  b, s = pos.shape
  cache = LatentCache.init(spec, lp, batch=b, capacity=s, dtype=jnp.float32, bits=bits,
                           window=window)
  zeros = jnp.zeros((b, s, spec.n_kv_heads, spec.head_dim))
  # two updates (a prefill chunk then the rest) exercise the ring/append path
  for sl in (slice(0, 7), slice(7, s)):
    cache = cache.update(base.AttnInputs(x=x[:, sl], k=zeros[:, sl], k_pre=zeros[:, sl],
                                         v=zeros[:, sl], positions=pos[:, sl]), lp)
  return cache


@functools.partial(jax.jit, static_argnames=("spec",))
def _attend_and_reference(cache, lp, q, q_pos, spec):
  out, lse = cache.attend(q, q_pos, lp, spec=spec)
  k, v, valid = cache.materialize()
  k_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), valid.shape)
  ref, ref_lse = dot_product_attention(q, k, v, q_pos, k_pos, valid)
  return out, lse, ref, ref_lse


def _filled_cache(spec, cparams, pspec, lens, seed=0):
  """A layer-0 LatentCache filled with random inputs at ragged lengths."""
  b, s = len(lens), 12
  rng = np.random.default_rng(seed)
  lp = cparams["layers"][0]
  x = jnp.asarray(rng.standard_normal((b, s, spec.dim)), jnp.float32)
  pos = jnp.where(jnp.arange(s)[None] < np.asarray(lens)[:, None], jnp.arange(s)[None], -1)
  cache = _fill(lp, x, pos, spec, pspec.bits, pspec.window)
  q = jnp.asarray(rng.standard_normal((b, 3, spec.n_heads, spec.head_dim)), jnp.float32)
  q_pos = jnp.asarray(np.asarray(lens)[:, None] - 3 + np.arange(3)[None], jnp.int32)
  return cache, lp, q, q_pos


@pytest.mark.parametrize("rope", ["half", "none"])
@pytest.mark.parametrize("bits,window,fold", [(None, 0, "auto"), (None, 0, "always"),
                                              (2, 0, "auto"), (3, 4, "always")])
def test_attend_equals_dense_attention_over_materialized(rope, bits, window, fold):
  """attend (latent scores; B_v folded into W_o or applied per head) == dot_product_attention
  over materialize()."""
  spec = _spec(8, 4, rope=rope)
  params, calib = _model(spec)
  pspec = _pspec(target_ratio=0.5, bits=bits, window=window, value_fold=fold)
  cparams, layout = palu.compress(params, spec, pspec, calib)
  assert layout.ranks_v[0] > spec.head_dim   # r_v 32 > H 16: "auto" keeps W_o
  cache, lp, q, q_pos = _filled_cache(spec, cparams, pspec, lens=[12, 7])
  out, lse, ref, ref_lse = _attend_and_reference(cache, lp, q, q_pos, spec)
  np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)
  width = layout.ranks_v[0] if fold == "always" else spec.head_dim
  assert out.shape[-1] == width and lp["wo"].shape[0] == spec.n_heads * width
  # value path: output @ W_o (folded or kept, + folded b_v) == dense output @ W_o
  dense_o = ref.reshape(2, 3, -1) @ params["layers"][0]["wo"]
  lat_o = out.reshape(2, 3, -1) @ lp["wo"] + lp["bo"]
  np.testing.assert_allclose(lat_o, dense_o, atol=TOL, rtol=0)
  # negative control: corrupting the key reconstruction changes the scores
  bad = dataclasses.replace(cache, bk=cache.bk * 1.5)
  _, bad_lse, _, _ = _attend_and_reference(bad, lp, q, q_pos, spec)
  assert float(jnp.max(jnp.abs(bad_lse - ref_lse))) > 10 * TOL


def test_value_fold_auto_equals_always():
  """Keeping W_o and applying B_v per head (value_fold "auto" at r_v > H) gives the logits
  of the paper's fold into W_o, in prefill and decode; negative control: B_v of the wrong
  heads (the group's columns rotated by one head) changes them."""
  spec = _spec(8, 4)
  params, calib = _model(spec)
  toks, pos = _tokens(spec)
  logits = {}
  for fold in ("auto", "always"):
    pspec = _pspec(target_ratio=0.5, value_fold=fold)
    cparams, layout = palu.compress(params, spec, pspec, calib)
    logits[fold] = [_run(cparams, spec, "palu", pspec, toks, pos, mode)
                    for mode in ("prefill", "decode")]
  assert min(layout.ranks_v) > spec.head_dim
  for a, b in zip(logits["auto"], logits["always"]):
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
  pspec = _pspec(target_ratio=0.5)
  cparams, _ = palu.compress(params, spec, pspec, calib)
  rolled = [dict(lp, palu_bv=jnp.roll(lp["palu_bv"], spec.head_dim, axis=-1))
            for lp in cparams["layers"]]
  bad = _run(dict(cparams, layers=rolled), spec, "palu", pspec, toks, pos, "prefill")
  assert float(jnp.max(jnp.abs(bad - logits["always"][0]))) > 10 * TOL


def test_quantized_latents_and_window():
  """Quantization is per token per group latent; window positions are read exactly."""
  spec = _spec(8, 4, rope="half")
  params, calib = _model(spec)
  pspec = _pspec(target_ratio=0.5, bits=3, window=4)
  cparams, _ = palu.compress(params, spec, pspec, calib)
  cache, lp, _, _ = _filled_cache(spec, cparams, pspec, lens=[12, 7], seed=5)
  fp_spec = pspec.replace(bits=None, window=0)
  ref_cache, _, _, _ = _filled_cache(spec, cparams, fp_spec, lens=[12, 7], seed=5)
  hk, _ = cache.latents()
  hk_fp, _ = ref_cache.latents()
  lens = np.array([12, 7])
  for b in range(2):
    recent = slice(lens[b] - 4, lens[b])
    old = slice(0, lens[b] - 4)
    np.testing.assert_allclose(hk[b, recent], hk_fp[b, recent], atol=1e-6)
    want = quant.fake_quant(hk_fp[b, old], bits=3, axis=-1, scale_dtype=SCALE_DTYPE)
    np.testing.assert_allclose(hk[b, old], want, atol=1e-6)
    assert float(jnp.max(jnp.abs(hk[b, old] - hk_fp[b, old]))) > 1e-3   # really quantized


def test_hadamard_fold_leaves_unquantized_outputs_unchanged():
  spec = _spec(8, 4)
  params, calib = _model(spec)
  toks, pos = _tokens(spec)
  base_spec = _pspec(target_ratio=0.5)
  logits = {}
  for had in (False, True):
    cp, _ = palu.compress(params, spec, base_spec.replace(hadamard=had), calib)
    logits[had] = _run(cp, spec, "palu", base_spec, toks, pos, "prefill")
    if had:
      a_had = cp["layers"][0]["palu_ak"]
    else:
      a_plain = cp["layers"][0]["palu_ak"]
  np.testing.assert_allclose(logits[True], logits[False], atol=TOL, rtol=0)
  assert not np.allclose(a_had, a_plain, atol=1e-3)           # the latent is rotated
  # at 2 bits the rotation changes the result (it is what quantization sees)
  q2 = {}
  for had in (False, True):
    ps = base_spec.replace(hadamard=had, bits=2)
    cp, _ = palu.compress(params, spec, ps, calib)
    q2[had] = _run(cp, spec, "palu", ps, toks, pos, "prefill")
  assert float(jnp.max(jnp.abs(q2[True] - q2[False]))) > 10 * TOL


def test_nbytes_exact():
  spec = _spec(8, 4)
  params, calib = _model(spec)
  pspec = _pspec(target_ratio=0.5, granularity="g", group_size=2)
  cparams, layout = palu.compress(params, spec, pspec, calib)
  g = layout.n_groups
  rk, rv = layout.ranks_k[0], layout.ranks_v[0]
  b, s = 2, 64                 # the cache allocates whole 64-slot tiles (CAPACITY_MULTIPLE)
  fp = init_caches("palu", pspec, spec, cparams, batch=b, capacity=s - 5,
                   dtype=jnp.bfloat16)[0]
  assert fp.nbytes() == b * s * g * (rk + rv) * 2 + 4 * b
  assert fp.bytes_per_token() == g * (rk + rv) * 2
  q = init_caches("palu", pspec.replace(bits=3, window=4), spec, cparams, batch=b,
                  capacity=s, dtype=jnp.bfloat16)[0]
  per = sum(quant.quantized_nbytes((b, s, g, r), bits=3, axis=-1, group_size=r,
                                   scale_dtype=SCALE_DTYPE) for r in (rk, rv))
  assert q.nbytes() == per + b * 4 * g * (rk + rv) * 2 + 4 * b
  # 3-bit codes of r channels: ceil(r/32)*3 words + fp16 scale and zero per group latent
  words = lambda r: -(-r // 32) * 3
  assert q.bytes_per_token() == g * (4 * (words(rk) + words(rv)) + 2 * 2 * 2)


def test_clear_errors():
  spec = _spec(8, 4)
  params, calib = _model(spec)
  with pytest.raises(ValueError, match="group_size .3. must divide"):
    palu.compress(params, spec, _pspec(group_size=3), calib)
  with pytest.raises(ValueError, match="not Palu-compressed"):
    init_caches("palu", palu.PaluSpec(), spec, params, batch=1, capacity=4)
  cparams, _ = palu.compress(params, spec, _pspec(), calib)
  with pytest.raises(ValueError, match="bits must be one of"):
    LatentCache.init(spec, cparams["layers"][0], batch=1, capacity=4, bits=5)
  with pytest.raises(ValueError, match="already Palu-compressed"):
    palu.compress(cparams, spec, _pspec(), calib)
  with pytest.raises(ValueError, match="needs Fisher"):
    palu.compress(params, spec, _pspec(rank_search="fisher"), calib)
  with pytest.raises(ValueError, match="calibration tokens"):
    palu.calibrate(params, spec, np.zeros((4,), np.int32))
