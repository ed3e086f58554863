"""Instruction mix of the KIVI / Palu decode kernels' hot loops, compiled for sm_90a anywhere.

Triton cross-compiles without a GPU (`triton.compile(..., target=GPUTarget("cuda", 90, 32))`)
and its wheel ships `cuobjdump`, so the SASS of a configuration can be read on the CPU box:

  python experiments/probes/sass_stats.py --qpk 1 --block_s 32 --num_warps 2 --num_stages 3 --fp16
  python experiments/probes/sass_stats.py --kernel palu --qpk 4 --block_s 128 --num_warps 8 --num_stages 1

prints registers, shared memory and, for each loop of the kernel (a backward branch), its
instruction count and opcode histogram. The quantized-prefix loop is the long one: its count
per warp and 32-token tile, against the HBM bytes that tile carries, says whether the kernel
can reach the memory roofline at all (the H200 issues ~1.05e12 warp-instructions/s in all).
Needs `triton` (3.6) and this repository installed (`kvlowrank_kernels`). The constexprs
come from each kernel's own launch plan (`triton_kivi.plan`, `triton_palu_launch.plan`), so
they follow the kernels; the runtime-argument types below must match their signatures.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess


def _compile_sm90(fn, sig, const, num_warps, num_stages):
  """(cubin, shared bytes) of Triton kernel `fn` for sm_90a: `sig` types its runtime
  arguments, `const` its constexprs; every pointer is declared 16-byte aligned."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel
  sig = dict(sig, **{k: "constexpr" for k in const})
  attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
           if sig[n].startswith("*")}
  k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                     target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=num_warps, num_stages=num_stages))
  return k.asm["cubin"], k.metadata.shared


