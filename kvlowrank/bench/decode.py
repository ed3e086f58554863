"""Whole-model decode benchmark: tokens/s of kvlowrank's own model through each cache.

One run, on the GPU it runs on, for one model shape (Llama-2-7B or Llama-3-8B, all layers,
random bf16 weights of the real shapes) and each (method, context, batch):
  * decode tokens/s: batch / the step time, a step being one `forward` with T = 1 on the
    donated caches. The steps run as `generate` runs them: `steps` greedy steps in one
    executable (a `fori_loop`; `generate` uses a `while_loop`), so no host dispatch sits
    between steps. Step time = the median of `LOOP_REPEATS` executions of that loop, after
    one warm-up, / `steps`. (One jitted step per host call instead adds the host's
    dispatch of every cache and weight array to each step, growing with the number of
    cache arrays: BENCHMARKS.md.)
  * with `profile`, the device time per step by kernel and category (`ops.op_times`, one
    traced execution of the loop);
  * the step split into attention and the rest: one layer's `cache.attend` for one query
    token, timed alone (chained calls in one executable, so no host dispatch is counted)
    times the layers, and the step minus that;
  * cache bytes on the device (the caches' arrays, less model weights a cache keeps beside
    its storage) and `caches_nbytes()`, which must agree;
  * device bytes in use after set-up (weights + caches) plus the step's XLA temporaries
    (compiled memory analysis) as the step's peak;
  * the largest batch that fits at this context: (device memory - weights - margin) /
    (measured cache bytes + temporaries per sequence).
Caches are filled with random codes / latents / values (and lengths = the context), not by
a prefill: a decode step's time does not depend on the values, and a 32K prefill per
configuration would cost minutes. `prefill` separately times one long prompt through the
chunked prefill path (the user's path: one `forward` over the prompt).

Methods (`METHODS`): dense (bf16), KIVI-2 / KIVI-4 (G = 32, R = 128, fp16 scales), Palu-50%
(G-LRD groups of 4 KV heads, key rank 25%, value rank 75% of a group's width: the paper's
latency configuration; bf16 latents and 4-bit latents), XQuant-2 (group 128; "x" path
for MHA, "latent" for GQA), XQuant-CL-2 (every layer a 2-bit delta layer from base layer 0,
group 128; no attention split: its layers attend only inside the cross-layer `step`),
GEAR-2 / GEAR-L-2 (2-bit KIVI backbone g = n_b = 64, s = 2 % / 0, r_p = 4, r_g = 2; GEAR-L-2
g=32: KIVI-2's backbone, g = 32, n_b = 64, in the warp layout on the Mosaic kernel; the
fill sets n_pchunks = the context, i.e. every compressed token uses the prefill factor, as
after a prefill of the context, and outlier indices < 64),
FDC-50% / ZACK-50% (the rotated cache; random rotations of ragged widths H/4, 3H/4, H/2,
H/2, ... per KV head, keys and values alike). Palu's (and FDC/ZACK's) factors are random
matrices of the compressed shapes (the step's work does not depend on their values).

On several GPUs (`mesh=(data, model)`, `kvlowrank.parallel`): the weights, the caches and
their random contents are created directly in their shards (a 70B model never sits on one
device), the step is `parallel.forward` (KV heads split over "model", rows over "data"),
bytes are per device (device 0's shards) and the largest batch is per mesh; the attention
split is not measured (None); Palu groups have min(4, K / model) KV heads (a group must not
straddle devices). XQuant's rows are kept whole on every device of the model axis
(`XCache.shard_axes`), so its fit check does not divide them. FDC/ZACK's random widths are
balanced for the model axis (`kvlowrank.methods.rotated.sharding.plan`: every device holds
the same slot widths, each round of `model` heads padded to its widest, so the bytes
include the padding `rotated.padding_fraction` reports).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding

from kvlowrank import parallel
from kvlowrank.bench import memory, ops
from kvlowrank.bench.inputs import rand
from kvlowrank.bench.timing import time_fn
from kvlowrank.cache.base import caches_nbytes, init_caches
from kvlowrank.methods import (DenseSpec, GearSpec, KiviSpec, PaluSpec, XQuantCLSpec,
                               XQuantSpec)
from kvlowrank.cache.base import KVCache
from kvlowrank.methods.palu.spec import default_group_size, folds_value
from kvlowrank.methods.rotated import RotatedSpec
from kvlowrank.methods.rotated import sharding as rotated_sharding
from kvlowrank.model import row_slices, xla_options
from kvlowrank.model.params import layer_shapes
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec, RopeScaling

# max_seq_len is raised to the longest benchmarked context: random weights, no trained range.
MODELS = {
    "llama2-7b": ModelSpec(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                           head_dim=128, ffn_dim=11008, norm_eps=1e-5, rope_theta=10000.0,
                           max_seq_len=131072 + 1024),
    "llama3-8b": ModelSpec(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           head_dim=128, ffn_dim=14336, norm_eps=1e-5, rope_theta=500000.0,
                           rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                           max_seq_len=131072 + 1024),
    "llama2-70b": ModelSpec(vocab_size=32000, dim=8192, n_layers=80, n_heads=64,
                            n_kv_heads=8, head_dim=128, ffn_dim=28672, norm_eps=1e-5,
                            rope_theta=10000.0, max_seq_len=131072 + 1024),
    "llama3-70b": ModelSpec(vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                            n_kv_heads=8, head_dim=128, ffn_dim=28672, norm_eps=1e-5,
                            rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                            max_seq_len=131072 + 1024),
}


@dataclasses.dataclass(frozen=True)
class BenchMethod:
  label: str
  cache: str
  spec: object
  palu_bits: Optional[int] = None


METHODS = {
    "dense": BenchMethod("dense", "dense", DenseSpec()),
    "kivi2": BenchMethod("KIVI-2", "kivi", KiviSpec(bits=2)),
    "kivi4": BenchMethod("KIVI-4", "kivi", KiviSpec(bits=4)),
    "palu50": BenchMethod("Palu-50%", "palu", PaluSpec()),
    "palu50-4bit": BenchMethod("Palu-50% 4-bit", "palu", PaluSpec(bits=4)),
    "xquant2": BenchMethod("XQuant-2", "xquant", XQuantSpec(bits=2)),
    "xquantcl2": BenchMethod("XQuant-CL-2", "xquant_cl", XQuantCLSpec(bits=2)),
    "gear2": BenchMethod("GEAR-2", "gear", GearSpec()),
    "gearl2": BenchMethod("GEAR-L-2", "gear", GearSpec(sparsity=0.0)),
    # GEAR-L over KIVI-2's own backbone (g = 32): the warp layout and the Mosaic kernel.
    "gearl2-g32": BenchMethod("GEAR-L-2 g=32", "gear", GearSpec(sparsity=0.0, group_size=32)),
    # FDC / ZACK at 50%: the same rotated cache (the recipes differ offline only); ragged
    # random widths (`rotated_widths`) averaging H/2 for keys and values.
    "fdc50": BenchMethod("FDC-50%", "fdc", RotatedSpec()),
    "zack50": BenchMethod("ZACK-50%", "zack", RotatedSpec()),
    # ... with K' / V' quantized to 4 bits (KIVI-style, groups of 16), read as codes by the
    # ragged kernel's twin (`kvlowrank_kernels.rotated.triton_ragged_quant`).
    "zack50-4bit": BenchMethod("ZACK-50% 4-bit", "zack", RotatedSpec(bits=4)),
}
# Timed executions of the `steps`-step decode loop (after one warm-up): the median / steps.
LOOP_REPEATS = 3
PALU_GROUP = 4          # KV heads per G-LRD group (the paper's gs-4)


def _rand(key, shape, dtype=jnp.bfloat16, scale=1.0):
  """Uniform [-scale, scale) (`inputs.rand`, one fused kernel per input)."""
  x = rand(key, tuple(shape), jnp.dtype(dtype))
  return x if scale == 1.0 else x * jnp.asarray(scale, x.dtype)


def _random_layer(spec: ModelSpec, keys, method: BenchMethod, palu_group: int, tp: int):
  """One layer of `random_params`, drawing `_layer_keys` keys from the iterator `keys`."""
  std = 0.02 * math.sqrt(3)                    # uniform with std 0.02
  lp = {}
  for name, shape in layer_shapes(spec).items():
    lp[name] = (jnp.ones(shape, jnp.bfloat16) if name.endswith("norm")
                else _rand(next(keys), shape, scale=std))
  if method.cache == "palu":
    gs = default_group_size(spec.n_kv_heads, palu_group)
    g = spec.n_kv_heads // gs
    width = gs * spec.head_dim
    rk, rv = width // 4, 3 * width // 4
    lp.update(palu_ak=_rand(next(keys), (spec.dim, g * rk), scale=std),
              palu_av=_rand(next(keys), (spec.dim, g * rv), scale=std),
              palu_bk=_rand(next(keys), (g, rk, width), scale=rk ** -0.5),
              palu_bv=_rand(next(keys), (g, rv, width), scale=rv ** -0.5))
    if folds_value(method.spec, rv, spec):  # else W_o keeps its shape (PaluSpec.value_fold)
      lp["wo"] = _rand(next(keys), (spec.n_heads * rv, spec.dim), scale=std)
  if method.cache in ("fdc", "zack"):
    lp.update(_rotated_params(spec, keys, std, tp))
  return lp


def _params_kind(method: BenchMethod) -> str:
  """Methods of one kind run on the same `random_params` (for a given key); Palu's W_o
  depends on `PaluSpec.value_fold`."""
  if method.cache == "palu":
    return f"palu-{method.spec.value_fold}"
  return {"fdc": "rotated", "zack": "rotated"}.get(method.cache, "plain")


def _layer_keys(spec: ModelSpec, method: BenchMethod, palu_group: int, tp: int) -> int:
  """Keys one layer of `random_params` draws, counted on an abstract trace of
  `_random_layer` (nothing is computed)."""
  drawn = [0]

  def keys(key):
    while True:
      drawn[0] += 1
      yield key

  jax.eval_shape(lambda k: _random_layer(spec, keys(k), method, palu_group, tp),
                 jax.random.key(0))
  return drawn[0]


def _random_ends(spec: ModelSpec, keys):
  """The embedding, final norm and LM head of `random_params` (two keys)."""
  std = 0.02 * math.sqrt(3)
  return {"embed": _rand(next(keys), (spec.vocab_size, spec.dim), scale=std),
          "final_norm": jnp.ones((spec.dim,), jnp.bfloat16),
          "lm_head": _rand(next(keys), (spec.dim, spec.vocab_size), scale=std)}


def random_params(spec: ModelSpec, key, method: BenchMethod, palu_group: int = PALU_GROUP,
                  tp: int = 1):
  """Random bf16 parameters of the model's shapes (+ Palu factors of the compressed shapes,
  groups of `palu_group` KV heads at most; FDC/ZACK widths balanced for `tp` devices)."""
  keys = iter(jax.random.split(key, 16 * spec.n_layers + 4))
  layers = [_random_layer(spec, keys, method, palu_group, tp) for _ in range(spec.n_layers)]
  return dict(_random_ends(spec, keys), layers=layers)


def rotated_widths(spec: ModelSpec, tp: int = 1) -> tuple[int, ...]:
  """FDC/ZACK-50% widths per KV head: H/4, 3H/4, H/2, H/2, ... (multiples of 16, mean H/2
  for an even head count), so the ragged decode path sees unequal heads; for tp > 1 model
  devices, balanced (the slot widths of `rotated.sharding.plan`, repeated per device; the
  values are random, so which head sits in which slot does not matter)."""
  h = spec.head_dim
  pattern = (h // 4, 3 * h // 4, h // 2, h // 2)
  w = tuple(max(16, 16 * (pattern[i % 4] // 16)) for i in range(spec.n_kv_heads))
  return w if tp == 1 else rotated_sharding.plan(w, w, tp)[1] * tp


def _with_widths(params, widths):
  """`params` with FDC/ZACK's per-layer widths [(k, v)] as constants: the rotated cache reads
  its static widths from rot_kw / rot_vw, which a traced parameter pytree does not carry."""
  if widths is None:
    return params
  return dict(params, layers=[dict(lp, rot_kw=np.asarray(kw), rot_vw=np.asarray(vw))
                              for lp, (kw, vw) in zip(params["layers"], widths)])


def _widths_of(params):
  """The concrete per-layer (rot_kw, rot_vw) of FDC/ZACK params, None for other methods."""
  if "rot_kw" not in params["layers"][0]:
    return None
  return [(np.asarray(lp["rot_kw"]), np.asarray(lp["rot_vw"])) for lp in params["layers"]]


def _rotated_params(spec: ModelSpec, keys, std, tp: int = 1) -> dict:
  """Random FDC/ZACK entries of the compressed shapes (`methods.rotated.compression`), the
  widths balanced for `tp` model devices (`rotated_widths`)."""
  w = rotated_widths(spec, tp)
  kh, h = spec.n_kv_heads, spec.head_dim
  return dict(rot_rk=_rand(next(keys), (kh, h, max(w)), scale=h ** -0.5),
              rot_av=_rand(next(keys), (spec.dim, sum(w)), scale=std),
              rot_bv=_rand(next(keys), (kh, max(w), h), scale=h ** -0.5),
              rot_kw=jnp.asarray(w, jnp.int32), rot_vw=jnp.asarray(w, jnp.int32),
              wo=_rand(next(keys), (spec.n_heads * max(w), spec.dim), scale=std))


def _leaf_kind(name: str, dtype) -> str:
  if dtype == jnp.int32:
    return "length"
  if name.endswith("_idx"):
    return "key_index" if name.endswith("sk_idx") else "index"
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return "bits"
  if "scale" in name or name.endswith(("ks", "vs")):
    return "scale"
  return "float"


@functools.lru_cache(maxsize=None)
def _filler(kind: str, shape: tuple, dtype, sharding):
  """One compiled random fill per (kind, shape, dtype, sharding): the layers' leaves share
  it (a fresh jit per leaf compiled ~500 times for a 32-layer GEAR cache, ~2 minutes)."""
  def make(k, length):
    if kind == "length":
      return jnp.full(shape, length, jnp.int32)
    if kind in ("index", "key_index"):
      # GEAR outlier indices: a token within an n_b = 64 chunk (keys: slots on axis -2) or a
      # channel (< H; values: slots on axis -1), distinct per vector as the cache's selection
      # makes them (the kernels select, not add, where slots meet: `gear.operands`): a random
      # start per vector, then consecutive.
      axis = len(shape) - (2 if kind == "key_index" else 1)
      start = jax.random.bits(k, shape[:axis] + (1,) + shape[axis + 1:], dtype) % jnp.asarray(
          64, dtype)
      slot = jax.lax.broadcasted_iota(dtype, shape, axis)
      return (start + slot) % jnp.asarray(64, dtype)
    if kind == "bits":
      return jax.random.bits(k, shape, dtype)
    if kind == "scale":
      return jnp.abs(_rand(k, shape, dtype, 0.49)) + jnp.asarray(0.01, dtype)
    return _rand(k, shape, dtype, 1.0)
  return jax.jit(make, out_shardings=sharding)


def fill_caches(caches, key, length: int):
  """Random contents: codes random bits, floats in [-1, 1) (scales in [0.01, 0.5)),
  every int32 leaf (the lengths) = `length`. Each zero buffer is freed as soon as its
  random replacement exists, so filling needs one leaf of extra memory, not a second cache."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(caches)
  del caches
  keys = jax.random.split(key, len(leaves))
  out = []
  for (path, x), k in zip(leaves, keys):
    kind = _leaf_kind(jax.tree_util.keystr(path).lower(), x.dtype)
    new = _filler(kind, tuple(x.shape), x.dtype, x.sharding)(k, length)  # in x's shards
    jax.block_until_ready(new)
    x.delete()
    out.append(new)
  leaves.clear()
  return jax.tree_util.tree_unflatten(treedef, out)


