"""Where a step's device time goes: time per XLA op of a call, read from a JAX profiler trace.

`op_times(fn, calls)` traces `calls` calls of `fn` (already compiled and warm) with
`jax.profiler`, reads the trace back (`jax.profiler.ProfileData`) and sums the duration of
every event that names an HLO op (stat `hlo_op`), per op. On a GPU only the device planes
count (kernels on the streams; the "XLA Ops" / "XLA Modules" summary lines are skipped, so
nothing is counted twice), and on several GPUs only GPU 0's plane (on a mesh every device runs
the same program on its shard); without a device plane (CPU) the host threads' op events do.
Each op also gets a category from its HLO name (`category`): the mesh's collectives
(all-reduce, all-gather, NCCL kernels), the projections as GEMMs (checked before the custom
calls: XLA may run a GEMM as a custom call too), the attention kernels as custom calls
(Triton, Mosaic GPU, cuDNN), the cache writes as scatters / dynamic-update-slices, and
everything else as fusions. A collective's time includes its wait for the other devices, and
XLA runs the one-shot all-reduce kernels on side streams, beside the compute stream: on a mesh
the ops' sum can exceed the step. Kernels that XLA launched inside a command buffer (a CUDA graph)
carry the buffer's name as their op: they are keyed by kernel name instead, so the layers'
identical kernels add up in one row.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import Callable

import jax

_CATEGORIES = (            # first match wins, on "<hlo op> <kernel>" lower-cased
    # "psum": XLA:GPU's one-shot all-reduce kernel, a fusion named after JAX's psum
    # ("psum.456.0-fusion.1"), the default for small all-reduces on one host (JAX 0.11).
    ("collective (all-reduce / all-gather)", ("all-reduce", "all-gather", "reduce-scatter",
                                              "all-to-all", "collective-permute", "nccl",
                                              "psum")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "dot")),
    ("custom call (attention kernels)", ("custom-call", "custom_call", "cudnn", "fmha",
                                        "flash", "triton_kernel_call", "mosaic_gpu")),
    ("cache write (scatter / update-slice)", ("scatter", "dynamic-update-slice",
                                              "dynamic_update_slice")),
    ("copy / transpose", ("copy", "transpose")),
    ("reduction fusion", ("reduce",)),
)


def category(op: str, kernel: str = "") -> str:
  """A coarse kind of the HLO op named `op` run as `kernel` (module docstring). Inside a
  command buffer a Triton launch's op is the buffer's name: its kernel's name (every
  `@triton.jit` entry of `kvlowrank_kernels` ends in "kernel"; XLA names its own kernels after
  their fusions) files it with the custom calls it was lowered from."""
  name = f"{op} {kernel}".lower()
  for label, keys in _CATEGORIES:
    if any(k in name for k in keys):
      return label
  if kernel.lower().endswith("kernel"):
    return "custom call (attention kernels)"
  return "other fusion"


def _events(profile):
  """(hlo_op, kernel name, duration_ns, start_ns, (plane, line)) of every op event: the
  device planes' streams
  (of GPU 0 alone where there are several GPUs: on a mesh every device runs the same
  program on its shard, so one device's time is the step's, and summing them would count
  it once per device), else the host's threads."""
  device = [p for p in profile.planes if p.name.startswith("/device:")]
  gpus = [p for p in device if re.fullmatch(r"/device:GPU:\d+", p.name)]
  if len(gpus) > 1:
    device = [min(gpus, key=lambda p: int(p.name.rsplit(":", 1)[1]))]
  planes = device or [p for p in profile.planes if p.name.startswith("/host:")]
  for plane in planes:
    for line in plane.lines:
      if device and line.name in ("XLA Ops", "XLA Modules", "Framework Ops",
                                  "Framework Name Scope", "Source code", "Steps"):
        continue
      for ev in line.events:
        op = next((v for k, v in ev.stats if k == "hlo_op"), None)
        if op:
          yield (str(op), str(ev.name), float(ev.duration_ns), float(ev.start_ns),
                 (plane.name, line.name))


def _busy_ns(intervals) -> float:
  """Length of the union of [start, end) intervals."""
  busy, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b > end:
      busy += b - max(a, end)
      end = b
  return busy


def op_times(fn: Callable[[], object], calls: int = 3, warm: bool = True) -> dict:
  """Device seconds per call of `fn`, per HLO op and per category (module docstring).

  Returns dict(total_s, stream_busy_s, ops=[dict(op, kernel, category, seconds, launches)]
  longest first, categories={category: seconds}); `seconds` and `launches` are per call of
  `fn`. `stream_busy_s`: the time during which the compute stream (the stream, or host
  thread, with the most op time) runs an op, per call; a call's wall time beyond it is time
  that stream waited (for the host's launches, or for another device in a collective).
  """
  if warm:                                           # nothing compiles in the trace
    jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    try:
      for _ in range(calls):
        jax.block_until_ready(fn())
    finally:
      jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      raise RuntimeError(f"jax.profiler wrote no trace under {d}")
    profile = jax.profiler.ProfileData.from_file(paths[0])
    secs, count, kernel = collections.Counter(), collections.Counter(), {}
    spans = collections.defaultdict(list)
    for op, name, ns, start, stream in _events(profile):
      spans[stream].append((start, start + ns))
      if op.startswith("command_buffer"):   # a CUDA graph of many ops: one row per kernel
        op = name
      secs[op] += ns * 1e-9 / calls
      count[op] += 1
      kernel.setdefault(op, name)
  ops = [dict(op=op, kernel=kernel[op][:120], category=category(op, kernel[op]), seconds=s,
              launches=count[op] / calls) for op, s in secs.most_common()]
  cats = collections.Counter()
  for o in ops:
    cats[o["category"]] += o["seconds"]
  main = max(spans.values(), key=lambda sp: sum(b - a for a, b in sp), default=[])
  busy = _busy_ns(main) * 1e-9 / calls
  return dict(total_s=sum(secs.values()), stream_busy_s=busy, ops=ops,
              categories=dict(cats.most_common()))


def op_table(prof: dict, top: int = 12) -> str:
  """Markdown: the categories, then the `top` longest ops (µs per call)."""
  rows = ["| category / op | µs per call | share |", "|---|---|---|"]
  total = prof["total_s"] or 1.0
  for cat, s in prof["categories"].items():
    rows.append(f"| **{cat}** | {1e6 * s:.1f} | {s / total:.0%} |")
  for o in prof["ops"][:top]:
    name = re.sub(r"\|", "/", o["op"])[:60]
    rows.append(f"| {name} (×{o['launches']:g}) | {1e6 * o['seconds']:.1f} | "
                f"{o['seconds'] / total:.0%} |")
  return "\n".join(rows)
