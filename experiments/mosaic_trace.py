"""Summary of a Pallas Mosaic GPU profiler trace: where each warpgroup's time goes.

A kernel compiled with `CompilerParams(profile_space=..., profile_dir=...)` writes, per call,
a Chrome trace of every warpgroup's named scopes (`jax.named_scope` in the kernel body):
begin/end events whose timestamps are SM clock cycles / 1000. This folds them into one row
per (warpgroup role, scope): how often a warpgroup entered it, its mean length in cycles, and
its share of the warpgroup's time from its first to its last event ("(outside scopes)" is
the rest). A scope nested in itself (Pallas re-opens a scope in the nested jaxprs of
`pl.when` / `run_scoped`) counts once, at its outermost occurrence.

  python experiments/mosaic_trace.py TRACE.json --warpgroups 3 --roles compute,compute,producer
"""

from __future__ import annotations

import argparse
import collections
import json


def summarize(path, warpgroups, roles):
  """{role: {scope: dict(calls_per_wg, mean_cycles, share)}} plus per-role 'span_cycles'."""
  if len(roles) != warpgroups:
    raise ValueError(f"roles ({roles}) must name each of the {warpgroups} warpgroups")
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  if not events:
    raise ValueError(f"{path}: the trace has no events (was the kernel compiled with named "
                     "scopes and profile_space > 0?)")
  by_tid = collections.defaultdict(list)
  for e in events:
    by_tid[e["tid"]].append(e)
  total = collections.defaultdict(lambda: collections.defaultdict(float))
  calls = collections.defaultdict(lambda: collections.defaultdict(int))
  span = collections.defaultdict(float)
  n_wg = collections.Counter()
  for tid, evs in by_tid.items():
    role = roles[(tid - 1) % warpgroups]
    n_wg[role] += 1
    stack, covered = [], 0.0
    for e in evs:
      cyc = e["ts"] * 1e3
      if e["ph"] == "B":
        stack.append((e["name"], cyc, e["name"] in [s[0] for s in stack]))
        continue
      if not stack or stack[-1][0] != e["name"]:
        raise ValueError(f"{path}: unbalanced event {e['name']!r} for trace {tid}")
      name, begin, nested = stack.pop()
      if not nested:
        total[role][name] += cyc - begin
        calls[role][name] += 1
      if not stack:
        covered += cyc - begin
    if stack:
      raise ValueError(f"{path}: scope {stack[-1][0]!r} of trace {tid} never ends")
    wg_span = (evs[-1]["ts"] - evs[0]["ts"]) * 1e3
    span[role] += wg_span
    total[role]["(outside scopes)"] += wg_span - covered
  out = {}
  for role, names in total.items():
    rows = {}
    for name, cyc in sorted(names.items(), key=lambda kv: -kv[1]):
      c = calls[role][name]
      rows[name] = dict(calls_per_wg=c / n_wg[role], mean_cycles=cyc / c if c else None,
                        share=cyc / span[role] if span[role] else 0.0)
    out[role] = dict(scopes=rows, warpgroups=n_wg[role], span_cycles=span[role] / n_wg[role])
  return out


def table(summary):
  lines = ["| warpgroup | scope | per warpgroup | mean cycles | share of its time |",
           "|---|---|---|---|---|"]
  for role, r in summary.items():
    for name, row in r["scopes"].items():
      mean = "" if row["mean_cycles"] is None else f"{row['mean_cycles']:.0f}"
      lines.append(f"| {role} ({r['warpgroups']}, {r['span_cycles']:.0f} cycles each) | {name} | "
                   f"{row['calls_per_wg']:.1f} | {mean} | {100 * row['share']:.1f}% |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("trace")
  ap.add_argument("--warpgroups", type=int, required=True, help="warpgroups per CTA")
  ap.add_argument("--roles", required=True, help="comma-separated role of each warpgroup")
  args = ap.parse_args()
  s = summarize(args.trace, args.warpgroups, args.roles.split(","))
  print(table(s))


if __name__ == "__main__":
  main()