def array_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def device_bytes(tree, device=None) -> int:
  """Bytes of `tree`'s shards on one device (default: the first device holding any)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shards = getattr(x, "addressable_shards", None)
    if not shards:
      total += x.size * x.dtype.itemsize
      continue
    device = shards[0].device if device is None else device
    total += sum(s.data.size * s.data.dtype.itemsize for s in shards if s.device == device)
  return int(total)


def device_storage_bytes(caches) -> int:
  """One device's bytes of the caches' storage: the arrays with a batch axis, not the model
  weights some caches keep beside it (`KVCache.shard_axes` gives weights no batch axis)."""
  storage = []
  for c, cs in zip(caches, parallel.cache_specs(caches)):
    specs = jax.tree.leaves(cs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    storage += [a for a, s in zip(jax.tree.leaves(c), specs) if parallel.DATA in tuple(s)]
  return device_bytes(storage)


def sharded_params(spec: ModelSpec, key, method: BenchMethod, mesh):
  """`random_params` (the same values) created directly in their shards on the mesh, one
  compiled program for all layers (one program for the whole model, unrolled over its layers,
  took far longer to compile: `results/decode_ablations.md`, "Several GPUs: the first run");
  Palu groups of at most K / model KV heads, so that no group straddles devices."""
  tp = mesh.shape[parallel.MODEL]
  group = min(PALU_GROUP, spec.n_kv_heads // tp)
  make = lambda k: random_params(spec, k, method, group, tp)
  specs = parallel.param_specs(jax.eval_shape(make, key), spec, tp)
  shard = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)
  keys = jax.random.split(key, 16 * spec.n_layers + 4)
  n = _layer_keys(spec, method, group, tp)
  layer = jax.jit(lambda ks: _random_layer(spec, iter(ks), method, group, tp),
                  out_shardings=shard(specs["layers"][0]))
  if any(ls != specs["layers"][0] for ls in specs["layers"]):
    raise AssertionError("sharded_params: the layers' shardings differ")
  layers = [layer(keys[i * n:(i + 1) * n]) for i in range(spec.n_layers)]
  ends = {k: v for k, v in specs.items() if k != "layers"}
  rest = jax.jit(lambda ks: _random_ends(spec, iter(ks)), out_shardings=shard(ends))
  return dict(rest(keys[spec.n_layers * n:spec.n_layers * n + 2]), layers=layers)


def sharded_caches(method: BenchMethod, spec: ModelSpec, params, *, batch: int,
                   capacity: int, mesh):
  """Empty caches created directly in their shards on the mesh."""
  widths = _widths_of(params)
  make = lambda p: init_caches(method.cache, method.spec, spec, _with_widths(p, widths),
                               batch=batch, capacity=capacity, dtype=jnp.bfloat16)
  specs = parallel.cache_specs(jax.eval_shape(make, params))
  out = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  return jax.jit(make, out_shardings=out)(params)


def _cache_weights(caches) -> int:
  return sum(c.weights_nbytes() if hasattr(c, "weights_nbytes") else 0 for c in caches)


def storage_bytes(caches) -> int:
  """Device bytes of the caches' arrays, less the model weights some caches keep beside
  their storage (Palu's B_k/B_v, XQuant's SVD factors: `weights_nbytes()`)."""
  return array_bytes(caches) - _cache_weights(caches)


def _median_time(fn, steps: int) -> float:
  """Median seconds of one call of fn() over `steps` calls, after warm-up (`time_fn`, one
  call per sample: a decode step is milliseconds, far above a dispatch)."""
  return time_fn(fn, samples=steps, max_calls=1).seconds


def _attend_seconds(cache, q, qpos, lp, spec: ModelSpec, chain_s: float = 20e-3) -> float:
  """Seconds per `cache.attend` call: n calls in one executable (a loop whose query depends
  on the previous output, so XLA can neither merge nor hoist them), n sized so one
  execution runs >= chain_s; median of 20 executions, divided by n."""

  @functools.partial(jax.jit, static_argnums=0)
  def chain(n, cache, q, lp):
    def body(_, carry):
      q, acc = carry
      out = cache.attend(q + (acc * 0).astype(q.dtype), qpos, lp, spec=spec)[0]
      return q, acc + out.reshape(-1)[0].astype(jnp.float32)
    return jax.lax.fori_loop(0, n, body, (q, jnp.zeros((), jnp.float32)))[1]

  one = _median_time(lambda: chain(1, cache, q, lp), 5)
  n = int(min(256, max(1, math.ceil(chain_s / one))))
  return _median_time(lambda: chain(n, cache, q, lp), 20) / n


def run_config(spec: ModelSpec, params, method: BenchMethod, context: int, batch: int, *,
               steps: int = 20, seed: int = 0, mesh=None, profile: bool = False,
               time_attention: bool = True) -> dict:
  """Times decode steps at `context` tokens for `batch` rows (module docstring); with
  `profile`, also the step's device time per kernel (`ops.op_times`, the 40 longest);
  `time_attention` False skips the attention split."""
  key = jax.random.key(seed)
  reps = LOOP_REPEATS + 1 + (1 if profile else 0)          # warm-up, timed, traced loops
  capacity = -(-(context + reps * steps + 8) // 256) * 256
  t_setup = time.perf_counter()
  if mesh is None:
    caches = init_caches(method.cache, method.spec, spec, params, batch=batch,
                         capacity=capacity, dtype=jnp.bfloat16)
  else:
    parallel.check_layout(spec, mesh, batch=batch)
    caches = sharded_caches(method, spec, params, batch=batch, capacity=capacity, mesh=mesh)
  caches = fill_caches(caches, key, context)
  setup_s = time.perf_counter() - t_setup
  local = spec if mesh is None else parallel.local_spec(spec, mesh.shape[parallel.MODEL])
  impl, reason = caches[0].choose_implementation((batch, 1, local.n_heads, spec.head_dim))
  nbytes = caches_nbytes(caches)
  on_device = storage_bytes(caches) if mesh is None else device_storage_bytes(caches)
  in_use = memory.bytes_in_use()

  if mesh is None:
    fwd = lambda p, tok, pos, c: forward(p, tok, pos, c, spec)
  else:
    fwd = lambda p, tok, pos, c: parallel.forward(mesh, p, tok, pos, c, spec)

  def loop(p, tok, pos, c):
    """`steps` greedy decode steps in one executable, as `generate`'s while_loop runs them."""
    def body(i, carry):
      tok, c = carry
      logits, c = fwd(p, tok, pos + i, c)
      return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], c
    return jax.lax.fori_loop(0, steps, body, (tok, c))

  tok = jnp.zeros((batch, 1), jnp.int32)
  t0 = time.perf_counter()
  compiled = jax.jit(loop, donate_argnums=3, compiler_options=xla_options.DECODE).lower(
      params, tok, jnp.full((batch, 1), context, jnp.int32), caches).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp = None if mem is None else int(mem.temp_size_in_bytes)
  state = {"caches": caches, "pos": context, "tok": tok}

  def run_loop():
    pos = jnp.full((batch, 1), state["pos"], jnp.int32)
    state["tok"], state["caches"] = compiled(params, state["tok"], pos, state["caches"])
    state["pos"] += steps
    return state["tok"]

  t_timed = time.perf_counter()
  jax.block_until_ready(run_loop())                                  # warm-up
  times = []
  for _ in range(LOOP_REPEATS):
    t0 = time.perf_counter()
    jax.block_until_ready(run_loop())
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times) / steps
  step_ops = None
  if profile:
    step_ops = ops.op_times(run_loop, calls=1, warm=False)
    step_ops = dict(step_ops, total_s=step_ops["total_s"] / steps,
                    stream_busy_s=step_ops["stream_busy_s"] / steps,
                    categories={k: v / steps for k, v in step_ops["categories"].items()},
                    ops=[dict(o, seconds=o["seconds"] / steps, launches=o["launches"] / steps)
                         for o in step_ops["ops"][:40]])

  timed_s = time.perf_counter() - t_timed

  # Attention alone: layer 0's attend for one query token on its cache (the call the step
  # makes in every layer; the layers' caches and shapes are alike), times the layers.
  caches = state["caches"]
  attn_s = attention_timing_s = None
  cross_layer = type(caches[0]).step is not KVCache.step    # XQuant-CL: no per-layer attend
  if mesh is None and time_attention and not cross_layer:
    q = _rand(jax.random.fold_in(key, 1), (batch, 1, spec.n_heads, spec.head_dim))
    qpos = jnp.full((batch, 1), context, jnp.int32)
    t_attn = time.perf_counter()
    attn_s = spec.n_layers * _attend_seconds(caches[0], q, qpos, params["layers"][0], spec)
    attention_timing_s = time.perf_counter() - t_attn
  return dict(method=method.label, context=context, batch=batch, capacity=capacity,
              implementation=impl,
              mesh=None if mesh is None else [mesh.shape[parallel.DATA],
                                              mesh.shape[parallel.MODEL]],
              dispatch_reason=reason, rows_per_pass=row_slices.rows_per_pass(caches),
              step_ms=1e3 * step_s,
              tokens_per_s=batch / step_s,
              attention_ms=None if attn_s is None else 1e3 * attn_s,
              rest_ms=None if attn_s is None else 1e3 * (step_s - attn_s),
              attention_share=None if attn_s is None else attn_s / step_s,
              cache_nbytes=nbytes, cache_device_bytes=on_device,
              device_bytes_in_use=in_use, step_temp_bytes=temp,
              peak_bytes_est=None if in_use is None or temp is None else in_use + temp,
              peak_bytes_process=memory.peak_bytes(), step_ops=step_ops,
              # Wall seconds of this record's phases (where a slow run spends its time).
              setup_s=setup_s, compile_s=compile_s, timed_s=timed_s,
              attention_timing_s=attention_timing_s)


