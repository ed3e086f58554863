"""GEAR decode-attention kernel benchmark: one layer, Llama-3-8B shape (32 / 8 heads x 128).

Times (`kvlowrank.bench.time_op`: chained executables, median of 50) at one context and batch:
  dense-cudnn        bf16 cache, `jax.nn.dot_product_attention` (cuDNN);
  kivi2-g32-mosaic   KIVI-2, G = 32, 128-token window: the Mosaic warp kernel (what KIVI-2
                     runs end to end on Hopper), on the cache relaid out once outside timing;
  gear-l-2-g32-mosaic  GEAR-L over that G = 32 cache: the Mosaic warp kernel with the low-rank
                     terms (`gear.mosaic_gear`; the prefill factor covering all but
                     --stream_chunks chunks of 64);
  kivi2-g32-triton   the same cache, the Triton planar kernel (bench_kernels' options);
  kivi2-g64-triton   KIVI-2, G = 64, 64-token window (GEAR's backbone), Triton planar;
  kivi2-g64-mosaic, gear-l-2-g64-mosaic   that cache in the warp layout: the Mosaic kernels
                     (what the default GEAR-L runs end to end on Hopper);
  gear-l-2, gear-2, outlier-2   GEAR's backbone + low rank (RP 4 / RG 2) and/or outliers
                     (NK = 2, NV = 3), chunks of 64, the prefill factor covering all but
                     --stream_chunks chunks: the Triton kernel with its GEAR flags on.
--sweep also times GEAR-L / GEAR over a few knob sets. Random codes and operands (a step's
time does not depend on the values). Prints a table (us, x KIVI rows) and writes JSON.

  python experiments/bench_gear.py --out gear.json [--context 32768 --batch 8 --sweep]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from kvlowrank.bench import environment, rand, rand_u8, time_op
from kvlowrank_kernels.dense import decode_attention
from kvlowrank_kernels.gear import gear_attention
from kvlowrank_kernels.gear import shapes as gear_shapes
from kvlowrank_kernels.gear.mosaic_gear import gear_attention_mosaic
from kvlowrank_kernels.gear.shapes import GearShape, residual_operands
from kvlowrank_kernels.kivi import KiviKeys, KiviValues, kivi_attention
from kvlowrank_kernels.kivi.mosaic_kivi_warp import kivi_attention_mosaic_warp
from kvlowrank_kernels.kivi.mosaic_layout import to_mosaic

N, KH, H = 32, 8, 128
KIVI_OPTS = dict(block_s=64, num_warps=2, num_stages=4, target_programs=1584)  # bench_kernels
# Knob sets (--sweep times all; first = the default). H200 sweep of 2026-11-25 at 32K/B=8
# (results/gear_kernel.md): GEAR-L fastest with the first, GEAR / outlier-only with the third.
GEAR_SWEEP = [dict(block_s=64, num_warps=2, num_stages=4, target_programs=1584),
              dict(block_s=64, num_warps=2, num_stages=3, target_programs=2112),
              dict(block_s=64, num_warps=2, num_stages=2, target_programs=1584),
              dict(block_s=32, num_warps=2, num_stages=4, target_programs=1584),
              dict(block_s=64, num_warps=4, num_stages=3, target_programs=1056)]
DEFAULT = {"gear-l": GEAR_SWEEP[0], "gear": GEAR_SWEEP[2], "outlier": GEAR_SWEEP[2]}


def kivi_inputs(s, b, group, window, key):
  """A random 2-bit planar KIVI store with fp16 scale/zero and a full window."""
  ks = jax.random.split(key, 9)
  f16 = jnp.float16
  keys = KiviKeys(codes=rand_u8(ks[1], (b, KH, s, H // 4)),
                  scale=((jnp.abs(rand(ks[2], (b, KH, s // group, H))) + 0.1) / 2).astype(f16),
                  zero=(rand(ks[3], (b, KH, s // group, H)) - 1.0).astype(f16), bits=2,
                  group=group)
  values = KiviValues(codes=rand_u8(ks[4], (b, KH, s, H // 4)),
                      scale=((jnp.abs(rand(ks[5], (b, KH, s, H // group))) + 0.1) / 2).astype(f16),
                      zero=(rand(ks[6], (b, KH, s, H // group)) - 1.0).astype(f16), bits=2,
                      group=group)
  return (rand(ks[0], (b, N, H)), keys, values, rand(ks[7], (b, window, KH, H)),
          rand(ks[8], (b, window, KH, H)), jnp.full((b,), s, jnp.int32),
          jnp.full((b,), window, jnp.int32))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--context", type=int, default=32768)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--stream_chunks", type=int, default=16)
  ap.add_argument("--sweep", action="store_true")
  args = ap.parse_args(argv)
  s, b = args.context, args.batch
  rows = []

  def add(name, fn, fargs, **extra):
    try:
      t = time_op(fn, fargs).seconds * 1e6
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      t = None
    rows.append(dict(kernel=name, us=t, **extra))
    write()  # after every row: a cut run keeps what it timed
    print(f"{name:18s} {extra.get('opts', '')} {t if t is None else round(t, 1)} us", flush=True)

  def write(complete=False):
    best = {}
    for r in rows:
      if r["us"] is not None and (r["kernel"] not in best or r["us"] < best[r["kernel"]]["us"]):
        best[r["kernel"]] = r
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(dict(info=environment(), context=s, batch=b, stream_chunks=args.stream_chunks,
                     rows=rows, best={k: v["us"] for k, v in best.items()}, complete=complete),
                f, indent=1)
    return best

  key = jax.random.key(0)
  q, k, v = (rand(x, shp) for x, shp in zip(jax.random.split(key, 3),
                                            ((b, N, H), (b, s, KH, H), (b, s, KH, H))))
  add("dense-cudnn", jax.jit(lambda *a: decode_attention(*a, implementation="cudnn")),
      (q, k, v, jnp.full((b,), s, jnp.int32)))
  del q, k, v
  kv32 = kivi_inputs(s, b, 32, 128, jax.random.key(1))
  cache = jax.jit(to_mosaic)(kv32[1], kv32[2])
  add("kivi2-g32-mosaic", jax.jit(kivi_attention_mosaic_warp),
      (kv32[0], cache, *kv32[3:]))
  npc = jnp.full((b,), s // 64 - args.stream_chunks, jnp.int32)  # chunks of 64 (prefill)
  shape32 = GearShape(gear_shapes.backbone(batch=b, capacity=s, window=128, n_heads=N,
                                           n_kv_heads=KH, k_group=32, v_group=32))
  lr32, _, _ = residual_operands(shape32, jax.random.key(3), npc, "gear-l")
  add("gear-l-2-g32-mosaic", jax.jit(lambda *a: gear_attention_mosaic(*a, chunk=64)),
      (kv32[0], cache, *kv32[3:], lr32))
  del cache, lr32
  add("kivi2-g32-triton", jax.jit(lambda *a: kivi_attention(*a, implementation="triton",
                                                            **KIVI_OPTS)), kv32, opts=KIVI_OPTS)
  del kv32
  kv = kivi_inputs(s, b, 64, 64, jax.random.key(2))
  add("kivi2-g64-triton", jax.jit(lambda *a: kivi_attention(*a, implementation="triton",
                                                            **KIVI_OPTS)), kv, opts=KIVI_OPTS)
  shape = GearShape(gear_shapes.backbone(batch=b, capacity=s, window=64, n_heads=N,
                                         n_kv_heads=KH))
  cache = jax.jit(to_mosaic)(kv[1], kv[2])
  add("kivi2-g64-mosaic", jax.jit(kivi_attention_mosaic_warp), (kv[0], cache, *kv[3:]))
  lr64, _, _ = residual_operands(shape, jax.random.key(3), npc, "gear-l")
  add("gear-l-2-g64-mosaic", jax.jit(lambda *a: gear_attention_mosaic(*a, chunk=64)),
      (kv[0], cache, *kv[3:], lr64))
  del cache, lr64
  for name, variant in (("gear-l-2", "gear-l"), ("gear-2", "gear"), ("outlier-2", "outlier")):
    lr, sk, sv = residual_operands(shape, jax.random.key(3), npc, variant)
    for opts in GEAR_SWEEP if args.sweep else [DEFAULT[variant]]:
      f = jax.jit(lambda *a, o=opts: gear_attention(*a[:7], lowrank=a[7], sparse_k=a[8],
                                                    sparse_v=a[9], implementation="triton",
                                                    **o))
      add(name, f, (*kv, lr, sk, sv), opts=opts)
  best = write(complete=True)
  print(f"\nLlama-3-8B layer, context {s}, batch {b} ({jax.devices()[0].device_kind})")
  print(f"{'kernel':18s} {'us':>8s} {'x g64-tri':>9s} {'x g32-mos':>9s} {'x g32-tri':>9s}")
  for name, r in best.items():
    ratio = lambda ref: (f"{r['us'] / best[ref]['us']:9.2f}" if ref in best else f"{'-':>9s}")
    print(f"{name:18s} {r['us']:8.1f} {ratio('kivi2-g64-triton')} {ratio('kivi2-g32-mosaic')} "
          f"{ratio('kivi2-g32-triton')}  {r.get('opts', '')}")


if __name__ == "__main__":
  main()
