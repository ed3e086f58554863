"""Interleaved A/B timing of Mosaic kernel variants (Palu or KIVI; and the dense cuDNN kernel).

The device machines drift by 10-45% within one call (BENCHMARKS.md), so timing variant A
for a minute and then variant B compares machine states, not kernels. Here every round
times each variant once, in turn (a chained executable of n calls, as `bench_kernels`
does, n sized to ~10 ms), and the report gives per variant the median and spread of its
own times and the median of its per-round ratio to the first variant: paired ratios
cancel the drift that the rounds share.

  python experiments/ab_kernels.py --model llama3-8b --context 16384 --batch 8 \
      --variants '[{}, {"overlap": true}]' --rounds 30 --out ab.json
  python experiments/ab_kernels.py --family kivi --variants '[{}, {"warpgroups": 3}]'
(--family kivi: Mosaic KIVI-2bit option dicts, plus the Triton KIVI kernel at its
`bench_kernels` default options.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  pylint: disable=wrong-import-position


def _executable(op, args, chain_s=10e-3, max_chain=64):
  """(run, n): a zero-argument call of n chained op calls lasting about chain_s, warmed up.
  One dispatch and sync costs ~0.1-0.2 ms of host time on the device machine, so n is sized
  from the fastest of 5 single calls and chain_s is long enough to make that small."""
  one = bk.chained(op, 1)
  jax.block_until_ready(one(*args))
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(one(*args))
    best = min(best, time.perf_counter() - t0)
  n = int(min(max_chain, max(1, round(chain_s / best))))
  f = bk.chained(op, n)
  for _ in range(3):
    jax.block_until_ready(f(*args))
  return (lambda: f(*args)), n


def _family_runs(family, model, s, b, key, variants):
  """[(label, op, args)] of the variants (first variant first)."""
  m = bk.MODELS[model]
  if family == "palu":
    inp, _ = bk.palu_inputs(m, s, b, key, 16)
    return [("palu-mosaic:" + (",".join(f"{k}={v}" for k, v in o.items()) or "default"),
             *bk.palu_fn(inp, o, "mosaic")) for o in variants]
  inp = bk.kivi_inputs(m, s, b, key)
  runs = [("kivi-mosaic:" + (",".join(f"{k}={v}" for k, v in o.items()) or "default"),
           *bk.kivi_mosaic_fn(inp, o)) for o in variants]
  return runs + [("kivi-triton", *bk.kivi_fn(inp, bk.DEFAULT_OPTIONS[model]["kivi"]))]


def ab(model, s, b, variants, rounds, dense=True, fixed_cost=False, family="palu"):
  """{label: dict(us=[per round], median_us, p10_us, p90_us, ratio_to_first)}. fixed_cost:
  also the first variant with every sequence 1 token long (launch, per-CTA set-up, split-K
  combine and the XLA ops around the kernel: the cost that does not scale with the cache)."""
  m = bk.MODELS[model]
  key = jax.random.key(s * 131 + b)
  runs = {}
  fam = _family_runs(family, model, s, b, key, variants)
  for label, op, args in fam:
    runs[label] = _executable(op, args)
  if fixed_cost:  # every length argument (int32 [B]) set to 1
    _, op, args = fam[0]
    ones = tuple(a * 0 + 1 if getattr(a, "dtype", None) == jax.numpy.int32 else a for a in args)
    runs["first variant, length 1"] = _executable(op, ones)
  if dense:
    d = bk.dense_fns(bk.dense_inputs(m, s, b, key), {})["dense-cudnn"]
    runs["dense-cudnn"] = _executable(*d)
  times = {k: [] for k in runs}
  for _ in range(rounds):
    for label, (run, n) in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      times[label].append((time.perf_counter() - t0) / n * 1e6)
  first = next(iter(times))
  out = {}
  for label, us in times.items():
    q = statistics.quantiles(us, n=10)
    out[label] = dict(us=us, median_us=statistics.median(us), p10_us=q[0], p90_us=q[-1],
                      ratio_to_first=statistics.median(
                          [a / f for a, f in zip(us, times[first])]))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="llama3-8b", choices=sorted(bk.MODELS))
  ap.add_argument("--context", type=int, default=16384)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--family", default="palu", choices=("palu", "kivi"))
  ap.add_argument("--variants", required=True,
                  help="JSON list of Mosaic kernel option dicts (kivi: the key 'kernel' picks "
                  "'wgmma' (default) or 'warp')")
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--fixed_cost", action="store_true",
                  help="also time the first variant with 1-token sequences")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  variants = json.loads(args.variants)
  if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
    raise ValueError(f"--variants must be a JSON list of option dicts, got {args.variants!r}")
  res = ab(args.model, args.context, args.batch, variants, args.rounds,
           fixed_cost=args.fixed_cost, family=args.family)
  print(f"{args.model} S={args.context} B={args.batch}, {args.rounds} interleaved rounds")
  print("| variant | median µs | p10-p90 µs | ratio to the first (median of rounds) |")
  print("|---|---|---|---|")
  for label, r in res.items():
    print(f"| {label} | {r['median_us']:.1f} | {r['p10_us']:.1f}-{r['p90_us']:.1f} | "
          f"{r['ratio_to_first']:.3f} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     date=datetime.date.today().isoformat(), model=args.model,
                     family=args.family, context=args.context, batch=args.batch,
                     rounds=args.rounds, results=res),
                f, indent=1)


if __name__ == "__main__":
  main()
