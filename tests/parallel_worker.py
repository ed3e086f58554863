"""Runs in its own process with 4 simulated CPU devices (tests/test_parallel.py starts it):
sharded forward / greedy generation vs one device, for every cache and mesh shape.
Prints one JSON object per case."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvlowrank.methods.palu as palu  # noqa: E402
from kvlowrank.methods import rotated  # noqa: E402
from kvlowrank import parallel  # noqa: E402
from kvlowrank.generate import generate  # noqa: E402
from kvlowrank.methods import (DenseSpec, GearSpec, KiviSpec, XQuantCLSpec,  # noqa: E402
                               XQuantSpec, init_caches)
from kvlowrank.model.params import layer_shapes  # noqa: E402
from kvlowrank.model.transformer import forward  # noqa: E402
from kvlowrank.spec import ModelSpec  # noqa: E402
from rotated_params import ragged_rotated_params  # noqa: E402

SPEC = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16,
                 ffn_dim=48, qkv_bias=True, max_seq_len=64)
# The per-layer quantizing caches (KIVI, Palu, XQuant, GEAR) run a 1-layer model (CI time:
# each compiled program is about half as long). What a second layer adds (the per-layer
# parameter and cache specs of a list of layers, the sharded hidden state handed from one
# layer to the next) does not depend on the cache type and is compared on 2 layers by dense
# (on all three meshes), XQuant-CL (whose carry crosses layers) and FDC.
SPEC1 = SPEC.replace(n_layers=1)
# FDC/ZACK: ragged widths need a head dim of several 16-wide tiles.
RSPEC = SPEC.replace(head_dim=64)
R_WIDTHS = (((16, 48, 32, 64), (64, 16, 32, 48)), ((64, 16, 16, 32), (32, 32, 16, 64)))
MESHES = ((1, 4), (2, 2), (4, 1))
# Pure data parallelism (4x1) splits only the batch axis, which 2x2 already splits for every
# cache; it runs for these two (CI time), every cache runs 1x4 and 2x2.
DATA_ONLY_METHODS = ("dense", "kivi")


def meshes(name):
  return MESHES if name in DATA_ONLY_METHODS else MESHES[:2]
B, T, STEPS, CAP = 4, 10, 2, 32
GENERATE_MESH = (2, 2)  # greedy generation is compared on this mesh (forward on all)


def init_params(spec, seed=0, scale=0.25):
  rng = np.random.default_rng(seed)
  mk = lambda shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
  layers = [{n: (jnp.ones(sh) if n.endswith("norm") else mk(sh))
             for n, sh in layer_shapes(spec).items()} for _ in range(spec.n_layers)]
  layers = [dict(lp, bo=mk((spec.dim,))) for lp in layers]
  return {"embed": mk((spec.vocab_size, spec.dim)), "final_norm": jnp.ones(spec.dim),
          "layers": layers, "lm_head": mk((spec.dim, spec.vocab_size))}


def rotated_params():
  """A 2-layer FDC/ZACK-compressed model of ragged widths (random rotations; unbalanced)."""
  p = init_params(RSPEC, seed=2)
  return ragged_rotated_params(p, RSPEC, [w[0] for w in R_WIDTHS], [w[1] for w in R_WIDTHS],
                               seed=3)


def methods(params, params1):
  """name -> (params, cache method, cache spec, model spec); params: SPEC's, params1: SPEC1's."""
  calib = np.random.default_rng(0).integers(0, SPEC.vocab_size, (8, 32))
  stats = palu.calibrate(params1, SPEC1, calib)
  pspec = palu.PaluSpec(granularity="m", rank_search="uniform", rank_multiple=8,
                        target_ratio=0.5)
  palu_params, _ = palu.compress(params1, SPEC1, pspec, stats)
  return {
      "dense": (params, "dense", DenseSpec(), SPEC),
      "kivi": (params1, "kivi", KiviSpec(bits=2, group_size=8, residual=8), SPEC1),
      "palu": (palu_params, "palu", pspec, SPEC1),
      "palu_4bit": (palu_params, "palu", pspec.replace(bits=4), SPEC1),
      "xquant_x": (params1, "xquant", XQuantSpec(bits=4, group_size=16, path="x"), SPEC1),
      "xquant_latent": (params1, "xquant", XQuantSpec(bits=4, group_size=16, path="latent"),
                        SPEC1),
      "xquant_cl": (params, "xquant_cl", XQuantCLSpec(bits=4, group_size=16, base_layer=1,
                                                      n_high_layers=1), SPEC),
      # GEAR (Q + S + L): the 10-token prompt compresses one 8-token chunk (outliers, the
      # prefill factor); the decode steps fill the window.
      "gear": (params1, "gear", GearSpec(bits=2, group_size=8, buffer=8, sparsity=20.0,
                                         rank_prefill=4, rank_chunk=2), SPEC1),
  }


def inputs():
  rng = np.random.default_rng(1)
  toks = rng.integers(0, SPEC.vocab_size, (B, T + STEPS)).astype(np.int32)
  pos = np.broadcast_to(np.arange(T + STEPS, dtype=np.int32), (B, T + STEPS)).copy()
  pos[1, T - 3:T] = -1   # a ragged row: padding at the end of its prompt
  return toks, pos


@functools.partial(jax.jit, static_argnames=("spec",))
def one_device(params, tok, pos, caches, spec):
  return forward(params, tok, pos, caches, spec)


@functools.partial(jax.jit, static_argnames=("spec", "mesh"))
def sharded(params, tok, pos, caches, spec, mesh):
  return parallel.forward(mesh, params, tok, pos, caches, spec)


def run(params, method, mspec, mesh=None, spec=SPEC, place=True):
  """Prefill T tokens then STEPS decode steps → list of fp32 logits arrays."""
  toks, pos = inputs()
  caches = init_caches(method, mspec, spec, params, batch=B, capacity=CAP, dtype=jnp.float32)
  if mesh is not None and place:
    params = parallel.shard_params(params, spec, mesh)
    caches = parallel.shard_caches(caches, mesh)
  out = []
  for lo, hi in [(0, T)] + [(T + i, T + i + 1) for i in range(STEPS)]:
    args = (params, jnp.asarray(toks[:, lo:hi]), jnp.asarray(pos[:, lo:hi]), caches, spec)
    logits, caches = one_device(*args) if mesh is None else sharded(*args, mesh)
    out.append(np.asarray(logits))
  return out


def emit(**kw):
  print(json.dumps(kw), flush=True)


def main():
  params = init_params(SPEC)
  for name, (p, method, mspec, spec) in methods(params, init_params(SPEC1)).items():
    ref = run(p, method, mspec, spec=spec)
    prompts = [[int(t) for t in row[:7 + i]] for i, row in enumerate(inputs()[0])]
    gen_ref = generate(p, spec, prompts, max_new_tokens=6, cache_method=method,
                       cache_spec=mspec, eos_ids=()).tokens
    for data, model in meshes(name):
      mesh = parallel.make_mesh(data, model)
      got = run(p, method, mspec, mesh, spec=spec)
      diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
      gen = None
      if (data, model) == GENERATE_MESH:
        gen = generate(p, spec, prompts, max_new_tokens=6, cache_method=method,
                       cache_spec=mspec, eos_ids=(), mesh=mesh).tokens == gen_ref
      emit(case="equal", method=name, mesh=[data, model], max_abs_diff=diff,
           scale=float(np.max(np.abs(ref[0]))), tokens_equal=gen, layers=spec.n_layers)
  # FDC (ragged widths): the model balanced for each mesh's model axis (permuted heads,
  # zero-padded slots) against the unbalanced model on one device.
  rp = rotated_params()
  rsp = rotated.RotatedSpec()
  ref = run(rp, "fdc", rsp, spec=RSPEC)
  prompts = [[int(t) for t in row[:7 + i]] for i, row in enumerate(inputs()[0])]
  gen_ref = generate(rp, RSPEC, prompts, max_new_tokens=6, cache_method="fdc",
                     cache_spec=rsp, eos_ids=()).tokens
  for data, model in MESHES:
    mesh = parallel.make_mesh(data, model)
    bal = rotated.balance(rp, RSPEC, model)
    got = run(bal, "fdc", rsp, mesh, spec=RSPEC)
    gen = None
    if (data, model) == GENERATE_MESH:
      gen = generate(bal, RSPEC, prompts, max_new_tokens=6, cache_method="fdc",
                     cache_spec=rsp, eos_ids=(), mesh=mesh).tokens == gen_ref
    emit(case="equal", method="fdc", mesh=[data, model],
         max_abs_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got)),
         scale=float(np.max(np.abs(ref[0]))), tokens_equal=gen,
         padding=rotated.padding_fraction(rp, model), layers=RSPEC.n_layers)
  # Quantized K'/V': split over the data axis only. Layer 0 of the model (CI time: its
  # programs are the largest here; the 2-layer stack is compared above, unquantized).
  qsp = rotated.RotatedSpec(bits=4, group_size=16, residual=0)
  rp1, rspec1 = dict(rp, layers=rp["layers"][:1]), RSPEC.replace(n_layers=1)
  ref = run(rp1, "fdc", qsp, spec=rspec1)
  got = run(rp1, "fdc", qsp, parallel.make_mesh(4, 1), spec=rspec1)
  emit(case="equal_data", method="fdc_4bit", mesh=[4, 1],
       max_abs_diff=max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got)),
       scale=float(np.max(np.abs(ref[0]))))
  rotated_errors = [
      ("rotated_unbalanced_params", lambda: parallel.shard_params(
          rp, RSPEC, parallel.make_mesh(1, 2))),
      ("rotated_unbalanced_forward", lambda: run(rp, "fdc", rsp, parallel.make_mesh(1, 2),
                                                 spec=RSPEC, place=False)),
      ("rotated_unbalanced_generate", lambda: generate(
          rp, RSPEC, prompts, max_new_tokens=2, cache_method="fdc", cache_spec=rsp,
          mesh=parallel.make_mesh(2, 2))),
      ("rotated_bits", lambda: run(rotated.balance(rp, RSPEC, 2), "fdc", qsp,
                                   parallel.make_mesh(1, 2), spec=RSPEC)),
  ]
  # Negative control: a model whose KV-head blocks are swapped between the two devices
  # (k/v projections rolled by one device's block) must not match.
  p = init_params(SPEC)
  half = SPEC.kv_dim // 2
  bad = dict(p, layers=[dict(lp, wk=jnp.roll(lp["wk"], half, axis=1),
                             bk=jnp.roll(lp["bk"], half)) for lp in p["layers"]])
  ref = run(p, "dense", DenseSpec())
  got = run(bad, "dense", DenseSpec(), parallel.make_mesh(1, 2))
  emit(case="negative", max_abs_diff=max(float(np.max(np.abs(a - b)))
                                         for a, b in zip(ref, got)))
  # The whole-model decode benchmark on a mesh (tiny model): per-device bytes and a record.
  from kvlowrank.bench import decode  # pylint: disable=import-outside-toplevel
  tiny = ModelSpec(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=128,
                   ffn_dim=64, max_seq_len=512)
  names = ["dense", "kivi2", "palu50", "fdc50", "gearl2"]
  res = decode.run(tiny, methods=names, configs=[(256, 2)], steps=1, log=lambda s: None,
                   mesh=(1, 2))
  fdc_pad = rotated.padding_fraction(
      decode.random_params(tiny, jax.random.key(0), decode.METHODS["fdc50"]), 2)
  for name, two in zip(names, res["records"]):
    m = decode.METHODS[name]
    # The same caches on one device (the unbalanced FDC widths: its padding shows).
    caches = init_caches(m.cache, m.spec, tiny, decode.random_params(tiny, jax.random.key(1), m),
                         batch=2, capacity=two["capacity"], dtype=jnp.bfloat16)
    emit(case="bench", method=two["method"], one_device=decode.storage_bytes(caches),
         per_device=two["cache_device_bytes"], mesh=two["mesh"], table=decode.table(res),
         padding=fdc_pad)
  # The bench's sharded weights: `random_params`' values, created layer by layer in shards.
  two_layers = tiny.replace(n_layers=2)
  for name in ("dense", "palu50", "fdc50"):
    m = decode.METHODS[name]
    want = decode.random_params(two_layers, jax.random.key(1), m, 2, 2)
    got = decode.sharded_params(two_layers, jax.random.key(1), m, parallel.make_mesh(1, 2))
    same = (jax.tree.structure(want) == jax.tree.structure(got)
            and all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))))
    emit(case="sharded_params", method=name, equal=bool(same),
         layers_differ=not np.array_equal(np.asarray(got["layers"][0]["wq"]),
                                          np.asarray(got["layers"][1]["wq"])),
         split=len(got["layers"][0]["wq"].sharding.device_set) == 2)
  # Clear errors.
  for label, fn in [
      ("heads", lambda: parallel.forward(parallel.make_mesh(1, 3), p,
                                         jnp.zeros((1, 1), jnp.int32),
                                         jnp.zeros((1, 1), jnp.int32), None, SPEC)),
      ("batch", lambda: parallel.forward(parallel.make_mesh(4, 1), p,
                                         jnp.zeros((2, 1), jnp.int32),
                                         jnp.zeros((2, 1), jnp.int32), None, SPEC)),
      ("palu_groups", lambda: parallel.param_specs(
          palu.compress(p, SPEC, palu.PaluSpec(granularity="g", group_size=2,
                                               rank_search="uniform", rank_multiple=8),
                        palu.calibrate(p, SPEC, np.zeros((2, 16), np.int32)))[0], SPEC, 4)),
      ("devices", lambda: parallel.make_mesh(2, 4)),
  ] + rotated_errors:
    try:
      fn()
      emit(case="error", label=label, message=None)
    except ValueError as e:
      emit(case="error", label=label, message=str(e))


if __name__ == "__main__":
  sys.exit(main())