def step_down(batch: int, tries: int) -> list[int]:
  """The batches `check_max_batch` tries, largest first: the estimate, one sequence fewer,
  then 97%, 90% and 75% of it (distinct, positive; `tries` at most). The finer steps
  settle an estimate that is one or two sequences high; the coarser ones one that misses
  by a few percent (a case: Palu-50% 4-bit's max-batch check in `results/decode_ablations.md`,
  "Where each row comes from")."""
  out = []
  for b in (batch, batch - 1, int(batch * 0.97), int(batch * 0.9), int(batch * 0.75)):
    if 0 < b and (not out or b < out[-1]):
      out.append(b)
  return ([batch] if batch <= 0 else out)[:max(1, tries)]


def check_max_batch(spec: ModelSpec, params, method: BenchMethod, context: int, batch: int,
                    *, mesh=None, tries: int = 5, run=None) -> dict:
  """Allocates, fills and runs `batch` rows at `context` (two decode steps): whether the
  estimated largest batch really fits (`max_batch` is arithmetic on measured sizes). When it
  does not, steps down (`step_down`: at most `tries` batches in all) and reports the largest
  that ran (`largest_run`; None if none did). `run`: run_config (tests)."""
  run = run_config if run is None else run
  failed, ran = [], None
  for b in step_down(batch, tries):
    try:
      rec = run(spec, params, method, context, b, steps=2, mesh=mesh, time_attention=False)
    except Exception as e:  # pylint: disable=broad-except  (OOM: the answer)
      failed.append(dict(batch=b, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
      continue
    ran = dict(batch=b, tokens_per_s=rec["tokens_per_s"],
               peak_bytes_process=rec["peak_bytes_process"])
    break
  out = dict(batch=batch, fits=ran is not None and ran["batch"] == batch,
             largest_run=None if ran is None else ran["batch"], failed=failed)
  if failed:
    out["error"] = failed[0]["error"]
  if ran is not None:
    out.update(tokens_per_s=ran["tokens_per_s"], peak_bytes_process=ran["peak_bytes_process"])
  return out


def max_batch(rec: dict, weight_bytes: int, limit: Optional[int],
              margin: int = 2 << 30, data: int = 1) -> Optional[int]:
  """Largest batch whose weights + caches + step temporaries fit in `limit` bytes
  (per-sequence costs from the measured record; `margin` left for the allocator). With
  `data` > 1 the record's bytes are one device's, holding batch / data rows; the result
  is the batch over the whole mesh. A cache that bounds the rows of one forward pass (the
  record's `rows_per_pass`, XQuant-CL's carry: `kvlowrank.model.row_slices`) holds one
  pass's temporaries whatever the batch: they count once, at the measured bytes per row
  of a pass times the rows of a pass."""
  if limit is None or rec.get("step_temp_bytes") is None:
    return None
  local = rec["batch"] // data
  temp, rows = rec["step_temp_bytes"], rec.get("rows_per_pass")
  if rows:
    fixed = temp / min(local, rows) * rows
    return data * max(0, int((limit - weight_bytes - margin - fixed)
                             // (rec["cache_device_bytes"] / local)))
  per_seq = (rec["cache_device_bytes"] + temp) / local
  return data * max(0, int((limit - weight_bytes - margin) // per_seq))


def bytes_per_token(spec: ModelSpec, params, method: BenchMethod, probe: int = 2048, *,
                    tp: int = 1) -> tuple[float, int]:
  """(cache storage bytes per token and sequence, bytes of the model weights the caches
  keep: `weights_nbytes()`, e.g. XQuant's SVD factors), from a real batch-1 cache of `probe`
  slots (with tp > 1: one device's shard, `spec` being the global spec; storage = the leaves
  with a batch axis, as `device_storage_bytes` counts them; abstract, nothing allocated)."""
  if tp == 1:
    caches = init_caches(method.cache, method.spec, spec, params, batch=1, capacity=probe,
                         dtype=jnp.bfloat16)
    return storage_bytes(caches) / probe, _cache_weights(caches)
  group = min(PALU_GROUP, spec.n_kv_heads // tp)
  widths = None
  if method.cache in ("fdc", "zack"):
    widths = [(rotated_widths(spec, tp),) * 2] * spec.n_layers
  abstract = jax.eval_shape(lambda k: init_caches(
      method.cache, method.spec, spec,
      _with_widths(random_params(spec, k, method, group, tp), widths), batch=1,
      capacity=probe, dtype=jnp.bfloat16), jax.random.key(0))
  storage = kept = 0
  for c, cs in zip(abstract, parallel.cache_specs(abstract)):
    for leaf, s in zip(jax.tree.leaves(c), jax.tree.leaves(
        cs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
      n = leaf.size * leaf.dtype.itemsize // (tp if parallel.MODEL in tuple(s) else 1)
      if parallel.DATA in tuple(s):
        storage += n
      else:
        kept += n
  return storage / probe, kept


def fits(per_token: float, context: int, batch: int, weight_bytes: int,
         limit: Optional[int], margin: int = 4 << 30) -> bool:
  """Whether the caches (allocated size, no temporaries) plausibly fit next to the
  weights, `margin` left for the step's temporaries and the allocator. 4 GiB, not more: the
  targets' batch where it is dense's largest (dense Llama-2-7B at 32K, whose allocation
  check passes on an H200: `results/decode_ablations.md`) must not be skipped here; a
  configuration that still runs out of memory is recorded and the run goes on (`run`)."""
  return limit is None or weight_bytes + per_token * context * batch + margin <= limit


def prefill(spec: ModelSpec, params, method: BenchMethod, length: int) -> dict:
  """One `forward` over a `length`-token prompt (batch 1) into a fresh cache: the user's
  prefill path (chunked attention); seconds and device bytes."""
  caches = init_caches(method.cache, method.spec, spec, params, batch=1, capacity=length + 8,
                       dtype=jnp.bfloat16)
  tok = jnp.zeros((1, length), jnp.int32)
  pos = jnp.arange(length, dtype=jnp.int32)[None]
  run = jax.jit(lambda p, t, ps, c: forward(p, t, ps, c, spec, last_only=True),
                donate_argnums=3)
  t0 = time.perf_counter()
  compiled = run.lower(params, tok, pos, caches).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  t0 = time.perf_counter()
  logits, caches = compiled(params, tok, pos, caches)
  jax.block_until_ready(logits)
  return dict(method=method.label, prompt=length, prefill_s=time.perf_counter() - t0,
              compile_s=compile_s, finite=bool(jnp.all(jnp.isfinite(logits))),
              step_temp_bytes=None if mem is None else int(mem.temp_size_in_bytes),
              device_bytes_in_use=memory.bytes_in_use())


def run(model, *, methods: Sequence[str], configs: Sequence[tuple[int, int]],
        steps: int = 20, n_layers: Optional[int] = None,
        prefill_methods: Sequence[str] = (), prefill_length: int = 32768,
        time_budget_s: float = 1e9, log: Callable[[str], None] = print,
        mesh: Optional[tuple[int, int]] = None, profile: bool = False,
        check_batch: bool = False,
        on_progress: Optional[Callable[[dict], None]] = None) -> dict:
  """The benchmark for one model (module docstring): a dict with the records.

  Args:
    model: a MODELS name, or a ModelSpec (tests).
    methods: METHODS names.
    configs: (context, batch) pairs, in priority order: each runs every method before the
      next starts, so a time budget cuts the least important configurations.
    mesh: (data, model) devices (`kvlowrank.parallel`), None = one device; prefill is
      timed on one device only.
    profile: also record each step's device time per XLA op (`step_ops`).
    check_batch: after each method's first record at a context, allocate and run its
      estimated largest batch there (`check_max_batch`; the record's `max_batch_check`).
    on_progress: called with the result so far (the dict this returns, `complete` False)
      after every record, skip and prefill, so a caller can save it (a run cut short by a
      time limit keeps what it measured).
  The prefills run first. Configurations whose caches cannot fit are skipped, and once
  `time_budget_s` is spent the rest are listed as not run.
  """
  if isinstance(model, ModelSpec):
    spec, model = model, "custom"
  elif model not in MODELS:
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
  else:
    spec = MODELS[model]
  bad = [m for m in list(methods) + list(prefill_methods) if m not in METHODS]
  if bad:
    raise ValueError(f"unknown methods {bad}; known: {sorted(METHODS)}")
  if n_layers:
    spec = spec.replace(n_layers=n_layers)
  dev_mesh = None
  if mesh is not None:
    dev_mesh = parallel.make_mesh(*mesh)
    parallel.check_layout(spec, dev_mesh)
    if prefill_methods:
      raise ValueError("prefill_methods: the prefill is timed on one device (mesh=None)")
  n_dev = 1 if dev_mesh is None else dev_mesh.size
  tp = 1 if dev_mesh is None else dev_mesh.shape[parallel.MODEL]
  t_start = time.perf_counter()
  limit = memory.bytes_limit()
  recs, skipped, prefills = [], [], []
  loaded, checked = {}, set()

  def result(complete):
    return dict(model=model, n_layers=spec.n_layers, memory_limit=limit, records=list(recs),
                skipped=list(skipped), prefill=list(prefills),
                wall_s=time.perf_counter() - t_start, complete=complete)

  def progress():
    if on_progress is not None:
      on_progress(result(False))

  def params_for(name):
    """(params, weight bytes, cache bytes per token); the weights are kept while the next
    method uses the same ones (`_params_kind`: dense, KIVI, GEAR and XQuant share them)."""
    m = METHODS[name]
    kind = _params_kind(m)
    if loaded.get("kind") != kind:
      loaded.clear()
      t0 = time.perf_counter()
      if dev_mesh is None:
        params = random_params(spec, jax.random.key(1), m)
      else:
        params = sharded_params(spec, jax.random.key(1), m, dev_mesh)
      jax.block_until_ready(params)
      loaded.update(kind=kind, params=params)
      log(f"{m.label}: random weights in {time.perf_counter() - t0:.0f} s")
    if name not in loaded:
      params = loaded["params"]
      if dev_mesh is None:
        per_token, kept = bytes_per_token(spec, params, m)
        loaded[name] = (params, array_bytes(params) + kept, per_token)
      else:   # per device: weights and (head-split caches) bytes per token of one shard
        per_token, kept = bytes_per_token(spec, None, m, tp=tp)
        loaded[name] = (params, device_bytes(params) + kept, per_token)
    return loaded[name]

  over = lambda: time.perf_counter() - t_start > time_budget_s
  for name in prefill_methods:     # first: the long prompt through the user's prefill path
    method = METHODS[name]
    if over():
      prefills.append(dict(method=method.label, prompt=prefill_length, error="time budget"))
      continue
    try:
      prefills.append(prefill(spec, params_for(name)[0], method, prefill_length))
      log(f"prefill {method.label} {prefill_length} tokens: {prefills[-1]}")
    except Exception as e:  # pylint: disable=broad-except  (OOM: record and go on)
      prefills.append(dict(method=method.label, prompt=prefill_length,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
      log(f"prefill {method.label} failed: {prefills[-1]['error']}")
    progress()
  for ctx, b in configs:           # then the decode configurations, in priority order
    for name in methods:
      method = METHODS[name]
      if over():
        skipped.append(dict(method=method.label, context=ctx, batch=b, why="time budget"))
        continue
      params, weights, per_token = params_for(name)
      dp = n_dev // tp
      if b % dp or not fits(per_token, ctx, b // dp, weights, limit):
        skipped.append(dict(method=method.label, context=ctx, batch=b, why="memory"))
        log(f"skip {method.label} ctx={ctx} B={b}: does not fit")
        progress()
        continue
      try:
        rec = run_config(spec, params, method, ctx, b, steps=steps, mesh=dev_mesh,
                         profile=profile)
      except Exception as e:  # pylint: disable=broad-except  (OOM: record and go on)
        skipped.append(dict(method=method.label, context=ctx, batch=b,
                            why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
        log(f"fail {method.label} ctx={ctx} B={b}: {skipped[-1]['why']}")
        progress()
        continue
      rec["weight_bytes"] = weights
      rec["max_batch"] = max_batch(rec, weights, limit, data=dp)
      if check_batch and rec["max_batch"] and (name, ctx) not in checked and not over():
        checked.add((name, ctx))
        t0 = time.perf_counter()
        rec["max_batch_check"] = check_max_batch(spec, params, method, ctx, rec["max_batch"],
                                                 mesh=dev_mesh)
        rec["max_batch_check"]["wall_s"] = time.perf_counter() - t0
        log(f"{method.label} ctx={ctx}: max batch {rec['max_batch']} allocated and run: "
            f"{rec['max_batch_check']}")
      recs.append(rec)
      log(f"{method.label:>15} ctx={ctx:>6} B={b:>2} [{rec['implementation']}"
          f"{'; ' + rec['dispatch_reason'] if rec['dispatch_reason'] else ''}]: "
          f"{rec['tokens_per_s']:9.1f} tok/s, step {rec['step_ms']:7.2f} ms"
          + ("" if rec["attention_ms"] is None else
             f" (attention {rec['attention_ms']:7.2f} ms)")
          + f", cache {rec['cache_device_bytes'] / 2**30:6.2f} GiB"
          + (" per device" if dev_mesh is not None else "") + ", "
          f"max batch {rec['max_batch']}; set-up {rec['setup_s']:.0f} s, compile "
          f"{rec['compile_s']:.0f} s, timed loops {rec['timed_s']:.0f} s"
          + ("" if rec["attention_timing_s"] is None else
             f", attention timing {rec['attention_timing_s']:.0f} s"))
      progress()
  return result(True)


def speedups(result: dict) -> list[dict]:
  """Each record with its tokens/s relative to dense at the same (context, batch)."""
  dense = {(r["context"], r["batch"]): r["tokens_per_s"] for r in result["records"]
           if r["method"] == "dense"}
  out = []
  for r in result["records"]:
    d = dense.get((r["context"], r["batch"]))
    out.append(dict(r, vs_dense=None if d is None else r["tokens_per_s"] / d))
  return out


def context_label(n: int) -> str:
  """A context length as the tables write it: 32768 -> "32K", 300 -> "300"."""
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(result: dict) -> str:
  """Markdown table of the records."""
  lines = ["| method | context | batch | tokens/s | × dense | step ms | attention ms (share) | "
           "cache GiB (= nbytes) | peak GiB | max batch (allocated: ✓ runs, ✗ fails) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  gib = lambda x: "—" if x is None else f"{x / 2**30:.2f}"
  for r in speedups(result):
    mesh = r.get("mesh")
    if mesh:   # bytes of one device's shards
      cache = f"{gib(r['cache_device_bytes'])} per device"
    else:
      same = "" if r["cache_nbytes"] == r["cache_device_bytes"] else " (≠)"
      cache = f"{gib(r['cache_nbytes'])}{same}"
    vs = "—" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}×"
    attn = ("—" if r["attention_ms"] is None else
            f"{r['attention_ms']:.2f} ({100 * r['attention_share']:.0f}%)")
    label = r["method"] + (f" [{mesh[0]}x{mesh[1]}]" if mesh else "")
    check = r.get("max_batch_check")
    mark = "" if check is None else (" ✓" if check["fits"] else (
        " ✗" + (f" ({check['largest_run']} ✓)" if check.get("largest_run") else "")))
    lines.append(
        f"| {label} | {context_label(r['context'])} | {r['batch']} | {r['tokens_per_s']:.1f} | "
        f"{vs} | {r['step_ms']:.2f} | {attn} | {cache} | {gib(r['peak_bytes_est'])} | "
        f"{r['max_batch']}{mark} |")
  return "\n".join(lines)
