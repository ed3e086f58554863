"""GPU: the decode kernels under `kvlowrank.parallel` (shard_map over a (data, model) mesh)
on 2 GPUs give one GPU's logits, and the sharded decode step runs the kernels.

tests/test_parallel.py checks the sharding on 4 simulated CPU devices (fp32, head dim 16),
where every cache runs its jnp reference; the kernels (bf16, head dim 128) run under
shard_map only here. Skipped unless JAX sees at least 2 GPUs.

Model: a 2-layer Llama of head dim 128, GQA 8/4, random bf16 weights
(`bench.decode.random_params`; LM head x 20 for sharp next-token distributions), Palu's
factors of the compressed shapes in groups of 2 KV heads (one group per device of a model
axis of 2) and FDC's ragged widths balanced for 2 devices (`rotated.balance`), the same
params on one device and on both meshes. Methods: dense, KIVI-2 (warp layout: the Mosaic
kernel), KIVI-4 (Triton, planar), Palu-50% (bf16 latents), FDC-50% (bf16 K'/V'; quantized
rotated caches split over the data axis only) and GEAR-L-2. For each method and mesh (1x2:
KV heads, MLP and vocabulary split; 2x1: batch rows split): a 96-token prefill (batch 2,
row 1 five tokens shorter, right-padded) and STEPS decode steps with `parallel.forward`,
against the same steps on one device (`model.forward`), both with implementation None (the
kernels), fed the one-device run's greedy tokens.

Checks:
1. Dispatch: every attention call of the sharded decode step (T = 1), as traced under
   shard_map, runs one of the method's kernels, on the local shapes (B / data rows,
   N / model query heads: `parallel.local_spec`); so does the one-device step.
2. Logits, at each row's last prompt token and each decode step (where the kernels run):
   max |sharded - one device| <= TOL * max |one-device logits|. Derivation: each device
   runs the same kernel on the same heads as one device does. What differs, per layer:
   (a) the row-split products W_o and w_down, which one device sums in one fp32-accumulated
   matmul rounded to bf16 once, while the mesh rounds each device's partial product to
   bf16 and sums them with a psum; (b) a kernel's split-K count, chosen from the number of
   (row, head) programs (`splitk.choose_num_splits`), which a shard changes, so a head's
   output may round differently; on 2x1, (a) is gone but the GEMMs' and kernels' row counts
   still change. Each such rounding moves an element of the residual stream by one bf16
   ulp (2^-7 relative) where a rounding boundary lies between the two values; RMSNorm and
   the next projections carry a relative perturbation of the stream into the logits
   without gain beyond its own scale (as in tests/test_decode_path_gpu.py), and the logits
   are rounded to bf16 themselves (`lm_head`). Independent roundings add in quadrature:
   sqrt(3 L + 1) ulps of the logits' magnitude. A perturbed key or value entering a
   quantized cache may take the neighbouring code (2 simulated CPU devices, the jnp
   references: KIVI-2 and GEAR-L-2 differ by up to 1.8% of the logits' magnitude, about 2
   ulps, where dense differs by 0.8%, 1 ulp), hence a factor 4:
       TOL = 4 * 2^-7 * sqrt(3 L + 1)   (8.3% for L = 2).
   The prefill's own logits are not compared: the prefill (T > 1) runs the jnp reference on
   both sides, and its first positions attend to a handful of quantized tokens, where one
   code step is not diluted (KIVI-2 on CPU: 6% of the logits' scale at positions < 16).
   The greedy tokens then agree except at near ties: where the sharded argmax differs from
   the one-device token, the one-device margin between the two is <= 2x the measured
   difference (a consequence of the bound, stated as what generation sees).
3. Negative control: the dense model with its two devices' KV-head blocks swapped (the k
   and v projections rolled by one device's block), on 1x2, is outside the bound.
"""

