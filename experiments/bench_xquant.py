"""XQuant rematerialisation vs bf16 KV decode attention, one transformer layer, on GPU.

One device call: checks the Triton kernels against the jnp reference on small
shapes, measures the device's bf16 matmul rate and copy bandwidth, then times per
(model, batch, context):

  kv      bf16 K/V cache decode attention (XLA einsum + softmax; reads 2·S·kv_dim bf16)
  fused   XQuant Triton rematerialise-and-attend kernel (K/V only in registers)
  unfused Triton dequant-matmul writing K|V to HBM, then RoPE + XLA attention
  weights one layer's bf16 weight GEMV at this batch (what remat may hide under,
          the paper's Eq. 3/4 model)

Layer shapes: Llama-2-7B (MHA 32x128, D=4096; X path, one 2-bit X per token) and
Llama-3.1-8B (32q/8kv x128, D=4096; GQA latent path: X·U_k per channel, X·U_v per
token, 2-bit, Σ·Bᵀ 1024x1024). Quantization groups of 128, fp16 scale/zero.

Usage (device machine): python experiments/bench_xquant.py --out $OUT/bench_xquant.json
Prints a table; writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.model.rope import rope_cos_sin
from kvlowrank.quant import packed_words
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels.dequant_matmul import reference as ref
from kvlowrank_kernels.dequant_matmul import triton_backend as tb

MODELS = {
    # name: (spec, path, weight params per layer)
    "llama2-7b": (ModelSpec(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            head_dim=128, ffn_dim=11008), "x", 4 * 4096**2 + 3 * 4096 * 11008),
    "llama3.1-8b": (ModelSpec(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0),
                    "latent", 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336),
}


def paper_break_even(model: str, p_ridge: float, bits: int) -> float:
  """Context l where remat FLOPs / bytes = ridge point P (paper Eq. 3 and Eq. 4, as printed)."""
  d, e = 4096, bits
  if model == "llama2-7b":   # P = 4 l d² / (e/8 l d + 24 d²)
    return 24 * p_ridge * d**2 / (4 * d**2 - p_ridge * e / 8 * d)
  dg = 1024                  # d/g, g = 4: P = 4 l dg² / (e/8 l dg + 26 d² + 4 dg²)
  return p_ridge * (26 * d**2 + 4 * dg**2) / (4 * dg**2 - p_ridge * e / 8 * dg)


def timed(fn, args, perturb_idx, target_s=0.1):
  """Seconds per call: fn run `iters` times inside one jitted fori_loop; argument
  `perturb_idx` gets + 0·carry so no call is hoisted; median of 3 timings."""
  def loop(n, *a):
    def body(_, c):
      a2 = list(a)
      a2[perturb_idx] = a2[perturb_idx] + c.astype(a2[perturb_idx].dtype)
      out = fn(*a2)
      # A sum over the whole (small) output: a single-element read would let XLA
      # slice elementwise producers down to one element.
      return c + 0.0 * jnp.sum(out.astype(jnp.float32))
    return jax.lax.fori_loop(0, n, body, jnp.float32(0))
  jl = jax.jit(loop, static_argnums=0)
  jl(1, *args).block_until_ready()
  t0 = time.perf_counter()
  jl(1, *args).block_until_ready()
  one = max(time.perf_counter() - t0, 1e-6)
  iters = int(min(max(target_s / one, 3), 200))
  jl(iters, *args).block_until_ready()
  ts = []
  for _ in range(3):
    t0 = time.perf_counter()
    jl(iters, *args).block_until_ready()
    ts.append((time.perf_counter() - t0) / iters)
  return float(np.median(ts))


def packed(key, b, s, c, bits, axis, group=128):
  """Random packed rows: uniform random code words (every bit pattern is a valid code
  set) and fp16 scales/zeros, built without a [B,S,C] fp32 intermediate (GPU memory)."""
  k1, k2 = jax.random.split(key)
  words = jax.random.bits(k1, (b, s, packed_words(c, bits)), jnp.uint32)
  sshape = (b, s, c // group) if axis == "token" else (b, s // group, c)
  sc = jax.random.uniform(k2, sshape, jnp.float32, 0.01, 0.1)
  zr = -sc * (2**bits - 1) / 2
  return ref.PackedRows(codes=words, scale=sc.astype(jnp.float16), zero=zr.astype(jnp.float16),
                        bits=bits, axis=axis, group=group)


def kv_attention(q, k, v, lens):
  """bf16 KV decode attention (XLA): q [B,N,H], k/v [B,S,K,H] post-RoPE."""
  b, n, h = q.shape
  kh = k.shape[2]
  qg = q.reshape(b, kh, n // kh, h)
  sc = jnp.einsum("bkgh,bskh->bkgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(h)
  sc = jnp.where((jnp.arange(k.shape[1])[None, :] < lens[:, None])[:, None, None], sc, -jnp.inf)
  p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgs,bskh->bkgh", p, v, preferred_element_type=jnp.float32).reshape(b, n, h)


def setup(model, b, s, bits, key):
  spec, path, _ = MODELS[model]
  kd, h, kh = spec.kv_dim, spec.head_dim, spec.n_kv_heads
  ks = jax.random.split(key, 8)
  bf = jnp.bfloat16
  if path == "x":
    k_rows, v_rows = packed(ks[0], b, s, spec.dim, bits, "token"), None
    wk = (0.02 * jax.random.normal(ks[1], (spec.dim, kd))).astype(bf)
    wv = (0.02 * jax.random.normal(ks[2], (spec.dim, kd))).astype(bf)
  else:
    k_rows = packed(ks[0], b, s, kd, bits, "channel")
    v_rows = packed(ks[3], b, s, kd, bits, "token")
    wk = (0.05 * jax.random.normal(ks[1], (kd, kd))).astype(bf)
    wv = (0.05 * jax.random.normal(ks[2], (kd, kd))).astype(bf)
  bias = jnp.zeros((kd,), bf)
  cos, sin = rope_cos_sin(jnp.arange(s), spec)
  q = jax.random.normal(ks[4], (b, spec.n_heads, h), jnp.float32).astype(bf)
  lens = jnp.full((b,), s, jnp.int32)
  return dict(spec=spec, path=path, k_rows=k_rows, v_rows=v_rows, wk=wk, wv=wv, bias=bias,
              cos=cos, sin=sin, q=q, lens=lens, kh=kh)


# Tried in order; the first that compiles and matches the reference is used (shared
# memory and register limits differ between configurations and GPUs).
FUSED_CONFIGS = (dict(block_s=64, num_warps=8, num_stages=2),
                 dict(block_s=64, num_warps=4, num_stages=1),
                 dict(block_s=32, num_warps=4, num_stages=1),
                 dict(block_s=16, num_warps=4, num_stages=1, block_k=32))
DM_CONFIGS = (dict(block_m=64, block_n=128, num_warps=4, num_stages=2),
              dict(block_m=64, block_n=64, num_warps=4, num_stages=1),
              dict(block_m=32, block_n=64, num_warps=4, num_stages=1, block_k=32))


def _rel(got, want):
  return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def check_kernels(key, tol=2e-2):
  """Per model: the first working config of each kernel, and its relative error vs
  the jnp reference for bits 2/3/4 (small shapes, one row with a short length)."""
  errs, chosen = {}, {}
  flat = lambda a: a.reshape(-1, a.shape[-1])
  for model in MODELS:
    for bits in (2, 3, 4):
      d = setup(model, 2, 384, bits, key)
      args = (d["q"], d["k_rows"], d["v_rows"], d["wk"], d["wv"], d["bias"], d["bias"],
              d["cos"], d["sin"], jnp.array([384, 200], jnp.int32))
      want = ref.remat_decode_attention(*args, n_kv_heads=d["kh"])
      kr = d["k_rows"]
      w = d["wk"] if d["v_rows"] is not None else jnp.concatenate([d["wk"], d["wv"]], 1)
      want_dm = ref.dequant_matmul(flat(kr.codes), flat(kr.scale), flat(kr.zero), w,
                                   bits=bits, axis=kr.axis, group=kr.group)
      for name, cfgs, run in (
          ("fused", FUSED_CONFIGS,
           lambda c: tb.remat_decode_attention(*args, n_kv_heads=d["kh"], **c)),
          ("dm", DM_CONFIGS,
           lambda c: tb.dequant_matmul(flat(kr.codes), flat(kr.scale), flat(kr.zero), w,
                                       bits=bits, axis=kr.axis, group=kr.group, **c))):
        target = want if name == "fused" else want_dm
        ck = (name, model)
        todo = [chosen[ck]] if ck in chosen else list(range(len(cfgs)))
        for i in todo:
          tag = f"{name}/{model}/{bits}/cfg{i}"
          try:
            errs[tag] = _rel(run(cfgs[i]), target)
          except Exception as e:  # pylint: disable=broad-except
            errs[tag] = repr(e)[:200]
            continue
          if errs[tag] < tol:
            chosen.setdefault(ck, i)
            break
  return errs, {f"{k[0]}/{k[1]}": v for k, v in chosen.items()}


def ceilings(key):
  """Measured bf16 matmul TFLOP/s (8192³) and device copy bandwidth (bytes read+written)."""
  a = jax.random.normal(key, (8192, 8192), jnp.float32).astype(jnp.bfloat16)
  t = timed(lambda x: x @ a, (a,), 0)
  x = jax.random.normal(key, (256 * 1024 * 1024,), jnp.float32).astype(jnp.bfloat16)  # 512 MB
  scale = jax.jit(lambda y: y * 1.0001)   # timed per call: the full output is written
  scale(x).block_until_ready()
  tcs = []
  for _ in range(10):
    t0 = time.perf_counter()
    scale(x).block_until_ready()
    tcs.append(time.perf_counter() - t0)
  tc = float(np.median(tcs))
  return {"bf16_tflops": 2 * 8192**3 / t / 1e12, "copy_tb_s": 2 * x.nbytes / tc / 1e12}


_WEIGHTS = {}


def weights_time(model, b, key):
  """One layer's bf16 weight GEMV at batch b (memoised per model and batch)."""
  if (model, b) not in _WEIGHTS:
    spec, _, n_w = MODELS[model]
    w = (0.02 * jax.random.normal(key, (spec.dim, n_w // spec.dim), jnp.float32)
         ).astype(jnp.bfloat16)
    x = jax.random.normal(key, (b, spec.dim), jnp.float32).astype(jnp.bfloat16)
    _WEIGHTS[(model, b)] = timed(lambda x: x @ w, (x,), 0)
  return _WEIGHTS[(model, b)]


def measure(model, b, s, bits, key, unfused_max_tokens, fcfg, dcfg):
  d = setup(model, b, s, bits, key)
  spec, kh, h = d["spec"], d["kh"], d["spec"].head_dim
  row = {"model": model, "batch": b, "context": s, "bits": bits}
  # bf16 KV baseline (K already rotated in the cache).
  k = jax.random.normal(key, (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(jax.random.split(key)[0], (b, s, kh, h), jnp.bfloat16)
  row["kv_s"] = timed(lambda q, k, v, l: kv_attention(q, k, v, l), (d["q"], k, v, d["lens"]), 0)
  del k, v
  fused = lambda q: tb.remat_decode_attention(q, d["k_rows"], d["v_rows"], d["wk"], d["wv"],
                                              d["bias"], d["bias"], d["cos"], d["sin"],
                                              d["lens"], n_kv_heads=kh, **fcfg)
  row["fused_s"] = timed(fused, (d["q"],), 0)
  c = d["wk"].shape[0]
  row["remat_flop"] = 2 * b * s * (c * spec.kv_dim + d["wv"].shape[0] * spec.kv_dim)
  row["fused_tflops"] = row["remat_flop"] / row["fused_s"] / 1e12
  if dcfg is not None and b * s <= unfused_max_tokens:
    kr, vr = d["k_rows"], d["v_rows"]
    flat = lambda a: a.reshape(-1, a.shape[-1])

    def unfused(q, kzero):
      kp = tb.dequant_matmul(flat(kr.codes), flat(kr.scale), kzero, d["wk"] if vr is not None
                             else jnp.concatenate([d["wk"], d["wv"]], 1), bits=bits,
                             axis=kr.axis, group=kr.group, out_dtype=jnp.bfloat16, **dcfg)
      if vr is None:
        kk, vv = kp[:, :spec.kv_dim], kp[:, spec.kv_dim:]
      else:
        kk = kp
        vv = tb.dequant_matmul(flat(vr.codes), flat(vr.scale), flat(vr.zero), d["wv"],
                               bits=bits, axis=vr.axis, group=vr.group, out_dtype=jnp.bfloat16,
                               **dcfg)
      kk = ref.rope_half(kk.reshape(b, s, kh, h).astype(jnp.float32), d["cos"], d["sin"])
      return kv_attention(q, kk.astype(jnp.bfloat16), vv.reshape(b, s, kh, h), d["lens"])
    try:
      row["unfused_s"] = timed(unfused, (d["q"], flat(kr.zero)), 1)
    except Exception as e:  # pylint: disable=broad-except
      row["unfused_error"] = repr(e)[:200]
  row["weights_s"] = weights_time(model, b, key)
  row["kv_bytes"] = 2 * b * s * spec.kv_dim * 2
  return row


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench_xquant.json")
  ap.add_argument("--bits", type=int, default=2)
  ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--models", default="llama2-7b,llama3.1-8b")
  ap.add_argument("--unfused_max_tokens", type=int, default=65536)
  ap.add_argument("--budget_s", type=float, default=330.0)
  args = ap.parse_args(argv)
  if not tb.available():
    raise SystemExit("bench_xquant needs a CUDA GPU with jax-triton (none found)")
  t_start = time.time()
  key = jax.random.key(0)
  checks, chosen = check_kernels(key)
  res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
         "checks": checks, "configs": {k: (FUSED_CONFIGS if k.startswith("fused") else
                                           DM_CONFIGS)[v] for k, v in chosen.items()},
         "ceilings": ceilings(key), "rows": []}
  print("kernel checks (rel. error vs jnp reference):", json.dumps(res["checks"]), flush=True)
  print("configs:", json.dumps(res["configs"]), flush=True)
  print("ceilings:", json.dumps(res["ceilings"]), flush=True)
  p_ridge = res["ceilings"]["bf16_tflops"] / res["ceilings"]["copy_tb_s"]
  res["break_even"] = {m: {"paper_h100_p378": paper_break_even(m, 378.0, args.bits),
                           "roofline_this_device": paper_break_even(m, p_ridge, args.bits)}
                       for m in MODELS}
  grid = sorted(((b, s) for b in map(int, args.batches.split(","))
                 for s in map(int, args.contexts.split(","))), key=lambda bs: bs[0] * bs[1])
  for b, s in grid:   # cheapest first: the budget cuts the largest shapes
    for model in args.models.split(","):
      if time.time() - t_start > args.budget_s:
        print(f"time budget reached; skipped {model} B={b} S={s}", flush=True)
        continue
      fcfg, dcfg = res["configs"].get(f"fused/{model}"), res["configs"].get(f"dm/{model}")
      if fcfg is None:
        print(f"no working fused config for {model}; skipped", flush=True)
        continue
      try:
        row = measure(model, b, s, args.bits, key, args.unfused_max_tokens, fcfg, dcfg)
      except Exception as e:  # pylint: disable=broad-except  (keep the other rows)
        row = {"model": model, "batch": b, "context": s, "error": repr(e)[:300]}
      res["rows"].append(row)
      print(json.dumps(row), flush=True)
      with open(args.out, "w") as f:   # after every row: a timeout keeps what was measured
        json.dump(res, f, indent=1)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
  print_table(res)


def print_table(res):
  print(f"\n{res['device']}  jax {res['jax']}  bf16 {res['ceilings']['bf16_tflops']:.0f} TFLOP/s"
        f"  copy {res['ceilings']['copy_tb_s']:.2f} TB/s")
  for m, be in res["break_even"].items():
    print(f"  {m}: roofline break-even l = {be['roofline_this_device']:.0f} (this device), "
          f"{be['paper_h100_p378']:.0f} (paper H100, P=378)")
  hdr = (f"{'model':12s} {'B':>3s} {'S':>6s} {'kv_us':>9s} {'fused_us':>9s} {'unfus_us':>9s} "
         f"{'w_us':>8s} {'TFLOP/s':>8s} {'xq/kv':>6s} {'layer xq/kv':>11s}")
  print(hdr)
  for r in sorted(res["rows"], key=lambda r: (r["model"], r["batch"], r["context"])):
    if "error" in r:
      print(f"{r['model']:12s} {r['batch']:3d} {r['context']:6d} ERROR {r['error'][:80]}")
      continue
    us = lambda k: f"{1e6 * r[k]:9.1f}" if k in r else f"{'-':>9s}"
    layer = (r["weights_s"] + r["fused_s"]) / (r["weights_s"] + r["kv_s"])
    print(f"{r['model']:12s} {r['batch']:3d} {r['context']:6d} {us('kv_s')} {us('fused_s')} "
          f"{us('unfused_s')} {1e6 * r['weights_s']:8.1f} {r['fused_tflops']:8.1f} "
          f"{r['fused_s'] / r['kv_s']:6.2f} {layer:11.2f}")


if __name__ == "__main__":
  sys.exit(main())
