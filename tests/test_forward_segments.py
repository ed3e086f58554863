"""kvlowrank.model.segments.forward_segments equals the call-by-call loop of `forward` over
the same segments (logits and cache states): the layer-major schedule for per-layer caches
(dense in bf16 through the scanned-layers and the unrolled path, KIVI, GEAR: its decode
calls defer a completed chunk's compression to the next decode call) and the
token-major one for a cross-layer cache (XQuant-CL, whose carry goes from layer i to
layer i+1 within each call). Negative control: KIVI under another schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import ModelSpec
from kvlowrank.methods import DenseSpec, GearSpec, KiviSpec, cache_methods, init_caches
from kvlowrank.model import forward
from kvlowrank.model.segments import forward_segments, homogeneous, segment_runs
from np_params import np_init_params

SPEC = ModelSpec(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=48, qkv_bias=True)
B, T = 2, 17
# Decode-mode shape: a 10-token prompt in chunks of 4, 4, 2, then 7 single tokens.
SEGMENTS = ((0, 4), (4, 8), (8, 10)) + tuple((s, s + 1) for s in range(10, T))
TOL = 2e-5  # fp32: same maths, matmuls over different row counts

_fwd = jax.jit(forward, static_argnames=("spec",))
_seg = jax.jit(forward_segments, static_argnames=("spec", "segments", "scan_layers"))


@pytest.fixture(scope="module")
def setup():
  params = np_init_params(SPEC, seed=0, scale=0.3)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, SPEC.vocab_size, (B, T)),
                       jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return params, tokens, pos


def _caches(params, method, mspec):
  # Dense in bf16 (the experiments' storage), the quantizing caches in fp32.
  dtype = jnp.bfloat16 if method == "dense" else jnp.float32
  return init_caches(method, mspec, SPEC, params, batch=B, capacity=24, dtype=dtype)


def _call_by_call(params, tokens, pos, caches, segments=SEGMENTS):
  outs = []
  for s, e in segments:
    logits, caches = _fwd(params, tokens[:, s:e], pos[:, s:e], caches, spec=SPEC)
    outs.append(logits)
  return np.asarray(jnp.concatenate(outs, axis=1)), caches


def _methods():
  out = [("dense", DenseSpec()), ("kivi", KiviSpec(bits=4, group_size=8, residual=8)),
         # chunks of 4: decode tokens at positions 11 and 15 complete one each
         ("gear", GearSpec(bits=2, group_size=4, buffer=4, sparsity=20.0, rank_prefill=2,
                           rank_chunk=1))]
  if "xquant_cl" in cache_methods():
    from kvlowrank.methods.xquant.cl import XQuantCLSpec  # pylint: disable=g-import-not-at-top
    out.append(("xquant_cl", XQuantCLSpec(bits=4, group_size=16, base_layer=0)))
  return out


@pytest.mark.parametrize("method,mspec", _methods(), ids=lambda m: getattr(m, "__name__", None))
def test_segments_equal_call_by_call(setup, method, mspec):
  params, tokens, pos = setup
  want, want_caches = _call_by_call(params, tokens, pos, _caches(params, method, mspec))
  # Per-layer caches: the scanned-layers path (and for dense, also the unrolled one that
  # heterogeneous stacks take); XQuant-CL: the token-major path.
  assert homogeneous(params["layers"], _caches(params, method, mspec)) == (
      method != "xquant_cl")
  for scan in ((True, False) if method == "dense" else (True,)):
    got, caches = _seg(params, tokens, pos, _caches(params, method, mspec), spec=SPEC,
                       segments=SEGMENTS, scan_layers=scan)
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=0)
    assert len(caches) == SPEC.n_layers
    for c, w in zip(caches, want_caches):
      np.testing.assert_array_equal(np.asarray(c.lengths), np.asarray(w.lengths))
      if method == "dense":  # bf16 storage: equal up to one bf16 rounding step
        assert c.k.dtype == jnp.bfloat16
        for a, b in ((c.k, w.k), (c.v, w.v)):
          np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                     rtol=2 ** -7, atol=1e-6)
  # Negative control: one prefill call instead of the schedule changes what a
  # quantizing cache shows each query (KIVI flushes at 8, 16); for the exact cache the
  # two schedules agree.
  one, _ = _seg(params, tokens, pos, _caches(params, method, mspec), spec=SPEC,
                segments=((0, T),), scan_layers=True)
  gap = np.abs(np.asarray(one) - want).max()
  if method == "dense":
    assert gap < TOL
  elif method in ("kivi", "gear"):
    assert gap > 1e-2, gap


def test_segment_runs_and_errors(setup):
  assert segment_runs(SEGMENTS, T) == ((0, 4, 2), (8, 2, 1), (10, 1, 7))
  assert segment_runs(((0, 5),), 5) == ((0, 5, 1),)
  for bad, n in [(((0, 2), (3, 4)), 4), (((0, 2), (2, 2)), 2), (((0, 2),), 3),
                 (((1, 2),), 2)]:
    with pytest.raises(ValueError, match="segments"):
      segment_runs(bad, n)
  params, tokens, pos = setup
  with pytest.raises(ValueError, match="needs caches"):
    forward_segments(params, tokens, pos, None, SPEC, ((0, T),))
  # Heterogeneous stacks are detected (a layer with another cache capacity).
  caches = _caches(params, "dense", DenseSpec())
  other = init_caches("dense", DenseSpec(), SPEC, params, batch=B, capacity=100,
                      dtype=jnp.bfloat16)
  assert homogeneous(params["layers"], caches)
  assert not homogeneous(params["layers"], caches[:1] + other[1:])
  assert not homogeneous(params["layers"][:1] + [dict(params["layers"][1], extra=pos)],
                         caches)