import contextlib
import functools
from unittest import mock

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvlowrank import parallel  # noqa: E402
from kvlowrank.bench.decode import BenchMethod, random_params  # noqa: E402
from kvlowrank.cache import base, dispatch  # noqa: E402
from kvlowrank.cache.base import init_caches  # noqa: E402
from kvlowrank.methods import (DenseSpec, GearSpec, KiviSpec, PaluSpec,  # noqa: E402
                               RotatedSpec, rotated)
from kvlowrank.model.transformer import forward  # noqa: E402
from kvlowrank.spec import ModelSpec  # noqa: E402

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(vocab_size=512, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=128,
                 ffn_dim=1024, max_seq_len=256, eos_ids=())
B, PROMPT, SHORT, STEPS = 2, 96, 5, 8     # row 1's prompt is SHORT tokens shorter
MESHES = ((1, 2), (2, 1))                 # (data, model)
TOL = 4 * 2.0 ** -7 * np.sqrt(3 * SPEC.n_layers + 1)
HOPPER = dispatch.Platform(gpu=True, hopper=True)

# name: (cache, method spec, kernels a Hopper GPU runs for it)
METHODS = {
    "dense": ("dense", DenseSpec(), ("cudnn", "triton")),
    "kivi2-warp": ("kivi", KiviSpec(bits=2, residual=32, layout="warp"), ("mosaic",)),
    "kivi4": ("kivi", KiviSpec(bits=4, residual=32), ("triton",)),
    "palu50": ("palu", PaluSpec(), ("mosaic",)),
    "fdc50": ("fdc", RotatedSpec(), ("triton",)),
    # GEAR-L's default backbone is the warp layout: the Mosaic GEAR-L kernel on Hopper.
    "gearl2": ("gear", GearSpec(sparsity=0.0), ("mosaic",)),
}


@pytest.fixture(scope="module")
def gpus():
  if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
    pytest.skip(f"needs 2 GPUs; JAX sees {jax.devices()}")


