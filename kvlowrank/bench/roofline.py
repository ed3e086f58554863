"""Roofline, % of roofline and speed-up over the best dense kernel, per benchmark call.

A kernel's roofline time is max(bytes / the best dense bandwidth of the same call,
FLOPs / the matmul rate of the same call): the dense kernels show what bandwidth the
device really reaches for a streaming decode read, and the call's own ceilings cancel the
machine-to-machine spread. Records of different calls are never mixed in one ratio.
"""

from __future__ import annotations


def _dense(r) -> bool:
  return r["kernel"].startswith("dense") and bool(r["seconds"])


def finalize(recs, mm_rate):
  """Adds the roofline fields to the records of one call, in place.

  Args:
    recs: dicts with model, context, batch, kernel ("dense-*" for the baselines), seconds
      (None or 0 for a kernel that failed), bytes, flops.
    mm_rate: the call's matmul rate, FLOP/s.
  Returns:
    The best dense bandwidth (bytes/s) of the call, or None if no dense kernel was timed
    (then nothing is added). Each timed record gains us, achieved_TBps, roofline_us,
    bound ("memory" or "compute"), pct_roofline and speedup_vs_dense (the best dense time
    of its (model, context, batch) over its own; None where no dense kernel ran there).
  """
  dense_bw = max((r["bytes"] / r["seconds"] for r in recs if _dense(r)), default=None)
  if dense_bw is None:
    return None
  best_dense = {}
  for r in recs:
    if _dense(r):
      k = (r["model"], r["context"], r["batch"])
      best_dense[k] = min(best_dense.get(k, float("inf")), r["seconds"])
  for r in recs:
    if not r["seconds"]:
      continue
    r["us"] = r["seconds"] * 1e6
    r["achieved_TBps"] = r["bytes"] / r["seconds"] / 1e12
    r["roofline_us"] = max(r["bytes"] / dense_bw, r["flops"] / mm_rate) * 1e6
    r["bound"] = "memory" if r["bytes"] / dense_bw >= r["flops"] / mm_rate else "compute"
    r["pct_roofline"] = 100.0 * r["roofline_us"] / r["us"]
    bd = best_dense.get((r["model"], r["context"], r["batch"]))
    r["speedup_vs_dense"] = bd / r["seconds"] if bd else None
  return dense_bw
