"""Decode-attention kernel benchmark: dense bf16 baselines, Palu fused latent attention, KIVI.

One run measures, on the GPU it runs on:
  * the copy bandwidth (bf16 x + 1 over 4 GiB, bytes read + written) and a bf16
    8192^3 matmul rate on random data (the compute ceiling);
  * for each model layer (Llama-2-7B MHA 32x128, Llama-3-8B GQA 32/8x128),
    context and batch: the dense baselines (XLA, cuDNN, Triton split-K), Palu
    at the paper's latency configuration (4-KV-head groups, rk = 128, rv = 384)
    with bf16 latents (Triton and Mosaic GPU kernels) and 4-bit value latents (Triton),
    and KIVI-2bit (G = 32, window 128 full; Triton, and the Mosaic GPU warp kernel on the
    same cache stored in its layout). `--kernels` times a subset (KERNELS).
Times are medians of 50 samples after warm-up; each sample is one executable of n
chained calls (n sized so it runs >= 20 ms; `time_op`), so host dispatch overhead is
amortized. Roofline = max(bytes / best dense bandwidth in this run,
FLOPs / matmul rate); bytes are what each kernel must read (inputs once).

Usage (on the GPU machine):
  python experiments/bench_kernels.py --out results.json [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.bench import environment, finalize, measure_ceilings, rand, rand_u8, time_op
from kvlowrank.bench import memory
from kvlowrank_kernels.dense import decode_attention
from kvlowrank_kernels.kivi import KiviKeys, KiviValues, kivi_attention
from kvlowrank_kernels.kivi.mosaic_kivi_warp import kivi_attention_mosaic_warp
from kvlowrank_kernels.kivi.mosaic_layout import to_mosaic
from kvlowrank_kernels.palu import PackedLatent, palu_attention
from kvlowrank_kernels.palu.shapes import palu_50

MODELS = {
    "llama2-7b": dict(n_heads=32, n_kv_heads=32, head_dim=128),
    "llama3-8b": dict(n_heads=32, n_kv_heads=8, head_dim=128),
}
KIVI_GROUP = 32
KIVI_WINDOW = 128


# ----------------------------------------------------------------------------- inputs

def dense_inputs(m, s, b, key):
  ks = jax.random.split(key, 3)
  kvs = (b, s, m["n_kv_heads"], m["head_dim"])
  q = rand(ks[0], (b, m["n_heads"], m["head_dim"]))
  return dict(q=q, k=rand(ks[1], kvs), v=rand(ks[2], kvs),
              lengths=jnp.full((b,), s, jnp.int32))


def palu_inputs(m, s, b, key, v_bits):
  sh = palu_50(b, s, n_heads=m["n_heads"], n_kv_heads=m["n_kv_heads"], head_dim=m["head_dim"])
  ks = jax.random.split(key, 6)
  gr, gh = sh.n_groups, sh.kv_per_group * sh.head_dim
  q = rand(ks[0], (b, m["n_heads"], m["head_dim"]))
  hk = rand(ks[1], (b, s, gr, sh.rk))
  b_k = rand(ks[3], (gr, sh.rk, gh)) * (3.0 / sh.rk) ** 0.5
  if v_bits == 16:
    hv = rand(ks[2], (b, s, gr, sh.rv))
  else:
    hv = PackedLatent(codes=rand_u8(ks[2], (b, s, gr, sh.rv * v_bits // 8)),
                      scale=(jnp.abs(rand(ks[4], (b, s, gr))) + 0.1) / 8,
                      zero=rand(ks[5], (b, s, gr)) - 1.0, bits=v_bits, dim=sh.rv)
  return dict(q=q, hk=hk, hv=hv, b_k=b_k, lengths=jnp.full((b,), s, jnp.int32)), sh


def kivi_inputs(m, s, b, key, bits=2, scale_dtype=jnp.float16):
  """KIVI-2bit cache (groups of 32, 128-token window); fp16 scale/zero as in KIVI's own code
  (bf16 scales run the same kernel with bf16 MMA operands; see the ablation rows)."""
  ks = jax.random.split(key, 9)
  kh, h = m["n_kv_heads"], m["head_dim"]
  q = rand(ks[0], (b, m["n_heads"], h))
  nb = h * bits // 8
  sd = scale_dtype
  keys = KiviKeys(codes=rand_u8(ks[1], (b, kh, s, nb)),
                  scale=((jnp.abs(rand(ks[2], (b, kh, s // KIVI_GROUP, h))) + 0.1) / 2).astype(sd),
                  zero=(rand(ks[3], (b, kh, s // KIVI_GROUP, h)) - 1.0).astype(sd), bits=bits,
                  group=KIVI_GROUP)
  values = KiviValues(codes=rand_u8(ks[4], (b, kh, s, nb)),
                      scale=((jnp.abs(rand(ks[5], (b, kh, s, h // KIVI_GROUP))) + 0.1) / 2
                             ).astype(sd),
                      zero=(rand(ks[6], (b, kh, s, h // KIVI_GROUP)) - 1.0).astype(sd),
                      bits=bits, group=KIVI_GROUP)
  w = KIVI_WINDOW
  return dict(q=q, keys=keys, values=values, k_win=rand(ks[7], (b, w, kh, h)),
              v_win=rand(ks[8], (b, w, kh, h)), q_len=jnp.full((b,), s, jnp.int32),
              w_len=jnp.full((b,), w, jnp.int32))


def nbytes(*xs):
  total = 0
  for x in jax.tree_util.tree_leaves(xs):
    total += x.size * x.dtype.itemsize
  return total


# ----------------------------------------------------------------------------- costs

def dense_cost(m, s, b, inp):
  n, h = m["n_heads"], m["head_dim"]
  read = nbytes(inp["q"], inp["k"], inp["v"], inp["lengths"]) + b * n * h * 2
  return read, 4.0 * b * n * s * h


def palu_cost(m, s, b, inp, sh):
  n, h = m["n_heads"], m["head_dim"]
  read = nbytes(inp["q"], inp["hk"], inp["hv"], inp["b_k"], inp["lengths"]) + b * n * sh.rv * 2
  # Key reconstruction per KV head, scores, probabilities x value latents.
  flops = 2.0 * b * s * sh.n_kv_heads * h * sh.rk + 2.0 * b * n * s * h + 2.0 * b * n * s * sh.rv
  return read, flops


def kivi_cost(m, s, b, inp):
  n, h = m["n_heads"], m["head_dim"]
  read = nbytes(inp["q"], inp["keys"], inp["values"], inp["k_win"], inp["v_win"]) + b * n * h * 2
  return read, 4.0 * b * n * (s + KIVI_WINDOW) * h


# ----------------------------------------------------------------------------- kernels

def dense_fns(inp, triton_opts):
  q, k, v, lens = inp["q"], inp["k"], inp["v"], inp["lengths"]
  fns = {}
  for impl in ("xla", "cudnn", "triton"):
    opts = triton_opts if impl == "triton" else {}
    f = jax.jit(lambda q, k, v, l, impl=impl, opts=opts: decode_attention(
        q, k, v, l, implementation=impl, **opts))
    fns[f"dense-{impl}"] = (f, (q, k, v, lens))
  return fns


def palu_fn(inp, opts, implementation="triton"):
  f = jax.jit(lambda q, hk, hv, bk, l: palu_attention(q, hk, hv, bk, l,
                                                       implementation=implementation, **opts))
  return f, (inp["q"], inp["hk"], inp["hv"], inp["b_k"], inp["lengths"])


def kivi_fn(inp, opts):
  f = jax.jit(lambda *a: kivi_attention(*a, implementation="triton", **opts))
  args = (inp["q"], inp["keys"], inp["values"], inp["k_win"], inp["v_win"], inp["q_len"],
          inp["w_len"])
  return f, args


def kivi_mosaic_fn(inp, opts):
  """The Mosaic KIVI warp kernel on the same cache stored in its layout (relaid out once,
  outside the timing, as the library's KIVI cache keeps it); opts are its knobs."""
  cache = jax.jit(to_mosaic)(inp["keys"], inp["values"])
  f = jax.jit(lambda *a: kivi_attention_mosaic_warp(*a, **opts))
  return f, (inp["q"], cache, inp["k_win"], inp["v_win"], inp["q_len"], inp["w_len"])


# Tuning candidates for --sweep (first entry = default).
SWEEP = {
    "dense": [dict(block_s=64, num_warps=4, num_stages=3),
              dict(block_s=128, num_warps=4, num_stages=3),
              dict(block_s=64, num_warps=8, num_stages=4),
              dict(block_s=32, num_warps=4, num_stages=4),
              dict(block_s=128, num_warps=8, num_stages=3),
              dict(block_s=64, num_warps=4, num_stages=4),
              dict(block_s=256, num_warps=8, num_stages=2)],
    # heads_per_program 1/2 with 32-token tiles (2026-11-21/22 sweeps) lost: the value latent
    # is then read and multiplied once per program. 64/128-token tiles with 8 warps (warpgroup
    # MMA for the key product; 1 stage, as 2 stages of 64 tokens overflow shared memory unless
    # a program holds 2 KV heads) added in the fourth session of 2026-11-22.
    "palu": [dict(block_s=32, num_warps=4, num_stages=2, target_programs=1056),
             dict(block_s=32, num_warps=4, num_stages=2, target_programs=528),
             dict(block_s=64, num_warps=4, num_stages=1, target_programs=528),
             dict(block_s=128, num_warps=8, num_stages=1, target_programs=528),
             dict(block_s=128, num_warps=8, num_stages=1, target_programs=264),
             dict(block_s=128, num_warps=8, num_stages=1, target_programs=1056),
             dict(block_s=128, num_warps=8, num_stages=1, target_programs=528,
                  heads_per_program=2),
             dict(block_s=64, num_warps=8, num_stages=2, target_programs=528,
                  heads_per_program=2),
             dict(block_s=64, num_warps=4, num_stages=2, target_programs=528,
                  heads_per_program=2)],
    "kivi": [dict(block_s=32, num_warps=2, num_stages=4, target_programs=1584),
             dict(block_s=32, num_warps=2, num_stages=3, target_programs=2112),
             dict(block_s=32, num_warps=2, num_stages=3, target_programs=1056),
             dict(block_s=64, num_warps=2, num_stages=3, target_programs=1056),
             dict(block_s=64, num_warps=2, num_stages=4, target_programs=1584),
             dict(block_s=64, num_warps=2, num_stages=3, target_programs=2112),
             dict(block_s=128, num_warps=2, num_stages=2, target_programs=1056)],
}
TARGETS = (528, 1056, 2112)


def _try_time(name, fn, log):
  """fn: (jitted op, args)."""
  try:
    return time_op(*fn).seconds
  except Exception as e:  # pylint: disable=broad-except
    log(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return None


FAMILIES = ("dense", "palu", "kivi")
# Rows of the main table (--kernels picks a subset; ablation rows follow their kernel).
KERNELS = ("dense-xla", "dense-cudnn", "dense-triton", "palu-bf16", "palu-mosaic", "palu-v4",
           "kivi-2bit", "kivi-mosaic")


def sweep(model, s, b, log, families=FAMILIES):
  """Best triton options per kernel family for one (model, context, batch)."""
  m = MODELS[model]
  best = {}
  key = jax.random.key(7)
  for fam in families:
    if fam == "dense":
      inp = dense_inputs(m, s, b, key)
    elif fam == "palu":
      inp, _ = palu_inputs(m, s, b, key, 16)
    else:
      inp = kivi_inputs(m, s, b, key)
    results = []
    for opts in SWEEP[fam]:
      for target in ((opts["target_programs"],) if "target_programs" in opts else TARGETS):
        o = dict(opts, target_programs=target)
        if fam == "dense":
          fn = dense_fns(inp, o)["dense-triton"]
        elif fam == "palu":
          fn = palu_fn(inp, o)
        else:
          fn = kivi_fn(inp, o)
        t = _try_time(f"{fam} {o}", fn, log)
        if t is not None:
          results.append((t, o))
          log(f"  sweep {model} S={s} B={b} {fam} {o}: {t * 1e6:.1f} us")
    del inp
    if results:
      t, o = min(results, key=lambda r: r[0])
      best[fam] = o
      log(f"  best {fam}: {o} {t * 1e6:.1f} us")
  return best


# Winners of the --sweep runs on the H200 (16K context, batch 8, `time_op` timing) of 2026-11-22:
# dense/KIVI bench_sweep_2026-11-22.json, Palu (fourth session, after the interleaved P|Q
# operand) bench_sweep_palu_2026-11-22.json; removed from experiments/results/, kept in git:
# `git show f1beb7d:experiments/results/<file>`.
DEFAULT_OPTIONS = {
    "llama2-7b": dict(dense=dict(block_s=64, num_warps=4, num_stages=4, target_programs=528),
                      palu=dict(block_s=128, num_warps=8, num_stages=1, trans=False,
                                target_programs=528),
                      kivi=dict(block_s=32, num_warps=2, num_stages=3, target_programs=2112)),
    "llama3-8b": dict(dense=dict(block_s=64, num_warps=4, num_stages=4, target_programs=528),
                      palu=dict(block_s=128, num_warps=8, num_stages=1, trans=False,
                                target_programs=264),
                      kivi=dict(block_s=64, num_warps=2, num_stages=4, target_programs=1584)),
}


def _opts_for(best, fam):
  return dict(best.get(fam, {}))


def run_config(model, s, b, best, log, ablate=False, families=FAMILIES, kernels=KERNELS):
  """The kernels named in `kernels` on one (model, context, batch); returns records (times
  in us)."""
  m = MODELS[model]
  recs = []
  key = jax.random.key(s * 131 + b)

  def add(name, fn, rd, fl, **extra):
    t = _try_time(name, fn, log)
    recs.append(dict(model=model, context=s, batch=b, kernel=name, seconds=t, bytes=rd,
                     flops=fl, **extra))

  inp = dense_inputs(m, s, b, key)
  rd, fl = dense_cost(m, s, b, inp)
  for name, fn in dense_fns(inp, _opts_for(best, "dense")).items():
    if name in kernels:
      add(name, fn, rd, fl)
  del inp, fn
  gc.collect()
  for v_bits in (16, 4) if "palu" in families else ():
    name = "palu-bf16" if v_bits == 16 else "palu-v4"
    if name not in kernels and (v_bits == 4 or "palu-mosaic" not in kernels):
      continue
    inp, sh = palu_inputs(m, s, b, key, v_bits)
    rd, fl = palu_cost(m, s, b, inp, sh)
    if name in kernels:
      add(name, palu_fn(inp, _opts_for(best, "palu")), rd, fl)
    if v_bits == 16 and "palu-mosaic" in kernels:  # the Mosaic GPU kernel takes bf16 latents
      add("palu-mosaic", palu_fn(inp, _opts_for(best, "palu_mosaic"), "mosaic"), rd, fl)
    if ablate and name in kernels:
      # fp16 cos/sin table: half the table bytes per tile (the table is read from L2).
      add(f"{name}:fp16-rope", palu_fn(inp, dict(_opts_for(best, "palu"),
                                                 rope_dtype=jnp.float16)), rd, fl,
          ablation=True)
    del inp
    gc.collect()
  if "kivi" not in families or not {"kivi-2bit", "kivi-mosaic"} & set(kernels):
    return recs
  inp = kivi_inputs(m, s, b, key)
  rd, fl = kivi_cost(m, s, b, inp)  # the Mosaic layouts hold the same bytes (lossless)
  if "kivi-mosaic" in kernels:
    add("kivi-mosaic", kivi_mosaic_fn(inp, _opts_for(best, "kivi_mosaic")), rd, fl)
  if "kivi-2bit" in kernels:
    add("kivi-2bit", kivi_fn(inp, _opts_for(best, "kivi")), rd, fl)
    if ablate:
      del inp
      inp = kivi_inputs(m, s, b, key, scale_dtype=jnp.bfloat16)
      add("kivi-2bit:bf16-scales", kivi_fn(inp, _opts_for(best, "kivi")), rd, fl,
          ablation=True)
  del inp
  gc.collect()
  return recs


def fits(model, s, b, mem_bytes):
  m = MODELS[model]
  dense = 2 * b * s * m["n_kv_heads"] * m["head_dim"] * 2
  return dense * 1.15 < mem_bytes


def table(recs):
  lines = [f"{'model':10} {'ctx':>6} {'B':>3} {'kernel':16} {'us':>9} {'TB/s':>6} "
           f"{'roof_us':>9} {'%roof':>6} {'bound':>7} {'x dense':>8}"]
  for r in recs:
    if not r.get("us"):
      lines.append(f"{r['model']:10} {r['context']:>6} {r['batch']:>3} {r['kernel']:16} "
                   f"{'failed':>9}")
      continue
    sp = r["speedup_vs_dense"]
    lines.append(f"{r['model']:10} {r['context']:>6} {r['batch']:>3} {r['kernel']:16} "
                 f"{r['us']:9.1f} {r['achieved_TBps']:6.2f} {r['roofline_us']:9.1f} "
                 f"{r['pct_roofline']:6.1f} {r['bound']:>7} "
                 f"{sp if sp is not None else float('nan'):8.2f}")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON results path")
  ap.add_argument("--models", default="llama2-7b,llama3-8b")
  ap.add_argument("--contexts", default="4096,16384,65536,131072")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--sweep", action="store_true", help="tune kernel options at 16K, B=8 first")
  ap.add_argument("--sweep_only", action="store_true")
  ap.add_argument("--options", default=None, help="JSON file of per-model best options")
  ap.add_argument("--families", default=",".join(FAMILIES),
                  help="kernel families to sweep (dense,palu,kivi)")
  ap.add_argument("--kernels", default=",".join(KERNELS),
                  help=f"main-table rows to time (of {','.join(KERNELS)})")
  ap.add_argument("--ablate", action="store_true",
                  help="also time the variants with correct output (16K, B=8): Palu Triton with "
                       "an fp16 RoPE table, KIVI Triton with bf16 scales")
  ap.add_argument("--time_budget", type=float, default=1e9,
                  help="stop starting new configs after this many seconds")
  args = ap.parse_args(argv)
  kernels = tuple(args.kernels.split(","))
  unknown = sorted(set(kernels) - set(KERNELS))
  if unknown:
    raise SystemExit(f"--kernels: unknown {unknown}; known: {','.join(KERNELS)}")
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    raise SystemExit("bench_kernels.py needs a GPU")
  logf = open(os.path.splitext(args.out)[0] + ".log", "a", encoding="utf-8")

  def log(msg):
    print(msg, flush=True)
    logf.write(msg + "\n")
    logf.flush()

  mem = memory.bytes_limit() or 80e9
  info = environment()
  log(f"device: {info}")
  bw, rbw, mm = measure_ceilings()
  info.update(copy_TBps=bw / 1e12, read_TBps=rbw / 1e12, matmul_TFLOPs=mm / 1e12)
  log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), read-only {rbw / 1e12:.2f} TB/s, "
      f"bf16 matmul {mm / 1e12:.0f} TFLOP/s")
  models = args.models.split(",")
  best = {k: dict(v) for k, v in DEFAULT_OPTIONS.items()}
  if args.options:
    with open(args.options, encoding="utf-8") as f:
      best = json.load(f)
  if args.sweep or args.sweep_only:
    for model in models:
      best[model] = dict(best.get(model, {}),
                         **sweep(model, 16384, 8, log, args.families.split(",")))
  out = dict(info=info, options=best, records=[])
  if not args.sweep_only:
    recs = []
    t_start = time.time()
    # Headline configs (contexts >= 16K, batch >= 8) first, so a time budget keeps them.
    configs = [(model, s, b) for s in map(int, args.contexts.split(","))
               for b in map(int, args.batches.split(",")) for model in models]
    configs.sort(key=lambda c: (not (c[1] >= 16384 and c[2] >= 8), c[1] > 65536))
    for model, s, b in configs:
      if time.time() - t_start > args.time_budget:
        log(f"time budget reached: skipping {model} S={s} B={b}")
        continue
      if not fits(model, s, b, mem):
        log(f"skip {model} S={s} B={b}: does not fit")
        continue
      t_cfg = time.time()
      recs += run_config(model, s, b, best.get(model, {}), log,
                         ablate=args.ablate and s == 16384 and b == 8,
                         families=args.families.split(","), kernels=kernels)
      log(f"done {model} S={s} B={b} in {time.time() - t_cfg:.0f} s")
      out["records"] = recs
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    recs.sort(key=lambda r: (r["model"], r["context"], r["batch"]))
    dense_bw = finalize(recs, mm)
    info["dense_best_TBps"] = dense_bw / 1e12 if dense_bw else None
    log(table(recs))
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
