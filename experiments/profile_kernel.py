"""Runs one decode-attention kernel a few times at one shape, for a profiler to attach to.

  ncu --clock-control none -k regex:latent_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats \
      python experiments/profile_kernel.py --family palu --model llama2-7b --context 16384 --batch 8

(`--options '{"implementation": "mosaic", ...}'` profiles the Mosaic GPU Palu kernel.)

With --trace_dir (Mosaic GPU Palu kernel only), the kernel records its own per-warpgroup
timeline of named phases (Pallas Mosaic GPU profiler) and the last call's trace is
summarised (`mosaic_trace.py`): where the compute and producer warpgroups spend their time.

Inputs and kernel options are the benchmark's (`bench_kernels.py`: random data of the
real layer shapes, options from its DEFAULT_OPTIONS or --options JSON). Prints the
median wall time of the calls so a profiled run can be matched with the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  pylint: disable=wrong-import-position
import mosaic_trace  # noqa: E402  pylint: disable=wrong-import-position


def build(family, model, s, b, opts, v_bits=16):
  """A zero-argument callable running the kernel once (jitted)."""
  m = bk.MODELS[model]
  key = jax.random.key(s * 131 + b)
  if family == "dense":
    op, args = bk.dense_fns(bk.dense_inputs(m, s, b, key), opts)["dense-triton"]
  elif family == "palu":
    inp, _ = bk.palu_inputs(m, s, b, key, v_bits)
    opts = dict(opts)
    op, args = bk.palu_fn(inp, opts, opts.pop("implementation", "triton"))
  elif family == "kivi":
    op, args = bk.kivi_fn(bk.kivi_inputs(m, s, b, key), opts)
  else:
    raise ValueError(f"--family must be dense, palu or kivi, got {family!r}")
  return lambda: op(*args)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--family", required=True)
  ap.add_argument("--model", default="llama2-7b", choices=sorted(bk.MODELS))
  ap.add_argument("--context", type=int, default=16384)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--v_bits", type=int, default=16)
  ap.add_argument("--options", default=None, help="JSON dict of kernel options")
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--trace_dir", default=None,
                  help="record the Mosaic Palu kernel's phase trace here and summarise it")
  ap.add_argument("--out", default=None, help="JSON file for the trace summary")
  args = ap.parse_args()
  given = json.loads(args.options) if args.options else {}
  # The benchmark's defaults are the Triton kernels' knobs; another implementation starts empty.
  opts = ({} if given.get("implementation", "triton") != "triton"
          else dict(bk.DEFAULT_OPTIONS[args.model].get(args.family, {})))
  opts.update(given)
  if args.trace_dir:
    if args.family != "palu" or opts.get("implementation") != "mosaic":
      raise ValueError("--trace_dir needs --family palu and --options "
                       "'{\"implementation\": \"mosaic\"}'")
    os.makedirs(args.trace_dir, exist_ok=True)
    opts["profile_dir"] = os.path.abspath(args.trace_dir)
  fn = build(args.family, args.model, args.context, args.batch, opts, args.v_bits)
  times = []
  for _ in range(args.calls):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  times.sort()
  print(f"{args.family} {args.model} S={args.context} B={args.batch} {opts}: "
        f"median {times[len(times) // 2] * 1e6:.1f} us over {args.calls} calls (first incl. compile)")
  if args.trace_dir:
    print("(with --trace_dir each call also copies and writes its trace: that time is not the "
          "kernel's)")
    traces = sorted(f for f in os.listdir(args.trace_dir) if f.endswith("-trace.json"))
    if not traces:
      raise RuntimeError(f"no *-trace.json written to {args.trace_dir}")
    hpp = opts.get("heads_per_program", 2)
    summary = mosaic_trace.summarize(os.path.join(args.trace_dir, traces[-1]), hpp + 1,
                                     ["compute"] * hpp + ["producer"])
    print(mosaic_trace.table(summary))
    if args.out:
      with open(args.out, "w") as f:
        json.dump(dict(family=args.family, model=args.model, context=args.context,
                       batch=args.batch, options={k: v for k, v in opts.items()
                                                  if k != "profile_dir"},
                       trace=traces[-1], summary=summary), f, indent=1)


if __name__ == "__main__":
  main()