def compile_kivi(qpk, block_s, num_warps, num_stages, fp16, bits=2, head_dim=128, group=32):
  """(cubin, shared bytes) of `triton_kivi.kivi_kernel` for sm_90a (planar layout, groups of 32).

  32 query heads of `head_dim`, 32 // qpk KV heads, 16K tokens (the shape only sets the
  split count, not the loop's code).
  """
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from kvlowrank_kernels.kivi import KiviKeys, KiviValues, triton_kivi
  # pylint: enable=import-outside-toplevel
  fn = triton_kivi.kivi_kernel
  kh, s, nb = 32 // qpk, 16384, head_dim * bits // 8
  sd = jnp.float16 if fp16 else jnp.bfloat16
  spec = lambda *shape, dtype=sd: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  keys = KiviKeys(codes=spec(8, kh, s, nb, dtype=jnp.uint8), scale=spec(8, kh, s // group,
                  head_dim), zero=spec(8, kh, s // group, head_dim), bits=bits, group=group)
  values = KiviValues(codes=spec(8, kh, s, nb, dtype=jnp.uint8), scale=spec(
      8, kh, s, head_dim // group), zero=spec(8, kh, s, head_dim // group), bits=bits,
                      group=group)
  const = triton_kivi.plan((8, 32, head_dim), keys, values, 128, block_s=block_s,
                           fast=True)["constexprs"]
  sdt = "*fp16" if fp16 else "*bf16"
  sig = dict(q_ptr="*bf16", kc_ptr="*u8", ks_ptr=sdt, kz_ptr=sdt, vc_ptr="*u8", vs_ptr="*i32",
             vz_ptr="*i32", kw_ptr="*bf16", vw_ptr="*bf16", qlen_ptr="*i32", wlen_ptr="*i32",
             S="i32", W="i32", NSPLIT="i32", sm_scale="fp32", o_init="*fp32", lse_init="*fp32",
             o_ptr="*fp32", lse_ptr="*fp32")
  return _compile_sm90(fn, sig, const, num_warps, num_stages)


def compile_palu(qpk, block_s, num_warps, num_stages, hpp=None, v_bits=16):
  """(cubin, shared bytes) of `triton_palu.latent_kernel` for sm_90a at Palu's benchmark shape.

  32 query heads of 128, 32 // qpk KV heads in groups of 4, rk = 128, rv = 384 (the 50%
  G-LRD setting of `bench_kernels.py`), bf16 key latents, bf16 or packed value latents.
  """
  # pylint: disable-next=import-outside-toplevel
  from kvlowrank_kernels.palu import triton_palu, triton_palu_launch as launch
  fn = triton_palu.latent_kernel
  gr, rk, rv = 32 // qpk // 4, 128, 384
  const = launch.plan((8, 32, 128), (8, 16384, gr, rk), (8, 16384, gr, rv), (gr, rk, 512),
                      vbits=v_bits, block_s=block_s, heads_per_program=hpp)["constexprs"]
  packed = v_bits != 16
  sig = dict(q_ptr="*bf16", hk_ptr="*bf16", hks_ptr="*i32", hkz_ptr="*i32",
             hv_ptr="*u8" if packed else "*bf16", hvs_ptr="*bf16" if packed else "*i32",
             hvz_ptr="*bf16" if packed else "*i32", bk_ptr="*bf16", bias_ptr="*i32",
             pq_ptr="*bf16" if const["ABSORB"] else "*i32", pqb_ptr="*i32", rope_ptr="*fp32",
             len_ptr="*i32", S="i32", NSPLIT="i32", sm_scale="fp32", o_init="*fp32",
             lse_init="*fp32", o_ptr="*fp32", lse_ptr="*fp32")
  return _compile_sm90(fn, sig, const, num_warps, num_stages)


def sass_loops(cubin: bytes):
  """(registers, [(start, end, n_instructions, Counter of opcodes)] per backward branch)."""
  import triton  # pylint: disable=import-outside-toplevel
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  path = "/tmp/kvlowrank_sass.cubin"
  with open(path, "wb") as f:
    f.write(cubin)
  sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
  res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True)
  regs = int(re.search(r"REG:(\d+)", res.stdout).group(1))
  ins = [(int(m.group(1), 16), m.group(2)) for m in
         (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines())
         if m]
  loops = []
  for addr, text in ins:
    m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
    if m and int(m.group(1), 16) < addr:
      start = int(m.group(1), 16)
      body = [t for a, t in ins if start <= a <= addr]
      ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
      loops.append((start, addr, len(body), ops))
  return regs, loops


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kernel", choices=("kivi", "palu"), default="kivi")
  ap.add_argument("--qpk", type=int, default=1, help="query heads per KV head (1: MHA)")
  ap.add_argument("--heads_per_program", type=int, default=None, help="Palu only")
  ap.add_argument("--block_s", type=int, default=32)
  ap.add_argument("--num_warps", type=int, default=2)
  ap.add_argument("--num_stages", type=int, default=3)
  ap.add_argument("--fp16", action="store_true", help="fp16 scale/zero (else bf16)")
  ap.add_argument("--top", type=int, default=16)
  args = ap.parse_args()
  if args.kernel == "palu":
    cubin, smem = compile_palu(args.qpk, args.block_s, args.num_warps, args.num_stages,
                               args.heads_per_program)
  else:
    cubin, smem = compile_kivi(args.qpk, args.block_s, args.num_warps, args.num_stages,
                               args.fp16)
  regs, loops = sass_loops(cubin)
  scales = "" if args.kernel == "palu" else f" {'fp16' if args.fp16 else 'bf16'} scales"
  print(f"{args.kernel} qpk={args.qpk} block_s={args.block_s} warps={args.num_warps} "
        f"stages={args.num_stages}{scales}: {regs} registers, {smem} B shared memory")
  longest = max((n for _, _, n, _ in loops), default=0)
  for start, end, n, ops in loops:
    if args.kernel == "palu":
      what = f"per warp per {args.block_s}-token tile"
    else:
      # The longest loop is the quantized prefix (block_s tokens per iteration); the other
      # one is the exact window (32-token tiles).
      per = n * 32 / args.block_s if n == longest else n
      what = (f"{per:.0f} per warp per 32 tokens, "
              f"{'quantized prefix' if n == longest else 'exact window'}")
    print(f"loop {start:#x}-{end:#x}: {n} instructions ({what})")
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top)))


if __name__ == "__main__":
  main()
