"""The long-context job: passkey / needle retrieval (and LongBench / RULER when online)
for every method of a sweep, through each method's real decode path, resumably.

`run(config, workdir, points)`:
  1. every point (a dotted-key override dict, as in kvlowrank.experiment.sweep) is
     applied to the config and validated: the `longctx` section (LongCtxSpec) and the
     evaluation config (kvlowrank.experiment.spec) of its method; LongBench / RULER
     samples are fetched (one clear error when the hub is unreachable);
  2. the model is loaded once; every point's method is checked against it and every
     context against the model's max_seq_len, before any calibration;
  3. context by context (in the config's order), every point's method: its parameters
     (calibrated and cached in workdir/calib/ exactly as kvlowrank.experiment.evaluate
     does), then for every (task, depth, sample): the prompt is prefilled into a fresh cache of the method and the answer
     decoded greedily by kvlowrank.generate.generate (one prefill call, then decode
     steps through the cache's decode path), scored, and appended as one record to
     workdir/results.jsonl;
  4. the report (table + plots, kvlowrank.experiment.longctx_report) is written.

A record's key hashes the point's evaluation config and the sample's identity (task,
context, depth, index, seed, filler), not the grid, so a rerun (or a larger grid) skips
every sample already scored.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import ml_collections

from kvlowrank import config_lib as typed
from kvlowrank.eval import hf_tasks, needle, passkey
from kvlowrank.eval.exact_match import exact_match
from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, longctx_report, models, records
from kvlowrank.experiment.spec import from_config
from kvlowrank.experiment.sweep import load_points
from kvlowrank.generate.loop import generate
from kvlowrank.methods import get_method

log = logging.getLogger(__name__)

SYNTHETIC = {"passkey": passkey.sample, "needle": needle.sample}
TASKS = tuple(SYNTHETIC) + hf_tasks.BENCHMARKS


@dataclasses.dataclass(frozen=True)
class LongCtxSpec:
  """The `longctx` config section.

  tasks: passkey | needle | longbench | ruler.
  contexts: total tokens (prompt + max_new_tokens) of the synthetic prompts.
  depths: needle depths in [0, 1].
  depth_overrides: ((context, (depths...)), ...): other depths at those contexts (to
    size the costly longest contexts on a CPU).
  task_overrides: ((context, (tasks...)), ...): only those synthetic tasks there.
  samples: prompts per (task, context, depth); seed: their generator seed.
  max_new_tokens: greedy answer budget (the answer's tokens + at least 1).
  filler_chars / data_path: the needle's WikiText-2 haystack pool.
  label: the method's name in tables and plots ("" = "<method>-<bits>").
  longbench / ruler / hf_samples / hf_revision: kvlowrank.eval.hf_tasks.
  """

  tasks: tuple = ("passkey", "needle")
  contexts: tuple = (1024, 2048, 4096, 8192)
  depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
  depth_overrides: tuple = ()
  task_overrides: tuple = ()
  samples: int = 1
  seed: int = 0
  max_new_tokens: int = 12
  filler_chars: int = 200_000
  data_path: str = ""
  label: str = ""
  longbench: tuple = hf_tasks.LONGBENCH_SUBSETS
  ruler: str = "4096"
  hf_samples: int = 20
  hf_revision: str = ""

  def __post_init__(self):
    for name in ("tasks", "contexts", "depths", "longbench"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    try:
      over = tuple((int(c), tuple(float(d) for d in ds)) for c, ds in self.depth_overrides)
    except (TypeError, ValueError):
      raise ValueError("config.longctx.depth_overrides must be ((context, (depths...)), "
                       f"...), got {self.depth_overrides!r}") from None
    object.__setattr__(self, "depth_overrides", over)
    try:
      tover = tuple((int(c), tuple(str(t) for t in ts)) for c, ts in self.task_overrides)
    except (TypeError, ValueError):
      raise ValueError("config.longctx.task_overrides must be ((context, (tasks...)), "
                       f"...), got {self.task_overrides!r}") from None
    if any(t not in SYNTHETIC for _, ts in tover for t in ts):
      raise ValueError(f"config.longctx.task_overrides: tasks must be among "
                       f"{tuple(SYNTHETIC)}, got {self.task_overrides!r}")
    object.__setattr__(self, "task_overrides", tover)
    bad = [t for t in self.tasks if t not in TASKS]
    if not self.tasks or bad:
      raise ValueError(f"config.longctx.tasks must be entries of {TASKS}, got {self.tasks!r}")
    if not self.contexts or any(int(c) < 16 for c in self.contexts):
      raise ValueError(f"config.longctx.contexts must be >= 16 tokens, got {self.contexts!r}")
    for ds in [self.depths] + [ds for _, ds in over]:
      if not ds or any(not 0.0 <= float(d) <= 1.0 for d in ds):
        raise ValueError(f"config.longctx.depths / depth_overrides must be non-empty and "
                         f"lie in [0, 1], got {ds!r}")
    for name in ("samples", "max_new_tokens", "filler_chars", "hf_samples"):
      if getattr(self, name) < 1:
        raise ValueError(f"config.longctx.{name} must be >= 1, got {getattr(self, name)}")

  def depths_at(self, context: int) -> tuple:
    return dict(self.depth_overrides).get(int(context), self.depths)


def split(config) -> tuple[Any, LongCtxSpec]:
  """(the evaluation config without `longctx`, the typed `longctx` section)."""
  if "longctx" not in config:
    raise ValueError("config has no 'longctx' section (see configs/longctx.py)")
  spec = typed.to_dataclass(config.longctx, LongCtxSpec, where="config.longctx")
  d = config.to_dict()
  d.pop("longctx")
  return config_lib.apply_overrides(ml_collections.ConfigDict(d), {}), spec


def sample_key(eval_config, lc: LongCtxSpec, task: str, context: int, depth, index: int
               ) -> str:
  ident = {"eval": config_lib.config_hash(eval_config), "task": task, "context": context,
           "depth": depth, "index": index, "seed": lc.seed, "max_new": lc.max_new_tokens,
           "filler": [lc.filler_chars, lc.data_path], "hf": [lc.ruler, lc.hf_revision]}
  return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _grid(lc: LongCtxSpec):
  for task in lc.tasks:
    if task in SYNTHETIC:
      for c in lc.contexts:
        if task not in dict(lc.task_overrides).get(int(c), lc.tasks):
          continue
        for d in lc.depths_at(c):
          for i in range(lc.samples):
            yield task, int(c), float(d), i


def _synthetic(tok, task: str, context: int, depth: float, index: int, lc: LongCtxSpec):
  kw = dict(context=context, depth=depth, index=index, seed=lc.seed,
            max_new_tokens=lc.max_new_tokens)
  if task == "needle":
    kw.update(filler_chars=lc.filler_chars, data_path=lc.data_path)
  return SYNTHETIC[task](tok, **kw)


def run(config, workdir, points: Sequence[dict], *, results_name: str = records.RESULTS,
        progress: Optional[bool] = None) -> dict[str, Any]:
  """Runs every unfinished sample of every point; writes the report.

  Args:
    config: the configs/longctx.py ConfigDict (command-line overrides applied).
    workdir: output folder: results.jsonl, calib/, longctx.md and the plots.
    points: dotted-key override dicts (one per method), e.g. {"method": "kivi",
      "kivi.bits": 2, "longctx.label": "KIVI-2"}.
    results_name: JSONL file name.
    progress: tqdm bar over samples (default config.progress).
  Returns:
    {"ran", "skipped", "results", "markdown", "plots"}.
  Raises:
    ValueError / FileNotFoundError naming the bad field, file or dataset, before any
    model work.
  """
  resolved = []
  for i, point in enumerate(points or [{}]):
    try:
      cfg, lc = split(config_lib.apply_overrides(config, point))
      from_config(cfg)
    except ValueError as e:
      raise ValueError(f"longctx point {i} {point!r}: {e}") from None
    resolved.append((point, cfg, lc))
  hf_samples = {}
  for _, _, lc in resolved:
    for task in lc.tasks:
      if task not in SYNTHETIC and (task, lc.ruler, lc.longbench) not in hf_samples:
        hf_samples[(task, lc.ruler, lc.longbench)] = hf_tasks.load(
            task, ruler=lc.ruler, longbench=lc.longbench, n=lc.hf_samples,
            revision=lc.hf_revision)
  model = models.load(resolved[0][1].model.path, resolved[0][1].model.dtype)
  exps = []
  for i, (point, cfg, lc) in enumerate(resolved):
    if cfg.model.to_dict() != resolved[0][1].model.to_dict():
      raise ValueError(f"longctx point {i} {point!r}: config.model must be the same for "
                       "every point")
    try:
      exps.append(from_config(cfg, model.spec))
    except ValueError as e:
      raise ValueError(f"longctx point {i} {point!r}: {e}") from None
    too_long = [c for c in lc.contexts if c > model.spec.max_seq_len]
    if too_long:
      raise ValueError(f"config.longctx.contexts {too_long} exceed the model's "
                       f"max_seq_len={model.spec.max_seq_len}")
  tok = model.require_tokenizer()
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  results = workdir / results_name
  done = records.done_keys(results)
  show = bool(config.progress) if progress is None else progress
  hf_by_id = {(t, s.name, s.index): s for (t, _, _), ss in hf_samples.items() for s in ss}
  work, methods_of = [], []
  for p, ((point, cfg, lc), exp) in enumerate(zip(resolved, exps)):
    method = get_method(exp.method)
    bits = method.bits_label(exp.method_spec, exp.jnp_cache_dtype)
    label = lc.label or (exp.method if exp.method == "dense" else f"{exp.method}-{bits}")
    methods_of.append((point, cfg, lc, exp, method, bits, label))
    for task, c, d, i in _grid(lc):
      work.append((lc.contexts.index(c), p, sample_key(cfg, lc, task, c, d, i), task, c, d, i))
    for (task, _, _), samples in hf_samples.items():
      if task in lc.tasks:
        work += [(len(lc.contexts), p, sample_key(cfg, lc, task, 0, s.name, s.index), task,
                  0, s.name, s.index) for s in samples]
  # Context-major: every method at one context (in the order the config lists them)
  # before the next, so an interrupted run has comparable cells for every method.
  work.sort(key=lambda w: (w[0], w[1]))
  pending = [w for w in work if w[2] not in done]
  ran, skipped = 0, len(work) - len(pending)
  bar = None
  if show and pending:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(pending), desc="longctx", unit="prompt")
  params_of: dict[int, Any] = {}
  for _, p, key, task, c, d, i in pending:
    point, cfg, lc, exp, method, bits, label = methods_of[p]
    if p not in params_of:
      params_of[p], _ = evaluate.calibrated_params(cfg, exp, model, workdir)
    params = params_of[p]
    start = time.perf_counter()
    if task in SYNTHETIC:
      s = _synthetic(tok, task, c, d, i, lc)
      tokens, answers, max_new, budget = s.tokens, (s.answer,), s.max_new_tokens, c
      extra = {"depth": d, "depth_actual": s.depth_actual, "needle_start": s.needle_start,
               "prompt_tokens": len(s.tokens)}
    else:
      hs = hf_by_id[(task, d, i)]
      budget = min(max(lc.contexts), model.spec.max_seq_len)
      tokens, max_new = hf_tasks.prompt_ids(tok, hs, budget)
      answers = hs.answers
      extra = {"subset": d, "prompt_tokens": len(tokens), "depth": None,
               "revision": hs.revision}
    res = generate(params, model.spec, [list(tokens)], max_new_tokens=max_new,
                   cache_method=method.cache, cache_spec=exp.method_spec,
                   cache_dtype=exp.jnp_cache_dtype, eos_ids=tok.eos_ids or (),
                   capacity=len(tokens) + max_new)
    text = tok.decode(list(res.tokens[0]))
    score = (exact_match(text, answers[0]) if task in SYNTHETIC
             else hf_tasks.score(task, d, text, answers))
    rec = {"key": key, "label": label, "method": exp.method, "bits": bits, "task": task,
           "context": c if task in SYNTHETIC else budget, "index": i,
           "answer": answers[0], "generated": text, "score": score, **extra,
           "seconds": time.perf_counter() - start, "point": point,
           "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"),
           "versions": {"jax": jax.__version__, "backend": jax.default_backend()}}
    records.append(results, rec)
    done.add(key)
    ran += 1
    log.info("%s %s ctx=%s depth=%s: %r vs %r -> %s (%.1f s)", label, task, c, d, text,
             answers[0], score, rec["seconds"])
    if bar is not None:
      bar.set_postfix_str(f"{label} {task} {c}")
      bar.update(1)
  if bar is not None:
    bar.close()
  summary: dict[str, Any] = {"ran": ran, "skipped": skipped, "results": str(results)}
  if config.write_report:
    summary.update(longctx_report.write(workdir, results_name=results_name,
                                        keys={w[2] for w in work}))
  return summary


def run_file(config_path: str, config, workdir, *, limit: Optional[int] = None
             ) -> dict[str, Any]:
  """`run` with the points of the config file's get_sweep (the launcher's entry)."""
  points = load_points(config_path)
  return run(config, workdir, points[:limit] if limit else points)
