"""Does `bench_kernels.time_op`'s executable length change the measured time per call? (GPU)

Times four kernels (KIVI Mosaic and Triton, Palu Mosaic, cuDNN dense) at two Llama-3
configurations with 2 / 10 / 30 ms chained executables, twice, and writes the µs per call
to JSON. BENCHMARKS.md (twelfth session) has the result that set `time_op`'s defaults.

  python experiments/timing_chain_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  pylint: disable=wrong-import-position

CONFIGS = (("llama3-8b", 65536, 32), ("llama3-8b", 16384, 8))
CHAINS = ((2e-3, 32), (10e-3, 64), (30e-3, 256))  # (chain_s, max_chain)


def probe(model, s, b, reps=2):
  """{label: µs per call}."""
  m = bk.MODELS[model]
  key = jax.random.key(s * 131 + b)
  kin = bk.kivi_inputs(m, s, b, key)
  pin, _ = bk.palu_inputs(m, s, b, key, 16)
  din = bk.dense_inputs(m, s, b, key)
  fns = {"kivi-mosaic": bk.kivi_mosaic_fn(kin, {}),
         "kivi-2bit": bk.kivi_fn(kin, bk.DEFAULT_OPTIONS[model]["kivi"]),
         "palu-mosaic": bk.palu_fn(pin, {}, "mosaic"),
         "dense-cudnn": bk.dense_fns(din, {})["dense-cudnn"]}
  out = {}
  for rep in range(reps):
    for name, (f, args) in fns.items():
      for chain_s, max_chain in CHAINS:
        us = bk.time_op(f, args, chain_s=chain_s, max_chain=max_chain) * 1e6
        label = f"{model} {s} {b} {name} chain={chain_s * 1e3:.0f}ms rep{rep}"
        out[label] = us
        print(f"{label}: {us:.1f} us", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON path")
  args = ap.parse_args(argv)
  out = {}
  for model, s, b in CONFIGS:
    out.update(probe(model, s, b))
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
