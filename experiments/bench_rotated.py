"""Decode-attention benchmark of the ragged-head rotated-cache kernel (FDC / ZACK) vs dense.

One layer, one new token per sequence, batch 8, all slots valid, random data. The rotated cache
keeps ragged per-KV-head widths at 50% compression: k and v widths multiples of 16 around a
mean of exactly 64 of H = 128 (`rotated.shapes.ragged_widths`, seeded). Rows: `dense-cudnn`,
`dense-triton` (the baselines, full 128-wide bf16 K/V); the rotated Triton kernel with its
launch orders (`lpt.SCHEDULES`: `rotated-rows`, `rotated-lpt`, `rotated-static`, the no-sort
ablation) and `rotated-kernel-only` (the kernel alone on records prepared outside the timing:
the rest is the order/records fusion and the split-K combine). `--bits 4,2` adds
`rotated-q<bits>`: the same K'/V' quantized as the quantized rotated cache stores them (KIVI
planar codes, groups of 16, fp16 scales), read as codes by `triton_ragged_quant`.
Timing: `kvlowrank.bench.time_op` (chained executables, median). Roofline
(`kvlowrank.bench.finalize`) = bytes / the best dense bandwidth of the same call; bytes = the
inputs read once plus the bf16 output. `pct_hbm` also states the time against a nominal
4.8 TB/s (the H200's HBM3e).

Usage (GPU): python experiments/bench_rotated.py --out rot.json [--sweep] [--bits 4,2]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.bench import environment, finalize, measure_ceilings, rand, time_op
from kvlowrank_kernels.dense import decode_attention
from kvlowrank_kernels.kivi import planar
from kvlowrank_kernels.rotated import ragged_attention, ragged_attention_quantized
from kvlowrank_kernels.rotated.shapes import ragged_widths
from kvlowrank_kernels.rotated.triton_plan import plan
from kvlowrank_kernels.rotated.triton_ragged import launch_kernel, records

MODELS = {"llama3-8b": dict(n_heads=32, n_kv_heads=8, head_dim=128),
          "llama2-7b": dict(n_heads=32, n_kv_heads=32, head_dim=128)}
HBM_TBPS = 4.8
DENSE_OPTS = dict(block_s=64, num_warps=4, num_stages=4, target_programs=528)
# The library's defaults (`ragged_attention_triton`; chunking: `triton_plan.plan`), what the
# model runs. The hand-picked chunk totals of 2026-11-25 (396 at Llama-3, 1056 at Llama-2, the
# 16K x 8 winners of results/rotated_kernel.md's run 3) are --options or --sweep candidates.
_LIB = dict(schedule="rows", group_width=256, block_s=64, num_warps=4, num_stages=2)
DEFAULT_OPTIONS = {"llama3-8b": _LIB, "llama2-7b": _LIB}
# Candidates of --sweep (first: the library default). 75 KB of shared memory per program at
# 256-column tiles with block_s 64 / 2 stages or block_s 32 / 3 stages: 3 programs per SM.
SWEEP = [_LIB, dict(_LIB, target_chunks=396), dict(_LIB, target_chunks=792),
         dict(_LIB, target_chunks=1056), dict(_LIB, schedule="lpt"),
         dict(_LIB, block_s=32, num_stages=3), dict(_LIB, group_width=128),
         dict(_LIB, group_width=16, num_stages=3)]
ALT = {"rows": "lpt", "lpt": "rows", "static": "rows"}


def widths(m, seed=0):
  rng = np.random.default_rng(seed)
  return ragged_widths(m["n_kv_heads"], 64, rng), ragged_widths(m["n_kv_heads"], 64, rng)


def nbytes(*xs):
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(xs))


def rotated_case(m, s, b, key):
  kw, vw = widths(m)
  g = m["n_heads"] // m["n_kv_heads"]
  ks = jax.random.split(key, 3)
  inp = (rand(ks[0], (b, g, sum(kw))), rand(ks[1], (b, s, sum(kw))), rand(ks[2], (b, s, sum(vw))),
         jnp.full((b,), s, jnp.int32))
  w = dict(k_widths=kw, v_widths=vw, scale=m["head_dim"] ** -0.5)
  read = nbytes(inp) + b * g * sum(vw) * 2
  return inp, w, read, 2.0 * b * g * s * (sum(kw) + sum(vw))


def rotated_fn(w, opts):
  return jax.jit(lambda q, k, v, l: ragged_attention(q, k, v, l, implementation="triton", **w,
                                                     **opts))


def try_time(fn, args, log, what, samples):
  try:
    return time_op(fn, args, samples=samples).seconds
  except Exception as e:  # pylint: disable=broad-except
    log(f"  {what}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return None


def sweep(model, s, b, log, samples):
  inp, w, _, _ = rotated_case(MODELS[model], s, b, jax.random.key(3))
  res = []
  for o in SWEEP:
    t = try_time(rotated_fn(w, o), inp, log, f"sweep {model} {o}", samples)
    if t is not None:
      res.append((t, o))
      log(f"  sweep {model} S={s} B={b} {o}: {t * 1e6:.1f} us")
  t, o = min(res, key=lambda r: r[0])
  log(f"  best {model}: {o} {t * 1e6:.1f} us")
  return o, [dict(seconds=t, **o) for t, o in res]


# Knob sets of --quant_sweep (first: the library default).
QUANT_SWEEP = [{}, dict(num_warps=1), dict(num_warps=4), dict(group_width=128),
               dict(block_s=64), dict(num_stages=3), dict(block_s=64, num_warps=4)]


def quantized_rows(model, s, b, inp, w, bits, log, samples, sweep=False):
  """`rotated-q<bits>` rows: K'/V' of `inp` as the quantized rotated cache stores them, read
  as codes by the quantized kernel (its default knobs; with `sweep`, one row per
  `QUANT_SWEEP` knob set, named by it)."""
  q, k, v, lens = inp
  recs = []
  for nb in bits:
    kq = planar.quantize_keys(k[:, :, None], nb, 16, scale_dtype=jnp.float16)
    vq = planar.quantize_values(v[:, :, None], nb, 16, scale_dtype=jnp.float16)
    fl = 2.0 * q.shape[0] * q.shape[1] * s * (sum(w["k_widths"]) + sum(w["v_widths"]))
    out_bytes = q.shape[0] * q.shape[1] * sum(w["v_widths"]) * 2
    for o in (QUANT_SWEEP if sweep else [{}]):
      fn = jax.jit(lambda q, kq, vq, l, o=o: ragged_attention_quantized(
          q, kq, vq, l, implementation="triton", **w, **o))
      name = f"rotated-q{nb}" + "".join(f" {key}={val}" for key, val in o.items())
      recs.append(dict(model=model, context=s, batch=b, kernel=name,
                       bytes=nbytes(q, kq, vq, lens) + out_bytes, flops=fl,
                       seconds=try_time(fn, (q, kq, vq, lens), log, name, samples),
                       k_widths=w["k_widths"], v_widths=w["v_widths"], options=o))
    del kq, vq
  return recs


def run_config(model, s, b, opts, log, samples, bits=(), quant_sweep=False):
  m = MODELS[model]
  key = jax.random.key(s + b)
  recs = []
  ks = jax.random.split(key, 3)
  shp = (b, s, m["n_kv_heads"], m["head_dim"])
  dense = (rand(ks[0], (b, m["n_heads"], m["head_dim"])), rand(ks[1], shp), rand(ks[2], shp),
           jnp.full((b,), s, jnp.int32))
  d_read = nbytes(dense) + b * m["n_heads"] * m["head_dim"] * 2
  d_fl = 4.0 * b * m["n_heads"] * s * m["head_dim"]
  for impl in ("cudnn", "triton"):
    o = DENSE_OPTS if impl == "triton" else {}
    f = jax.jit(lambda q, k, v, l, impl=impl, o=o: decode_attention(q, k, v, l,
                                                                    implementation=impl, **o))
    recs.append(dict(model=model, context=s, batch=b, kernel=f"dense-{impl}", bytes=d_read,
                     flops=d_fl, seconds=try_time(f, dense, log, f"dense-{impl}", samples)))
  del dense
  inp, w, read, fl = rotated_case(m, s, b, key)
  sched = opts.get("schedule", "rows")
  rows = [(f"rotated-{sched}", opts), (f"rotated-{ALT[sched]}", dict(opts, schedule=ALT[sched])),
          ("rotated-static", dict(opts, schedule="static"))]
  for name, o in rows:
    t = try_time(rotated_fn(w, o), inp, log, name, samples)
    recs.append(dict(model=model, context=s, batch=b, kernel=name, bytes=read, flops=fl,
                     seconds=t, k_widths=w["k_widths"], v_widths=w["v_widths"], options=o))
  # Where the time goes: the Triton kernel alone, on records prepared outside the timing
  # (the rest of rotated-<schedule> is the order/records fusion and the split-K combine).
  p = plan(inp[0].shape, s, w["k_widths"], w["v_widths"], inp[1].dtype,
           block_s=opts["block_s"], target_chunks=opts.get("target_chunks"),
           group_width=opts.get("group_width", 256))
  rec = jax.jit(lambda l: records(p, l, sched))(inp[3])
  kern = jax.jit(lambda q, k, v, r: launch_kernel(q, k, v, r, p, w["scale"],
                                                  num_warps=opts["num_warps"],
                                                  num_stages=opts["num_stages"]))
  recs.append(dict(model=model, context=s, batch=b, kernel="rotated-kernel-only", bytes=read,
                   flops=fl, seconds=try_time(kern, (*inp[:3], rec), log, "kernel-only", samples),
                   options=opts))
  recs += quantized_rows(model, s, b, inp, w, bits, log, samples, quant_sweep)
  for r in recs:
    log(f"  {model} S={s} B={b} {r['kernel']}: "
        f"{r['seconds'] * 1e6 if r['seconds'] else float('nan'):.1f} us")
  return recs


def table(recs):
  lines = [f"{'model':10} {'ctx':>6} {'B':>2} {'kernel':19} {'us':>8} {'TB/s':>5} "
           f"{'roof_us':>8} {'%roof':>6} {'%4.8TB/s':>8} {'x cudnn':>7} {'x best':>6}"]
  cudnn = {(r["model"], r["context"], r["batch"]): r["seconds"] for r in recs
           if r["kernel"] == "dense-cudnn"}
  for r in recs:
    if not r.get("us"):
      lines.append(f"{r['model']:10} {r['context']:>6} {r['batch']:>2} {r['kernel']:19} failed")
      continue
    c = cudnn.get((r["model"], r["context"], r["batch"]))
    r["speedup_vs_cudnn"] = c / r["seconds"] if c else None
    r["pct_hbm"] = 100.0 * r["bytes"] / (HBM_TBPS * 1e12) / r["seconds"]
    lines.append(f"{r['model']:10} {r['context']:>6} {r['batch']:>2} {r['kernel']:19} "
                 f"{r['us']:8.1f} {r['achieved_TBps']:5.2f} {r['roofline_us']:8.1f} "
                 f"{r['pct_roofline']:6.1f} {r['pct_hbm']:8.1f} "
                 f"{r['speedup_vs_cudnn'] or float('nan'):7.2f} {r['speedup_vs_dense']:6.2f}")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--models", default="llama3-8b,llama2-7b")
  ap.add_argument("--contexts", default="16384,32768")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--sweep", action="store_true", help="tune the kernel knobs at 16K first")
  ap.add_argument("--options", default=None, help="JSON dict of kernel knobs (all models)")
  ap.add_argument("--samples", type=int, default=30)
  ap.add_argument("--bits", default="", help="comma list: add rotated-q<bits> rows (2, 4)")
  ap.add_argument("--quant_sweep", action="store_true", help="rotated-q rows per QUANT_SWEEP set")
  ap.add_argument("--time_budget", type=float, default=1e9,
                  help="skip sweeps and configs started after this many seconds")
  args = ap.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    raise SystemExit("bench_rotated.py needs a GPU")
  log = lambda msg: print(msg, flush=True)
  info = environment()
  ceil = measure_ceilings()
  info.update(copy_TBps=ceil.copy_Bps / 1e12, read_TBps=ceil.read_Bps / 1e12,
              matmul_TFLOPs=ceil.matmul_flops / 1e12)
  log(f"device: {info}")
  out = dict(info=info, options={}, sweep={}, records=[])
  t0 = time.time()
  for model in args.models.split(","):
    opts = dict(DEFAULT_OPTIONS[model]) if args.options is None else json.loads(args.options)
    if args.sweep and time.time() - t0 < args.time_budget:
      opts, out["sweep"][model] = sweep(model, 16384, args.batch, log, args.samples)
    out["options"][model] = opts
    for s in map(int, args.contexts.split(",")):
      if time.time() - t0 > args.time_budget:
        log(f"time budget reached: skipping {model} S={s}")
        continue
      out["records"] += run_config(model, s, args.batch, opts, log, args.samples,
                                   bits=[int(x) for x in args.bits.split(",") if x],
                                   quant_sweep=args.quant_sweep)
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
  dense_bw = finalize(out["records"], ceil.matmul_flops)
  info["dense_best_TBps"] = dense_bw / 1e12 if dense_bw else None
  log(table(out["records"]))
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
