"""Tensor-core cost of the wgmma shapes the Palu Mosaic kernel issues (Hopper, Pallas Mosaic GPU).

The Palu kernel's value product o^T [rv, NP] += V^T [rv, T] @ p [T, NP] and its scores
s [T, NP] = r [T, H] @ q~^T [H, NP] have only NP = 8 (or 16) columns, the query heads of one
KV head. Whether such narrow wgmmas run at the tensor core's full rate decides whether the
kernel can reach its memory roofline. This probe measures it: every CTA (one per SM) runs
`wgs` warpgroups, each issuing `iters` dependent wgmmas acc [M, N] += A [M, K] @ B [K, N]
(A and B in shared memory in the kernel's layouts: the transposed views of [K, M] and [N, K]
bf16 buffers tiled (8, 64) with the 128-byte swizzle) and waiting for each, as the kernel
does. The operands are left uninitialised (the tensor core's speed does not depend on the
values). Reported per shape: ns per wgmma call, and the SM's multiply-accumulate rate as a
fraction of the bf16 matmul rate measured in the same run.

Usage (on the GPU machine):
  python experiments/bench_wgmma_shapes.py --out wgmma.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  pylint: disable=wrong-import-position

# (label, M, K, N): the Palu kernel's products at the paper's 50% setting (rk = 128,
# rv = 384, T = 64 tokens per tile), and wider-N variants of the value product.
SHAPES = (
    ("key reconstruction  L[T,rk] @ B_k[rk,H]", 64, 128, 128),
    ("scores  r[T,H] @ q~^T[H,8]", 64, 128, 8),
    ("scores, 16 columns", 64, 128, 16),
    ("value  V^T[rv,T] @ p[T,8]", 384, 64, 8),
    ("value, 16 columns (two KV heads)", 384, 64, 16),
    ("value, half rows x 16 columns", 192, 64, 16),
    ("value, 32 columns", 384, 64, 32),
    ("value, 64 columns", 384, 64, 64),
)


@functools.lru_cache(maxsize=None)
def probe(m, k, n, wgs, iters, ctas):
  """A jitted zero-argument function running the probe kernel once."""
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def entry(o_ref):
    def body(a_s, b_s):
      wg = jax.lax.axis_index("wg")
      for w in range(wgs):
        @pl.when(wg == w)
        def _(w=w):
          acc = plgpu.layout_cast(jnp.zeros((m, n), jnp.float32), plgpu.Layout.WGMMA)

          def step(_, acc):
            def mma(acc_ref):
              plgpu.wgmma(acc_ref, a_s.at[w].transpose((1, 0)),
                          b_s.at[w].transpose((1, 0)))
            return pl.run_state(mma)(plgpu.ACC.init(acc))
          acc = jax.lax.fori_loop(0, iters, step, acc)
          o_ref.at[jax.lax.axis_index("p"), w][...] = acc
    pl.run_scoped(body, plgpu.SMEM((wgs, k, m), jnp.bfloat16, transforms=tf),
                  plgpu.SMEM((wgs, n, k), jnp.bfloat16, transforms=tf), collective_axes="wg")

  call = plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((ctas, wgs, m, n), jnp.float32),
                      grid=(ctas,), grid_names=("p",), num_threads=wgs, thread_name="wg")
  return jax.jit(call)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="JSON results path")
  ap.add_argument("--iters", type=int, default=4096, help="wgmma calls per warpgroup")
  args = ap.parse_args(argv)
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    raise SystemExit("bench_wgmma_shapes.py needs a GPU")
  ctas = int(getattr(dev, "core_count", 132))
  tflops = bk.measure_ceilings()[2] / 1e12
  print(f"{dev.device_kind}: {ctas} SMs, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
  rows = []
  hdr = (f"{'shape':42s} {'M':>4s} {'K':>4s} {'N':>4s} {'WGs':>3s} {'ns/call':>8s} "
         f"{'ns/16-k step':>12s} {'% matmul':>8s}")
  print(hdr)
  for label, m, k, n in SHAPES:
    for wgs in (1, 2):
      sec, _ = bk.time_fn(probe(m, k, n, wgs, args.iters, ctas), samples=20)
      per_call = sec / args.iters
      macs = ctas * wgs * m * n * k * args.iters
      frac = 2 * macs / sec / (tflops * 1e12)
      rows.append(dict(shape=label, m=m, k=k, n=n, warpgroups=wgs, ns_per_call=per_call * 1e9,
                       ns_per_k16_m64=per_call * 1e9 / (m // 64 * k // 16),
                       fraction_of_matmul=frac))
      r = rows[-1]
      print(f"{label:42s} {m:4d} {k:4d} {n:4d} {wgs:3d} {r['ns_per_call']:8.1f} "
            f"{r['ns_per_k16_m64']:12.2f} {100 * frac:7.1f}%", flush=True)
  meta = dict(device=dev.device_kind, jax=jax.__version__, sms=ctas, matmul_tflops=tflops,
              iters=args.iters, date=datetime.date.today().isoformat())
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
