"""Compiles the ragged rotated kernels (bf16 and planar-code operands, and the one-launch
records and combine around them) for sm_90 with the
Triton wheel's ptxas: no GPU needed (`python tests/kernels/aot_compile_check.py`), and prints
each kernel's registers per thread and spills (`ptxas -v`, sm_90a). A compile error here is one
the device would raise; the semantics are the interpreter checks'."""
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia_compiler
from triton.compiler import ASTSource

from kvlowrank_kernels.rotated import triton_combine as tc
from kvlowrank_kernels.rotated import triton_ragged as tr
from kvlowrank_kernels.rotated import triton_records as trr
from kvlowrank_kernels.rotated import triton_ragged_quant as trq

TARGET = GPUTarget("cuda", 90, 64)
COMMON = dict(G=4, GP=16, GC=16, SK=512, SV=512, KW=256, VW=256, BLOCK_S=64)
PTRS = {"rec_ptr": "*i32", "row_ptr": "*i32", "S": "i32", "sm_scale": "fp32", "o_init": "*fp32",
        "lse_init": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}


def compile_kernel(fn, pointers, constexprs, num_warps=4, common=PTRS):
  sig = {**pointers, **common, **{k: "constexpr" for k in constexprs}}
  # Pointers 16-byte aligned and S a multiple of 16, as jax-triton's launches specialise them.
  attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
           if ty.startswith("*") or name == "S"}
  k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                     target=TARGET, options=dict(num_warps=num_warps, num_stages=2))
  print(f"{k.metadata.name} ({num_warps} warps): compiled for sm_90, {k.metadata.shared} bytes "
        f"of shared memory; {ptxas_usage(k.asm['ptx'])}")


def ptxas_usage(ptx: str) -> str:
  """ptxas -v's registers and spills of one kernel's PTX."""
  tool = nvidia_compiler.get_ptxas(TARGET.arch)
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "k.ptx")
    with open(path, "w", encoding="utf-8") as f:
      f.write(ptx)
    err = subprocess.run([getattr(tool, "path", tool), "-v", "--gpu-name=sm_90a", path, "-o",
                          os.path.join(d, "k.o")], capture_output=True, text=True,
                         check=True).stderr
  return "; ".join(line.split(":", 1)[-1].strip() for line in err.splitlines()
                   if "registers" in line or "spill" in line)


if __name__ == "__main__":
  if os.environ.get("TRITON_INTERPRET"):
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels")
  compile_kernel(tr.ragged_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16"},
                 COMMON)
  for bits, kcw in ((4, 32), (2, 32), (2, 8)):
    compile_kernel(trq.ragged_quant_kernel,
                   {"q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*bf16", "kz_ptr": "*bf16",
                    "vc_ptr": "*u8", "vs_ptr": "*fp16", "vz_ptr": "*fp16"},
                   dict(COMMON, BLOCK_S=32, BITS=bits, KCW=kcw, VCW=16, VB=32, KF16=False,
                        VF16=True, FAST=True), num_warps=2)
  # Llama-3-8B 32K x 8 (cache default plan): 264 row tasks of 3 groups; 8 KV heads, G = 4.
  compile_kernel(trr.rows_records_kernel, {"len_ptr": "*i32", "slot_ptr": "*i32",
                                           "gtab_ptr": "*i32", "capacity": "i32",
                                           "rec_ptr": "*i32"},
                 dict(N_ROWS=264, NC=33, NG=3, NGP=4, CT=1024, RB=trr.RB, RC=512, FIELDS=9),
                 common={})
  compile_kernel(tc.combine_kernel, {"o_ptr": "*fp32", "lse_ptr": "*fp32", "tab_ptr": "*i32",
                                     "out_ptr": "*bf16", "tot_ptr": "*fp32"},
                 dict(NC=33, NG=3, K=8, G=4, GP=16, GC=4, VW=256, WB=32, CB=64, SB=8 * 4 * 96,
                      SH=4 * 96, SG=96, HEADS=True, W=96), common={})
