"""KIVI cache vs a float64 numpy transcription of KIVI's streaming algorithm."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.methods import KiviCache, KiviSpec, init_caches
from kvlowrank.cache.base import AttnInputs
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.model.params import init_params
from kvlowrank.model.transformer import forward
from kvlowrank_kernels.quant import packing
from kvlowrank.spec import ModelSpec

SPEC = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 ffn_dim=64, max_seq_len=128)
NP_SD = {"float16": np.float16, "float32": np.float32}


def ref_quant(x, bits, axis, group, sd):
  """float64 min/max quantize-dequantize; returns (x_hat, step, near_tie, magnitude)."""
  x = np.moveaxis(x, axis, -1)
  xg = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
  qmax = 2 ** bits - 1
  s = ((mx - mn) / qmax).astype(NP_SD[sd]).astype(np.float64)
  z = mn.astype(NP_SD[sd]).astype(np.float64)
  u = (xg - z) / np.where(s > 0, s, 1.0)
  code = np.where(s > 0, np.clip(np.round(u), 0, qmax), 0)
  tie = (np.abs(u - np.floor(u) - 0.5) < 1e-3) & (s > 0)
  out = [code * s + z, np.broadcast_to(s, xg.shape), tie, np.abs(z) + code * s]
  return [np.moveaxis(a.reshape(x.shape), -1, axis) for a in out]


class KiviRef:
  """One sequence, transcribed from jy-yuan/KIVI models/llama_kivi.py (prefill + decode).

  Each tensor is kept as (values, step, tie, magnitude) rows of [n, K, H]; exact rows
  have step 0. F = residual (or G when residual = 0, our extension).
  """

  def __init__(self, ks: KiviSpec):
    self.ks, self.f, self.r = ks, ks.flush_block, ks.residual
    self.k_quant, self.v_quant = [], []

  def _qk(self, k):  # per-channel, groups of G tokens
    return ref_quant(k, self.ks.bits, 0, self.ks.group_size, self.ks.scale_dtype)

  def _qv(self, v):  # per-token, groups of G channels
    return ref_quant(v, self.ks.value_bits, -1, self.ks.group_size, self.ks.scale_dtype)

  def prefill(self, k, v):
    t = len(k)
    nk = (t // self.f) * self.f          # KIVI: quantize floor(T/R)*R keys, keep T mod R
    if nk:
      self.k_quant.append(self._qk(k[:nk]))
    self.k_full = k[nk:]
    nv = max(0, t - self.r)              # KIVI: keep the last R values exact
    if nv:
      self.v_quant.append(self._qv(v[:nv]))
    self.v_full = v[nv:]

  def decode(self, k1, v1):
    self.k_full = np.concatenate([self.k_full, k1])
    self.v_full = np.concatenate([self.v_full, v1])
    if len(self.v_full) > self.r:        # oldest value leaves the window
      self.v_quant.append(self._qv(self.v_full[:1]))
      self.v_full = self.v_full[1:]
    if len(self.k_full) == self.f:       # key buffer full: quantize the whole block
      self.k_quant.append(self._qk(self.k_full))
      self.k_full = self.k_full[:0]

  @staticmethod
  def _view(quant, full):
    z = np.zeros_like(full)
    parts = quant + [[full, z, z.astype(bool), np.abs(full)]]
    return [np.concatenate([p[i] for p in parts]) for i in range(4)]

  def view(self):
    return self._view(self.k_quant, self.k_full), self._view(self.v_quant, self.v_full)


def assert_view(ours, ref):
  val, step, tie, mag = ref
  diff = np.abs(np.asarray(ours, np.float64) - val)
  ok = diff <= 1e-6 + 4e-7 * mag
  assert np.all(ok | tie), f"max mismatch {diff[~tie].max():.3g}"
  assert np.all(diff[tie] <= step[tie] + 1e-5)
  assert tie.mean() < 0.05


def check_against_refs(cache, refs):
  k, v, valid = (np.asarray(a) for a in cache.materialize())
  for b, ref in enumerate(refs):
    (rk, rv), n = ref.view(), len(ref.view()[0][0])
    assert int(cache.lens[b]) == n and valid[b].sum() == n and valid[b, :n].all()
    assert_view(k[b, :n], rk)
    assert_view(v[b, :n], rv)


def ref_attention(q, k, v, q_pos):
  """float64 causal GQA attention over one sequence's dense view."""
  n, kh = q.shape[1], k.shape[1]
  kk, vv = np.repeat(k, n // kh, axis=1), np.repeat(v, n // kh, axis=1)
  s = np.einsum("tnh,snh->nts", q, kk) / np.sqrt(q.shape[-1])
  s = np.where(np.arange(len(k))[None, None, :] <= q_pos[None, :, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), vv)


@jax.jit
def _update(cache, k, v, pos):
  return cache.update(AttnInputs(x=None, k=k, k_pre=k, v=v, positions=pos), {})


@jax.jit
def _attend_both(cache, q, pos):
  out, lse = cache.attend(q, pos, {}, spec=SPEC, implementation="reference")
  k, v, valid = cache.materialize()
  s_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), valid.shape)
  dense, dlse = dot_product_attention(q, k, v, pos, s_pos, valid, out_dtype=jnp.float32)
  return out, lse, dense, dlse


