"""XQuant rematerialisation vs bf16 KV decode attention, one transformer layer, on GPU.

One device call: checks the kernels against the jnp reference on small shapes,
measures the device's ceilings (`kvlowrank.bench.measure_ceilings`: bf16 matmul rate,
copy and read-only bandwidth), then times per (model, batch, context), cheapest first,
until --budget_s:

  kv        bf16 K/V cache decode attention (XLA; reads 2·S·kv_dim bf16 per row)
  fused     GEMM-shaped Triton rematerialise-and-attend kernel (`triton_remat`)
  xla       XLA rematerialisation: bf16 dequant, cuBLAS GEMM (bf16 in, fp32 acc) writing
            K|V, RoPE, XLA attention (`kvlowrank_kernels.xquant.xla`): the library baseline
  xla_vlate the same with W_v applied after attention ((sum_t p_t X̂_t) W_v, exact):
            only K is rematerialised (`xla.remat_decode_attention_vlate`)
  w         one layer's bf16 weight GEMV at this batch (what remat may hide under,
            the paper's Eq. 3/4 model)

Layer shapes: Llama-2-7B (MHA 32x128, D=4096; X path, one X row per token) and
Llama-3.1-8B (32q/8kv x128, D=4096; GQA latent path: X·U_k per channel, X·U_v per
token, Σ·Bᵀ 1024x1024). --bits (2) codes, groups of 128, fp16 scale/zero.

Usage (device machine):
  python experiments/bench_xquant.py --out $OUT/bench_xquant.json
  python experiments/bench_xquant.py --quick            # knob sweep, one shape per path
The default shapes cover Llama-2-7B B=1 S=1K..16K, B=8 S=16K/32K, B=32 S=4K..32K and
Llama-3.1-8B B=1 S=1K..16K, B=32 S=32K; --budget_s (wall seconds since start) skips the
most expensive remaining shapes once spent.
Inputs are seeded random fills (`kvlowrank.bench.rand`, `rand_u8`); the JSON is headed by
`kvlowrank.bench.environment()` (device, versions, date) and the command line.
Every column is timed by `timed` (a jitted loop; its docstring says why not `time_op`).
Prints a table; writes every number as JSON (results: BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.bench import environment, measure_ceilings, rand, rand_u8
from kvlowrank.model.rope import rope_cos_sin
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels.quant import packed_words
from kvlowrank_kernels.xquant import reference as ref
from kvlowrank_kernels.xquant import triton_backend as tb
from kvlowrank_kernels.xquant import xla as xq

MODELS = {
    # name: (spec, path, weight params per layer)
    "llama2-7b": (ModelSpec(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                            head_dim=128, ffn_dim=11008), "x", 4 * 4096**2 + 3 * 4096 * 11008),
    "llama3.1-8b": (ModelSpec(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0),
                    "latent", 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336),
}
K1 = 1024
SHAPES = ([("llama2-7b", 1, s * K1) for s in (1, 2, 4, 8, 16)]
          + [("llama3.1-8b", 1, s * K1) for s in (1, 2, 4, 8, 16)]
          + [("llama2-7b", 8, 16 * K1), ("llama2-7b", 8, 32 * K1)]
          + [("llama2-7b", 32, s * K1) for s in (4, 8, 16, 32)]
          + [("llama3.1-8b", 32, 32 * K1)])
QUICK_SHAPES = {"llama2-7b": (8, 8 * K1), "llama3.1-8b": (32, 8 * K1)}
FUSED_DEFAULT = dict(block_m=64, block_k=64, num_warps=8, num_stages=3)


def timed(fn, args, perturb_idx, target_s=0.1):
  """Seconds per call: fn run `iters` times inside one jitted fori_loop; argument
  `perturb_idx` gets + 0·carry so no call is hoisted; median of 3 timings.

  Not `kvlowrank.bench.time_op`: its `chained` unrolls the calls in one executable, and
  the XLA baselines' rematerialisation (dequant, X̂·W, RoPE) does not depend on the query,
  so XLA's CSE computes it once per chain and `xla` / `xla_vlate` would time attention
  alone; `chained` also reads one output element, which lets XLA slice pure-XLA ops
  (`kv`, `w`) down. Here the call stands once in a loop body and the whole output is
  summed. Loop-invariant code motion could still hoist the query-independent part out of
  the loop (XLA's CPU pipeline does; a GPU run shows it as an `xla` FLOP rate that grows
  with the loop length). Every column is timed this way, so the table's ratios compare
  like with like.
  """
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


def _uniform(key, shape, std, dtype=jnp.bfloat16):
  """Uniform values of standard deviation `std` (`rand`: [-1, 1) has std 1/sqrt(3))."""
  return rand(key, tuple(shape), jnp.dtype(dtype)) * (std * math.sqrt(3))


def packed(key, b, s, c, bits, axis, group=128):
  """Random packed rows: random code words (`rand_u8` bytes read as uint32: every bit
  pattern is a valid code set) and fp16 scales in [0.01, 0.1) with zero = -scale·(2^bits-1)/2,
  built without a [B,S,C] fp32 intermediate (GPU memory)."""
  k1, k2 = jax.random.split(key)
  words = jax.lax.bitcast_convert_type(rand_u8(k1, (b, s, packed_words(c, bits), 4)),
                                       jnp.uint32)
  sshape = (b, s, c // group) if axis == "token" else (b, s // group, c)
  sc = 0.055 + 0.045 * rand(k2, sshape, jnp.dtype(jnp.float32))
  zr = -sc * (2**bits - 1) / 2
  return ref.PackedRows(codes=words, scale=sc.astype(jnp.float16), zero=zr.astype(jnp.float16),
                        bits=bits, axis=axis, group=group)


def setup(model, b, s, bits, key, lens=None):
  """Inputs of one layer's decode attention (all slots valid unless lens is given)."""
  spec, path, _ = MODELS[model]
  kd, h = spec.kv_dim, spec.head_dim
  ks = jax.random.split(key, 8)
  bf = jnp.bfloat16
  if path == "x":
    k_rows, v_rows, c = packed(ks[0], b, s, spec.dim, bits, "token"), None, spec.dim
  else:
    k_rows, c = packed(ks[0], b, s, kd, bits, "channel"), kd
    v_rows = packed(ks[3], b, s, kd, bits, "token")
  wk = _uniform(ks[1], (c, kd), c ** -0.5)
  wv = _uniform(ks[2], (c, kd), c ** -0.5)
  bias = jnp.zeros((kd,), bf)
  cos, sin = rope_cos_sin(jnp.arange(s), spec)
  q = _uniform(ks[4], (b, spec.n_heads, h), 1.0)
  lens = jnp.full((b,), s, jnp.int32) if lens is None else jnp.asarray(lens, jnp.int32)
  return dict(spec=spec, args=(q, k_rows, v_rows, wk, wv, bias, bias, cos, sin, lens),
              kh=spec.n_kv_heads)


