"""Registers, spills and shared memory of every Triton kernel jax-triton compiled in a run.

Run a benchmark with JAX_TRITON_DUMP_DIR=DIR (jax-triton then writes each
compiled kernel's PTX and its shared-memory size under DIR/<hash>/), then

  python experiments/probes/ptx_stats.py DIR [--out stats.json]

assembles each PTX with the ptxas that ships in Triton's wheel (`-v`, sm_90a)
and prints one row per kernel: name, the compile options and constexprs from
jax-triton's config file (block sizes, warps, stages), registers per thread,
spill stores/loads (bytes) and shared memory. Spills or > 1 CTA/SM worth of
shared memory explain slow kernels without hardware counters.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess


def ptxas_path() -> str:
  import triton  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  if not os.path.exists(path):
    raise FileNotFoundError(f"ptxas not found at {path}")
  return path


def _config_summary(cfg_text: str) -> str:
  """Warps, stages and the tiling constexprs from jax-triton's config dump (a pprint of
  its cache key, where constexprs appear as ('NAME', value) pairs, then CUDAOptions(...))."""
  keep = []
  for key in ("num_warps", "num_stages"):
    m = re.search(rf"{key}=(\d+)", cfg_text)
    if m:
      keep.append(f"{key}={m.group(1)}")
  names = r"BLOCK_\w+|TRANS|ABSORB|KBITS|VBITS|QP|NQP|G|SKIP|HPP"
  for m in re.finditer(rf"\('({names})', (\w+)\)", cfg_text):
    keep.append(f"{m.group(1)}={m.group(2)}")
  return " ".join(dict.fromkeys(keep))


def stats(dump_dir: str, arch: str = "sm_90a"):
  """One dict per dumped kernel."""
  ptxas = ptxas_path()
  rows = []
  for ptx in sorted(glob.glob(os.path.join(dump_dir, "*", "*.ptx"))):
    d = os.path.dirname(ptx)
    cfg = open(os.path.join(d, "config"), encoding="utf-8").read() if os.path.exists(
        os.path.join(d, "config")) else ""
    info = glob.glob(os.path.join(d, "*.compile_info"))
    smem = None
    if info:
      m = re.search(r"shared_mem_bytes: (\d+)", open(info[0], encoding="utf-8").read())
      smem = int(m.group(1)) if m else None
    proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", ptx, "-o", os.devnull],
                          capture_output=True, text=True, check=False)
    text = proc.stderr + proc.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    rows.append(dict(kernel=os.path.basename(ptx)[:-4], config=_config_summary(cfg),
                     registers=int(regs.group(1)) if regs else None,
                     spill_stores=int(spill.group(1)) if spill else None,
                     spill_loads=int(spill.group(2)) if spill else None,
                     shared_bytes=smem, ptxas_ok=proc.returncode == 0))
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("dump_dir")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = stats(args.dump_dir)
  print(f"{'kernel':28s} {'regs':>5s} {'spill st/ld':>12s} {'smem KiB':>9s}  config")
  for r in rows:
    sp = f"{r['spill_stores']}/{r['spill_loads']}"
    sm = f"{r['shared_bytes'] / 1024:.0f}" if r["shared_bytes"] is not None else "?"
    print(f"{r['kernel'][:28]:28s} {r['registers'] or '?':>5} {sp:>12s} {sm:>9s}  {r['config']}")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