def run_stream(ks, prefill_lens, n_decode, seed, drop=None, spec=SPEC, capacity=64):
  """Ragged prefill then decode steps on random K/V; checks the cache against KiviRef
  after every step. drop=(step, row) replaces that decode token by padding in the
  cache only and checks only at the end, when the lengths agree again (negative control)."""
  rng = np.random.default_rng(seed)
  bsz, kh, h = len(prefill_lens), spec.n_kv_heads, spec.head_dim
  t0 = max(prefill_lens)
  cache = KiviCache.init(ks, spec, batch=bsz, capacity=capacity, dtype=jnp.float32)
  mk = lambda t: rng.standard_normal((bsz, t, kh, h)).astype(np.float32) * \
      np.linspace(1.0, 8.0, h, dtype=np.float32)  # channel-dependent ranges (key outliers)
  k, v = mk(t0), mk(t0)
  pos = np.where(np.arange(t0)[None] < np.array(prefill_lens)[:, None], np.arange(t0), -1)
  refs = [KiviRef(ks) for _ in prefill_lens]
  for b, n in enumerate(prefill_lens):
    refs[b].prefill(k[b, :n].astype(np.float64), v[b, :n].astype(np.float64))
  cache = _update(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos, jnp.int32))
  check_against_refs(cache, refs)
  # Prefill attention (causal, several queries) vs float64 attention over KivRef's view.
  q = rng.standard_normal((bsz, t0, spec.n_heads, h)).astype(np.float32)
  out, _, dense, _ = _attend_both(cache, jnp.asarray(q), jnp.asarray(pos, jnp.int32))
  for b, n in enumerate(prefill_lens):
    (rk, rv) = refs[b].view()
    np.testing.assert_allclose(np.asarray(out)[b, :n], ref_attention(
        q[b, :n].astype(np.float64), rk[0], rv[0], np.arange(n)), atol=2e-4)
  lens = np.array(prefill_lens)
  for step in range(n_decode):
    k1, v1 = mk(1), mk(1)
    active = np.ones(bsz, bool)
    active[-1] = step % 5 != 3            # the last row idles on some steps (padding)
    p = np.where(active, lens, -1)[:, None]
    for b in range(bsz):
      if active[b]:
        refs[b].decode(k1[b].astype(np.float64), v1[b].astype(np.float64))
    lens = lens + active
    if drop is not None and drop[0] == step:
      p[drop[1]] = -1                      # the cache never sees this token
    cache = _update(cache, jnp.asarray(k1), jnp.asarray(v1), jnp.asarray(p, jnp.int32))
    q1 = jnp.asarray(rng.standard_normal((bsz, 1, spec.n_heads, h)), jnp.float32)
    out, lse, dense, dlse = _attend_both(cache, q1, jnp.asarray(p, jnp.int32))
    live = np.asarray(p[:, 0] >= 0)
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(dense)[live], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(dlse)[live], atol=1e-5)
    if drop is None or step == n_decode - 1:
      check_against_refs(cache, refs)
  return cache


@pytest.mark.parametrize("ks,prefill_lens,n_decode", [
    # R=16, G=8: prefill lengths around the residual, decode crosses flushes at 32, 48.
    (KiviSpec(bits=2, group_size=8, residual=16), (21, 13), 30),
    # T a multiple of R (everything flushed at prefill), 4-bit, K/V bits differ, fp32 scales.
    (KiviSpec(bits=4, v_bits=3, group_size=8, residual=16, scale_dtype="float32"), (32, 7), 20),
    # R = 0 extension: values quantized at once, keys per completed group.
    (KiviSpec(bits=8, group_size=4, residual=0), (10, 3), 9),
])
def test_kivi_matches_reference_stream(ks, prefill_lens, n_decode):
  cache = run_stream(ks, prefill_lens, n_decode, seed=sum(prefill_lens))
  # The quantized store really holds packed codes, in the Triton kernel's planar rows.
  assert cache.layout == "planar"
  keys = cache.store.keys
  assert keys.codes.dtype == jnp.uint8
  assert keys.codes.shape[-1] == packing.packed_bytes(SPEC.head_dim, ks.bits,
                                                      packing.plane_width(SPEC.head_dim, ks.bits))


WARP_SPEC = SPEC.replace(head_dim=128)