def kv_attention(q, k, v, lens):
  """bf16 KV decode attention (XLA): q [B,N,H], k/v [B,S,K,H] post-RoPE."""
  return xq.decode_attention_bf16(q, k, v, lens)[0]


def _rel(got, want):
  return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def check_kernels(key, fused_cfg, bits_list=(2, 3)):
  """Relative error vs the jnp reference (B=2, S=384, ragged lengths 384 and 200):
  the fused kernel at each bit width (3 bits: the two-plane path), xla / xla_vlate /
  dequant-matmul at the first."""
  errs = {}
  flat = lambda a: a.reshape(-1, a.shape[-1])
  for model, bits in itertools.product(MODELS, bits_list):
    d = setup(model, 2, 384, bits, key, lens=[384, 200])
    args, kh = d["args"], d["kh"]
    want = ref.remat_decode_attention(*args, n_kv_heads=kh)
    runs = {"fused": lambda: tb.remat_decode_attention(*args, n_kv_heads=kh, **fused_cfg)}
    if bits == bits_list[0]:
      kr, vr = args[1], args[2]
      w = args[3] if vr is not None else jnp.concatenate([args[3], args[4]], 1)
      dm_args = (flat(kr.codes), flat(kr.scale), flat(kr.zero), w)
      want_dm = ref.dequant_matmul(*dm_args, bits=bits, axis=kr.axis, group=kr.group)
      runs["xla"] = lambda: xq.remat_decode_attention(*args, n_kv_heads=kh)
      runs["xla_vlate"] = lambda: xq.remat_decode_attention_vlate(*args, n_kv_heads=kh)
      runs["dm"] = lambda: tb.dequant_matmul(*dm_args, bits=bits, axis=kr.axis, group=kr.group)
    for name, run in runs.items():
      try:
        errs[f"{name}/{model}/{bits}"] = _rel(run(), want_dm if name == "dm" else want)
      except Exception as e:  # pylint: disable=broad-except  (report, keep going)
        errs[f"{name}/{model}/{bits}"] = repr(e)[:300]
  return errs


