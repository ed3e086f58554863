"""Perplexity through a KV cache, in two modes.

Windows follow the GPTQ/Palu protocol (kvlowrank.data.text): non-overlapping windows
of T tokens, each scored independently from an empty cache; PPL = exp(total NLL /
number of predictions), with T - 1 next-token predictions per window (GPTQ multiplies
HF's mean loss by T instead, a <= 1/T difference in the exponent; we count exactly).

Modes (both run the real cache code; only the call schedule differs):
  * "prefill": one forward call over the whole window with a fresh cache of capacity T.
    Every layer's K/V go through the cache's update (compress) and attend
    (reconstruct) path, so every query attends to the compressed window — what
    Palu/KIVI/XQuant papers report as "perplexity with a compressed cache".
  * "decode": the window is consumed as in generation: its first `prompt_len` tokens
    are prefilled in chunks of `prefill_chunk` tokens, then every remaining token is
    fed alone (T = 1 decode steps), so each prediction is made from exactly the cache
    state it would see when generating that token (e.g. KIVI's residual window has or
    has not been flushed yet). The window's last token is never fed: it has no target.
For an exact (dense) cache both modes compute the same function (up to fp32 round-off
from different reduction shapes).

Each batch of windows is one jitted call whatever the mode: the schedule's segments are
fed to the cache in order by kvlowrank.model.segments.forward_segments (same cache
states as one forward call per segment; one compiled program, no per-token dispatch).
For per-layer caches it computes the per-token work (projections, MLP, head) layer by
layer over the whole window and only the cache calls segment by segment, scanning over
the layers when the stack is homogeneous.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache.base import init_caches
from kvlowrank.model import xla_options
from kvlowrank.model.segments import forward_segments
from kvlowrank.spec import ModelSpec

MODES = ("prefill", "decode")


@functools.partial(jax.jit, static_argnames=("spec", "segments", "allow_beyond_max_seq_len"),
                   compiler_options=xla_options.DECODE)
def _window_nll(params, caches, tokens, targets, *, spec: ModelSpec,
                segments: tuple[tuple[int, int], ...], allow_beyond_max_seq_len=False):
  """Feeds tokens [B, n] (n = end of the last segment) segment by segment through the
  caches; returns nll [B, n] fp32.

  nll[b, i] = logsumexp(logits) - logits[target]: the cross entropy of targets[b, i]
  under the model's next-token distribution after tokens[b, :i+1]. The segments run as
  successive cache calls (kvlowrank.model.segments): one compiled program per window
  shape, mode and method. The caches are not returned, so nothing is donated (XLA only
  aliases donated inputs to outputs).
  """
  b, n = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  logits, _ = forward_segments(params, tokens, positions, caches, spec, segments,
                               allow_beyond_max_seq_len=allow_beyond_max_seq_len)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


def schedule(seq_len: int, mode: str, prompt_len: int = 0, prefill_chunk: int = 0
             ) -> list[tuple[int, int]]:
  """The [start, end) token segments fed to the cache, in order.

  Args:
    seq_len: window length T.
    mode: "prefill" (one segment [0, T)) or "decode".
    prompt_len: decode mode: tokens prefilled before token-by-token decoding (clipped to
      T - 1; 0 = decode every token one by one).
    prefill_chunk: decode mode: chunk size of that prefill (0 = the whole prompt at once).
  Returns:
    list of (start, end).
  """
  if mode not in MODES:
    raise ValueError(f"eval mode must be one of {MODES}, got {mode!r}")
  if prompt_len < 0 or prefill_chunk < 0:
    raise ValueError(f"eval.prompt_len / eval.prefill_chunk must be >= 0, got "
                     f"{prompt_len} / {prefill_chunk}")
  if mode == "prefill":
    return [(0, seq_len)]
  last = seq_len - 1  # the final token has no target: never fed
  p = min(prompt_len, last)
  c = prefill_chunk or max(p, 1)
  segs = [(s, min(s + c, p)) for s in range(0, p, c)]
  return segs + [(s, s + 1) for s in range(p, last)]


def window_nll(params, tokens, *, spec: ModelSpec, method: str, method_spec,
               cache_dtype=jnp.bfloat16, mode: str = "prefill", prompt_len: int = 0,
               prefill_chunk: int = 0, progress=None,
               allow_beyond_max_seq_len: bool = False) -> np.ndarray:
  """Per-position NLL of a batch of windows through a fresh cache.

  Args:
    params: model parameters (possibly transformed by a method's calibration).
    tokens: int [B, T] windows.
    spec: ModelSpec.
    method, method_spec: registered cache method name and its spec dataclass.
    cache_dtype: storage dtype handed to the cache factory.
    mode, prompt_len, prefill_chunk: see `schedule`.
    progress: optional tqdm-like object; `update(n)` is called with tokens consumed.
    allow_beyond_max_seq_len: score windows longer than spec.max_seq_len (the model's
      trained context); by default an error.
  Returns:
    float32 [B, T-1]: entry i is -log p(tokens[:, i+1] | tokens[:, :i+1]).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  caches = init_caches(method, method_spec, spec, params, batch=b, capacity=t,
                       dtype=cache_dtype)
  segments = tuple(schedule(t, mode, prompt_len, prefill_chunk))
  n = segments[-1][1]
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  nll = _window_nll(params, caches, tokens[:, :n], targets[:, :n], spec=spec,
                    segments=segments, allow_beyond_max_seq_len=allow_beyond_max_seq_len)
  nll = np.asarray(nll, np.float32)
  if progress is not None:
    progress.update(n)
  return nll[:, :t - 1]


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
  """Outcome of one perplexity run (JSON-friendly through `asdict`)."""

  mode: str
  ppl: float
  nll_sum: float        # total NLL in nats (float64 accumulation)
  n_tokens: int         # number of scored next-token predictions: W * (T - 1)
  n_windows: int
  seq_len: int
  window_ppl: list      # per-window perplexity
  seconds: float

  def asdict(self) -> dict:
    return dataclasses.asdict(self)


def perplexity(params, windows, *, spec: ModelSpec, method: str, method_spec,
               cache_dtype=jnp.bfloat16, mode: str = "prefill", batch_size: int = 1,
               prompt_len: int = 0, prefill_chunk: int = 0, progress: bool = False,
               desc: Optional[str] = None, allow_beyond_max_seq_len: bool = False
               ) -> PerplexityResult:
  """Perplexity over windows [W, T], scored in batches of `batch_size` windows.

  A short last batch is padded with copies of its last window (results dropped) so
  that every batch has the same shape and reuses one compilation.

  Args:
    params, spec, method, method_spec, cache_dtype, mode, prompt_len, prefill_chunk:
      see `window_nll`.
    windows: int [W, T].
    batch_size: windows per forward call.
    progress: show a tqdm bar (tokens consumed).
    desc: bar label.
    allow_beyond_max_seq_len: windows longer than spec.max_seq_len are an error unless
      this is set (positions past the trained context give plausible, wrong PPLs).
  Returns:
    PerplexityResult.
  Raises:
    ValueError: bad windows / batch size, or windows beyond spec.max_seq_len.
  """
  windows = np.asarray(windows, np.int32)
  if windows.ndim != 2 or windows.shape[1] < 2:
    raise ValueError(f"windows must be [W, T>=2], got shape {windows.shape}")
  if batch_size <= 0:
    raise ValueError(f"eval.batch_size must be positive, got {batch_size}")
  w, t = windows.shape
  if t > spec.max_seq_len and not allow_beyond_max_seq_len:
    raise ValueError(f"eval.seq_len={t} exceeds the model's max_seq_len={spec.max_seq_len} "
                     "(set eval.allow_beyond_max_seq_len=True to evaluate past the trained "
                     "context anyway)")
  bar = None
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    fed = len(schedule(t, mode, prompt_len, prefill_chunk))
    per_window = sum(e - s for s, e in schedule(t, mode, prompt_len, prefill_chunk))
    bar = tqdm(total=-(-w // batch_size) * per_window, desc=desc or mode, unit="tok",
               leave=False, postfix=f"{fed} calls/batch")
  start = time.perf_counter()
  per_window_nll = []
  for i in range(0, w, batch_size):
    batch = windows[i:i + batch_size]
    n = len(batch)
    if n < batch_size:
      batch = np.concatenate([batch, np.repeat(batch[-1:], batch_size - n, axis=0)])
    nll = window_nll(params, batch, spec=spec, method=method, method_spec=method_spec,
                     cache_dtype=cache_dtype, mode=mode, prompt_len=prompt_len,
                     prefill_chunk=prefill_chunk, progress=bar,
                     allow_beyond_max_seq_len=allow_beyond_max_seq_len)
    per_window_nll.extend(nll[:n].astype(np.float64).sum(axis=1))
  if bar is not None:
    bar.close()
  nll_sum = float(np.sum(per_window_nll))
  n_tokens = w * (t - 1)
  return PerplexityResult(
      mode=mode, ppl=math.exp(nll_sum / n_tokens), nll_sum=nll_sum, n_tokens=n_tokens,
      n_windows=w, seq_len=t, window_ppl=[math.exp(x / (t - 1)) for x in per_window_nll],
      seconds=time.perf_counter() - start)