@pytest.mark.parametrize("group", [32, 64])
def test_kivi_warp_layout_matches_reference_stream(group):
  """2-bit, G = 32 or 64, H = 128: the store is the Mosaic warp kernel's layout, written
  token by token (value codes by read-modify-write of shared words); same float64
  reference."""
  ks = KiviSpec(bits=2, group_size=group, residual=group, layout="warp")
  cache = run_stream(ks, (40, 17) if group == 32 else (150, 90), 30, seed=5, spec=WARP_SPEC,
                     capacity=128 * (group // 32))
  assert cache.layout == "warp" and cache.store.group == group
  assert np.abs(np.asarray(cache.dequantized()[1])).max() > 0, "nothing quantized"


@pytest.mark.parametrize("group", [32, 64])
def test_warp_and_planar_layouts_hold_the_same_cache(group):
  """The same stream through both layouts: bit-identical materialised K/V (the layouts
  are two orders of the same codes and scales); negative control: one flipped value-code
  word of the warp store changes the materialised values."""
  ks = KiviSpec(bits=2, group_size=group, residual=group, layout="warp")
  lens, cap = ((40, 17), 64) if group == 32 else ((150, 90), 256)
  warp = run_stream(ks, lens, 12, seed=9, spec=WARP_SPEC, capacity=cap)
  planar = run_stream(KiviSpec(bits=2, group_size=group, residual=group, layout="planar"),
                      lens, 12, seed=9, spec=WARP_SPEC, capacity=cap)
  assert np.abs(np.asarray(warp.dequantized()[1])).max() > 0, "nothing quantized"
  assert planar.layout == "planar"
  for a, b in zip(warp.materialize(), planar.materialize()):
    np.testing.assert_array_equal(np.asarray(a)[:, :64], np.asarray(b)[:, :64])
  st = warp.store
  bad = dataclasses.replace(warp, store=dataclasses.replace(
      st, vc=st.vc.at[0, 0, 0, 0, 5].set(st.vc[0, 0, 0, 0, 5] ^ 3)))
  assert not np.array_equal(np.asarray(bad.dequantized()[1]), np.asarray(warp.dequantized()[1]))
  for a, b in zip(warp.dequantized(), planar.dequantized()):
    np.testing.assert_array_equal(np.asarray(a)[:, :64], np.asarray(b)[:, :64])


def _eqns(jaxpr):
  """Every equation of a jaxpr, nested ones (jit, cond branches) included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


@pytest.mark.parametrize("layout,spec", [("planar", SPEC), ("warp", WARP_SPEC)])
def test_staged_key_flush(layout, spec):
  """A decode step quantizes only its token's key group (staged flush, `kivi.cache`): its
  traced update has no lax.cond and quantizes G tokens of keys, not the ring's F. The
  streams above check its codes against the float64 reference at every step. Negative
  control: with the staged keys wiped in the middle of a block, the ring's keys after the
  block completes are no longer the block's dequantized keys."""
  ks = KiviSpec(bits=2, group_size=8 if layout == "planar" else 32,
                residual=32 if layout == "planar" else 64, layout=layout)
  g, f = ks.group_size, ks.flush_block
  rng = np.random.default_rng(4)
  mk = lambda t: jnp.asarray(rng.standard_normal((2, t, spec.n_kv_heads, spec.head_dim)),
                             jnp.float32)
  c = KiviCache.init(ks, spec, batch=2, capacity=2 * f, dtype=jnp.float32)
  one = mk(1)
  jaxpr = jax.make_jaxpr(lambda c: c.update(
      AttnInputs(x=None, k=one, k_pre=one, v=one, positions=jnp.zeros((2, 1), jnp.int32)),
      {}))(c)
  assert "cond[" not in str(jaxpr)
  # The quantizers' minima reduce one key group (B·G·K·H elements) and one value per row,
  # never the ring's B·F·K·H keys (a flush of the whole block).
  sizes = [int(np.prod(e.invars[0].aval.shape)) for e in _eqns(jaxpr.jaxpr)
           if e.primitive.name == "reduce_min"]
  assert max(sizes) == 2 * g * spec.n_kv_heads * spec.head_dim, sizes
  # Prefill g + 3 tokens (one group complete and staged), decode to the end of the block.
  k, v = mk(g + 3), mk(g + 3)
  steps = [(mk(1), mk(1)) for _ in range(g + 3, f)]
  pos = jnp.broadcast_to(jnp.arange(g + 3, dtype=jnp.int32), (2, g + 3))
  c = _update(c, k, v, pos)
  out = {}
  for name, cache in (("staged", c),
                      ("wiped", dataclasses.replace(c, k_stage=jnp.zeros_like(c.k_stage)))):
    for t, (k1, v1) in zip(range(g + 3, f), steps):
      cache = _update(cache, k1, v1, jnp.full((2, 1), t, jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lens), [f, f])
    # Ring slot i holds position i: after the flush, the store's dequantized keys.
    out[name] = (np.asarray(cache.k_res), np.asarray(cache.dequantized()[0])[:, :f])
  np.testing.assert_allclose(*out["staged"], rtol=1e-6, atol=1e-6)
  assert np.max(np.abs(out["wiped"][0] - out["wiped"][1])) > 0.1


def test_negative_control_dropped_token_fails():
  ks = KiviSpec(bits=2, group_size=8, residual=16)  # same shapes as above: no recompile
  run_stream(ks, (21, 13), 6, seed=3)
  with pytest.raises(AssertionError):
    run_stream(ks, (21, 13), 6, seed=3, drop=(2, 0))


def test_nbytes_arithmetic_and_bytes_per_token():
  ks = KiviSpec(bits=2, group_size=32, residual=128, layout="warp")
  spec = SPEC.replace(head_dim=128, n_heads=8, n_kv_heads=2)
  b, cap, kh, h = 3, 1000, 2, 128
  c = KiviCache.init(ks, spec, batch=b, capacity=cap, dtype=jnp.bfloat16)
  s = 1024                                 # capacity rounded up to a multiple of G
  codes = 2 * b * s * kh * (h * 2 // 32) * 4
  k_sz = 2 * b * (s // 32) * kh * h * 2    # fp16 scale + zero per channel per 32 tokens
  v_sz = 2 * b * s * kh * (h // 32) * 2    # fp16 scale + zero per token per 32 channels
  resid = 2 * b * 128 * kh * h * 2         # bf16 exact K and V ring of R tokens
  stage = b * 128 * kh * h * 2             # bf16 staged keys of the block in progress
  assert c.capacity == s
  assert c.nbytes_breakdown() == {"codes": codes, "scales": (k_sz + v_sz) // 2,
                                  "zeros": (k_sz + v_sz) // 2, "residual": resid, "stage": stage,
                                  "lengths": 4 * b}
  assert c.nbytes() == codes + k_sz + v_sz + resid + stage + 4 * b
  # Per token and kv head: 2x32 B codes + 16 B K scales/zeros + 16 B V scales/zeros.
  assert c.bytes_per_token() == kh * (64 + 16 + 16)
  assert c.layout == "warp"
  c3 = KiviCache.init(KiviSpec(bits=3, group_size=32), spec, batch=1, capacity=64)
  assert c3.layout == "planar"
  assert c3.store.keys.codes.shape[-1] == 48   # 128 3-bit codes = 48 bytes


@pytest.mark.parametrize("kwargs,field", [
    (dict(bits=5), "KiviSpec.bits"), (dict(v_bits=1), "KiviSpec.v_bits"),
    (dict(residual=-32), "KiviSpec.residual"), (dict(residual=48), "KiviSpec.residual"),
    (dict(group_size=0), "KiviSpec.group_size"), (dict(scale_dtype="int8"), "scale_dtype"),
])
def test_bad_spec_errors(kwargs, field):
  with pytest.raises(ValueError, match=field):
    KiviSpec(**kwargs)


def test_group_must_divide_head_dim():
  with pytest.raises(ValueError, match="group_size"):
    init_caches("kivi", KiviSpec(group_size=32, residual=32), SPEC, None, batch=1, capacity=8)
  with pytest.raises(ValueError, match="KiviSpec"):
    init_caches("kivi", "2bit", SPEC, None, batch=1, capacity=8)


def test_end_to_end_forward_8bit_close_2bit_further():
  """Prefill 20 tokens then decode 12 with KIVI caches vs the uncached dense forward."""
  params = init_params(SPEC, jax.random.key(0), scale=0.15)
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, SPEC.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (2, 32))
  ref, _ = jax.jit(lambda t, p: forward(params, t, p, None, SPEC))(tokens, positions)
  step = jax.jit(lambda c, tok, p: forward(params, tok, p, c, SPEC))
  errs = {}
  for bits in (8, 2):
    caches = init_caches("kivi", KiviSpec(bits=bits, group_size=8, residual=8), SPEC, params,
                         batch=2, capacity=32, dtype=jnp.float32)
    logits, caches = step(caches, tokens[:, :20], positions[:, :20])
    outs = [logits]
    for i in range(20, 32):
      logits, caches = step(caches, tokens[:, i:i + 1], positions[:, i:i + 1])
      outs.append(logits)
    out = jnp.concatenate(outs, axis=1)
    errs[bits] = float(jnp.abs(out - ref).mean() / jnp.abs(ref).mean())
    agree = float(jnp.mean(out.argmax(-1) == ref.argmax(-1)))
    if bits == 8:
      assert agree >= 0.95, agree
  # Measured on this seed: 8-bit 0.4 % mean relative logit error, 2-bit 32 %.
  assert errs[8] < 0.01, errs
  assert errs[2] > 10 * errs[8], errs