def ceilings():
  """The device's ceilings (`measure_ceilings`) under this script's JSON keys: bf16 8192³
  matmul TFLOP/s, copy bandwidth (bytes read + written) and read-only bandwidth, TB/s."""
  c = measure_ceilings()
  return {"bf16_tflops": c.matmul_flops / 1e12, "copy_tb_s": c.copy_Bps / 1e12,
          "read_tb_s": c.read_Bps / 1e12}


_WEIGHTS = {}


def weights_time(model, b, key):
  """One layer's bf16 weight GEMV at batch b (memoised per model and batch)."""
  if (model, b) not in _WEIGHTS:
    spec, _, n_w = MODELS[model]
    kw, kx = jax.random.split(key)
    w = _uniform(kw, (spec.dim, n_w // spec.dim), 0.02)
    x = _uniform(kx, (b, spec.dim), 1.0)
    _WEIGHTS[(model, b)] = timed(lambda x: x @ w, (x,), 0)
  return _WEIGHTS[(model, b)]


def remat_flop(d, b, s):
  """FLOPs of rematerialising K and V for b·s tokens (2 per multiply-add)."""
  wk, wv = d["args"][3], d["args"][4]
  return 2 * b * s * (wk.shape[0] * wk.shape[1] + wv.shape[0] * wv.shape[1])


def measure(model, b, s, bits, key, fused_cfg, skip_xla=False):
  d = setup(model, b, s, bits, key)
  spec, kh, h = d["spec"], d["kh"], d["spec"].head_dim
  args = d["args"]
  row = {"model": model, "batch": b, "context": s, "bits": bits,
         "remat_flop": remat_flop(d, b, s), "kv_bytes": 2 * b * s * spec.kv_dim * 2}
  kk, kv = jax.random.split(jax.random.fold_in(key, 1))
  k, v = rand(kk, (b, s, kh, h)), rand(kv, (b, s, kh, h))
  row["kv_s"] = timed(kv_attention, (args[0], k, v, args[-1]), 0)
  del k, v
  run = lambda impl, **kw: (lambda q: impl(q, *args[1:], n_kv_heads=kh, **kw))
  row["fused_s"] = timed(run(tb.remat_decode_attention, **fused_cfg), (args[0],), 0)
  if not skip_xla:
    try:
      row["xla_s"] = timed(run(xq.remat_decode_attention), (args[0],), 0)
    except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory)
      row["xla_error"] = repr(e)[:200]
    try:
      row["xla_vlate_s"] = timed(run(xq.remat_decode_attention_vlate), (args[0],), 0)
    except Exception as e:  # pylint: disable=broad-except
      row["xla_vlate_error"] = repr(e)[:200]
  row["weights_s"] = weights_time(model, b, key)
  for name in ("fused", "xla"):
    if f"{name}_s" in row:
      row[f"{name}_tflops"] = row["remat_flop"] / row[f"{name}_s"] / 1e12
  return row


def quick(args, key):
  """Sweeps the fused kernel's knobs at one shape per path; prints and returns the best."""
  grid = list(itertools.product(*(map(int, getattr(args, k).split(",")) for k in
                                  ("q_block_m", "q_block_k", "q_warps", "q_stages"))))
  t_start, out = time.time(), {}
  for model in args.models.split(","):
    b, s = QUICK_SHAPES[model]
    d = setup(model, b, s, args.bits, key)
    qa, rest, kh = d["args"][0], d["args"][1:], d["kh"]
    want = ref.remat_decode_attention(*d["args"], n_kv_heads=kh) if b * s <= 65536 else None
    res = []
    for bm, bk, nw, ns in grid:
      if time.time() - t_start > args.budget_s:
        print("time budget reached", flush=True)
        break
      cfg = dict(block_m=bm, block_k=bk, num_warps=nw, num_stages=ns)
      fn = lambda q, cfg=cfg: tb.remat_decode_attention(q, *rest, n_kv_heads=kh, **cfg)
      try:
        t = timed(fn, (qa,), 0, target_s=0.05)
        r = dict(cfg, s=t, tflops=remat_flop(d, b, s) / t / 1e12)
        if want is not None:
          r["rel_err"] = _rel(fn(qa), want)
      except Exception as e:  # pylint: disable=broad-except  (smem / register limits)
        r = dict(cfg, error=repr(e)[:160])
      res.append(r)
      print(model, json.dumps(r), flush=True)
    ok = [r for r in res if "s" in r]
    best = min(ok, key=lambda r: r["s"]) if ok else None
    out[model] = {"batch": b, "context": s, "results": res, "best": best}
    print(f"best {model} B={b} S={s}: {json.dumps(best)}", flush=True)
  return out


def parse_shapes(text, models):
  """--shapes "model:batch:context,..." ("" for SHAPES) -> [(model, batch, context)] whose
  model is in `models`; a malformed entry exits with a one-line message naming it."""
  if not text:
    return [x for x in SHAPES if x[0] in models]
  shapes = []
  for item in text.split(","):
    parts = item.split(":")
    if len(parts) != 3 or parts[0] not in MODELS or not all(p.isdigit() for p in parts[1:]):
      raise SystemExit(f"--shapes: bad entry {item!r}; expected model:batch:context with "
                       f"model in {','.join(MODELS)}")
    shapes.append((parts[0], int(parts[1]), int(parts[2])))
  return [x for x in shapes if x[0] in models]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench_xquant.json")
  ap.add_argument("--bits", type=int, default=2)
  ap.add_argument("--shapes", default="",
                  help="model:batch:context,... (default: the SHAPES list)")
  ap.add_argument("--models", default="llama2-7b,llama3.1-8b")
  ap.add_argument("--xla_max_tokens", type=int, default=1 << 20)
  ap.add_argument("--budget_s", type=float, default=380.0)
  ap.add_argument("--block_m", type=int, default=FUSED_DEFAULT["block_m"])
  ap.add_argument("--block_k", type=int, default=FUSED_DEFAULT["block_k"])
  ap.add_argument("--num_warps", type=int, default=FUSED_DEFAULT["num_warps"])
  ap.add_argument("--num_stages", type=int, default=FUSED_DEFAULT["num_stages"])
  ap.add_argument("--quick", action="store_true", help="sweep the fused kernel's knobs and exit")
  ap.add_argument("--q_block_m", default="64,128")
  ap.add_argument("--q_block_k", default="32,64")
  ap.add_argument("--q_warps", default="4,8")
  ap.add_argument("--q_stages", default="3,4")
  ap.add_argument("--skip_checks", action="store_true")
  args = ap.parse_args(argv)
  models = args.models.split(",")
  unknown = [m for m in models if m not in MODELS]
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}; known: {','.join(MODELS)}")
  shapes = parse_shapes(args.shapes, models)
  if not tb.available():
    raise SystemExit("bench_xquant needs a CUDA GPU with jax-triton (none found)")
  t_start = time.time()
  key = jax.random.key(0)
  res = dict(environment(), argv=sys.argv[1:])
  if args.quick:
    res["quick"] = quick(args, key)
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)
    return
  fused_cfg = dict(block_m=args.block_m, block_k=args.block_k, num_warps=args.num_warps,
                   num_stages=args.num_stages)
  res["fused_config"] = fused_cfg
  if not args.skip_checks:
    res["checks"] = check_kernels(key, fused_cfg)
    print("kernel checks (rel. error vs jnp reference):", json.dumps(res["checks"]), flush=True)
  res["ceilings"] = ceilings()
  print("ceilings:", json.dumps(res["ceilings"]), flush=True)
  # Cheapest first (remat FLOPs), so the budget cuts the most expensive shapes.
  cost = lambda x: x[1] * x[2] * (MODELS[x[0]][0].dim if MODELS[x[0]][1] == "x"
                                  else MODELS[x[0]][0].kv_dim)
  shapes = sorted(shapes, key=cost)
  res["rows"] = []
  for model, b, s in shapes:   # cheapest first: the budget cuts the largest shapes
    if time.time() - t_start > args.budget_s:
      print(f"time budget reached; skipped {model} B={b} S={s}", flush=True)
      res["rows"].append({"model": model, "batch": b, "context": s, "skipped": "budget"})
      continue
    try:
      row = measure(model, b, s, args.bits, key, fused_cfg,
                    skip_xla=b * s > args.xla_max_tokens)
    except Exception as e:  # pylint: disable=broad-except  (keep the other rows)
      row = {"model": model, "batch": b, "context": s, "error": repr(e)[:300]}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:   # after every row: a timeout keeps what was measured
      json.dump(res, f, indent=1)
  print_table(res)