@functools.lru_cache(maxsize=None)
def setup(name):
  """(cache name, method spec, params): the same params serve one device and both meshes."""
  cache, mspec, _ = METHODS[name]
  params = random_params(SPEC, jax.random.key(0), BenchMethod(name, cache, mspec),
                         palu_group=SPEC.n_kv_heads // 2)
  params["lm_head"] = params["lm_head"] * 20
  if cache == "fdc":
    params = rotated.balance(params, SPEC, 2)
  return cache, mspec, params


def prompt():
  """Tokens and positions [B, PROMPT] (row 1 right-padded: positions -1), lengths [B]."""
  toks = np.random.default_rng(0).integers(0, SPEC.vocab_size, (B, PROMPT)).astype(np.int32)
  lens = np.array([PROMPT, PROMPT - SHORT], np.int32)
  pos = np.where(np.arange(PROMPT) < lens[:, None], np.arange(PROMPT), -1).astype(np.int32)
  return toks, pos, lens


@contextlib.contextmanager
def record_dispatch():
  """Records each cache attention's decision as JAX traces it (`decode_implementation`):
  dicts of method, q shape, implementation, reason, and what a Hopper GPU would run."""
  calls, orig = [], base.KVCache.decode_implementation

  def wrapped(self, q_shape, implementation=None):
    impl = orig(self, q_shape, implementation)
    calls.append(dict(method=self.name, q_shape=tuple(q_shape), impl=impl,
                      reason=self.choose_implementation(q_shape, implementation)[1],
                      hopper=self.choose_implementation(q_shape, implementation, HOPPER)[0]))
    return impl

  with mock.patch.object(base.KVCache, "decode_implementation", wrapped):
    yield calls


def decode(params, cache, mspec, mesh=None, tokens=None):
  """Prefill, then STEPS decode steps (one device, or `mesh`), each compiled once: (logits
  [B, 1 + STEPS, V] fp32 at each row's last prompt token and after each step, the tokens
  fed [B, STEPS], the decode step's dispatch decisions). `tokens`: the decode tokens;
  None: greedy."""
  toks, pos, lens = prompt()
  caches = init_caches(cache, mspec, SPEC, params, batch=B, capacity=PROMPT + STEPS + 8,
                       dtype=jnp.bfloat16)
  if mesh is None:
    step = jax.jit(lambda p, t, ps, c: forward(p, t, ps, c, SPEC))
  else:
    params = parallel.shard_params(params, SPEC, mesh)
    caches = parallel.shard_caches(caches, mesh)
    step = jax.jit(lambda p, t, ps, c: parallel.forward(mesh, p, t, ps, c, SPEC))
  with record_dispatch() as calls:   # a fresh jit: traced here, under the recorder
    logits, caches = step(params, jnp.asarray(toks), jnp.asarray(pos), caches)
    out, fed = [np.asarray(logits, np.float64)[np.arange(B), lens - 1]], []
    for i in range(STEPS):
      fed.append(out[-1].argmax(-1) if tokens is None else tokens[:, i])
      logits, caches = step(params, jnp.asarray(fed[-1], jnp.int32)[:, None],
                            jnp.asarray(lens + i)[:, None], caches)
      out.append(np.asarray(logits, np.float64)[:, 0])
  return np.stack(out, 1), np.stack(fed, 1), [c for c in calls if c["q_shape"][1] == 1]


@functools.lru_cache(maxsize=None)
def reference(name):
  """`decode` of a method on one device (greedy)."""
  cache, mspec, params = setup(name)
  return decode(params, cache, mspec)


def compare(name, mesh):
  """One method on one mesh against one device: a dict of the measurements."""
  cache, mspec, params = setup(name)
  ref, tokens, _ = reference(name)
  got, _, calls = decode(params, cache, mspec, parallel.make_mesh(*mesh), tokens)
  diff, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
  # Greedy tokens: where the sharded argmax differs, the one-device margin between the two.
  want, have = ref.argmax(-1), got.argmax(-1)
  margins = [float(ref[b, t, want[b, t]] - ref[b, t, have[b, t]])
             for b, t in zip(*np.nonzero(want != have))]
  return dict(method=name, mesh=mesh, max_abs_diff=diff, scale=scale, bound=TOL * scale,
              margins=margins, decode_calls=calls)


def negative_control():
  """Dense with the two devices' KV-head blocks swapped, on 1x2, against the model on one
  device: (max |difference| of the logits, bound)."""
  cache, mspec, params = setup("dense")
  ref, tokens, _ = reference("dense")
  half = SPEC.kv_dim // 2
  bad = dict(params, layers=[dict(lp, wk=jnp.roll(lp["wk"], half, axis=1),
                                  wv=jnp.roll(lp["wv"], half, axis=1))
                             for lp in params["layers"]])
  got, _, _ = decode(bad, cache, mspec, parallel.make_mesh(1, 2), tokens)
  return float(np.abs(got - ref).max()), TOL * float(np.abs(ref).max())


@pytest.mark.parametrize("name", list(METHODS))
def test_sharded_kernels_match_one_device(gpus, name):
  kernels = METHODS[name][2]
  one = reference(name)[2]
  assert one and all(c["impl"] in kernels for c in one), one
  for mesh in MESHES:
    r = compare(name, mesh)
    assert r["max_abs_diff"] <= r["bound"], r
    assert all(m <= 2 * r["max_abs_diff"] for m in r["margins"]), r
    local = parallel.local_spec(SPEC, mesh[1])
    assert len(r["decode_calls"]) >= SPEC.n_layers, r     # each layer's attention, traced
    for c in r["decode_calls"]:
      assert c["impl"] in kernels, (mesh, c)
      assert c["q_shape"] == (B // mesh[0], 1, local.n_heads, SPEC.head_dim), (mesh, c)


def test_negative_control_swapped_kv_heads(gpus):
  diff, bound = negative_control()
  assert diff > bound, (diff, bound)