def print_table(res):
  c = res["ceilings"]
  print(f"\n{res['device']}  jax {res['jax']}  bf16 {c['bf16_tflops']:.0f} TFLOP/s"
        f"  copy {c['copy_tb_s']:.2f} TB/s  fused {json.dumps(res['fused_config'])}")
  print(f"{'model':12s} {'B':>3s} {'S':>6s} {'kv_us':>9s} {'fused_us':>10s} "
        f"{'xla_us':>10s} {'vlate_us':>10s} {'w_us':>7s} {'TF/s':>6s} {'xlaTF/s':>7s} {'f/kv':>6s} "
        f"{'f/xla':>6s} {'(w+f)/(w+kv)':>12s}")
  for r in sorted(res["rows"], key=lambda r: (r["model"], r["batch"], r["context"])):
    head = f"{r['model']:12s} {r['batch']:3d} {r['context']:6d}"
    if "kv_s" not in r:
      print(f"{head} {r.get('error', r.get('skipped', ''))[:80]}")
      continue
    us = lambda k, w=10: f"{1e6 * r[k]:{w}.1f}" if k in r else f"{'-':>{w}s}"
    ratio = lambda a, b: f"{r[a] / r[b]:6.2f}" if a in r and b in r else f"{'-':>6s}"
    tf = lambda k: f"{r[k]:7.1f}" if k in r else f"{'-':>7s}"
    layer = (r["weights_s"] + r["fused_s"]) / (r["weights_s"] + r["kv_s"])
    print(f"{head} {us('kv_s', 9)} {us('fused_s')} {us('xla_s')} {us('xla_vlate_s')} "
          f"{us('weights_s', 7)} {r['fused_tflops']:6.1f} {tf('xla_tflops')} "
          f"{ratio('fused_s', 'kv_s')} {ratio('fused_s', 'xla_s')} {layer:12.2f}")


if __name__ == "__main__":
  sys.exit(main())
