"""Generation drift: how far a compressed cache moves greedy generation off the dense one.

Perplexity scores a cache on reference text; a generation reads its own tokens back, so
small errors can compound. Over fixed prompts (the harness uses the first tokens of its
WikiText-2 evaluation windows) and N generated tokens this measures:

  * greedy match: the fraction of positions i < N at which the method's greedy token
    equals the dense model's greedy token (each model generating from its own previous
    tokens, as a user would see it). Positions after a first divergence still count,
    so this is not the length of the common prefix (`first_mismatch` reports that).
  * KL: the mean over prompts and positions of KL(p_dense || p_method) of the next-token
    distributions along the DENSE model's greedy trajectory: the method's cache is
    teacher-forced with the dense tokens, so both distributions condition on the same
    context (the prompt, then the dense tokens 0..i-1). N distributions per prompt:
    after the prompt, then after each of the first N-1 dense tokens.

Both run through the real decode path: one prefill `forward` call over the prompt with
the method's cache, then one `forward` call per token (T = 1), exactly the calls of
kvlowrank.generate (which the tests check token for token). The reference is the dense
(exact) cache with the unmodified model parameters at the given cache dtype, so the
bf16 dense baseline of a report has match 1 and KL 0 by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache.base import init_caches
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec


@functools.partial(jax.jit, static_argnames=("spec", "n_tokens"))
def _rollout(params, prompts, caches, teacher, force, *, spec: ModelSpec, n_tokens: int):
  """Prefill `prompts` [B, P], then N - 1 decode steps.

  Token i fed back is teacher[:, i] where `force` (traced bool) else the argmax of the
  current logits (greedy, as kvlowrank.generate.Greedy).
  Returns (tokens [B, N] int32: the token chosen at each step, log-probs [B, N, V] fp32:
  the next-token distribution each token was chosen from).
  """
  b, p = prompts.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, caches = forward(params, prompts, positions, caches, spec,
                           logits_at=jnp.full((b,), p - 1, jnp.int32))

  def choose(logits, i):
    return jnp.where(force, teacher[:, i], jnp.argmax(logits, axis=-1).astype(jnp.int32))

  def step(carry, i):
    logits, caches = carry
    tok = choose(logits, i)
    pos = jnp.full((b, 1), p + i, jnp.int32)
    new_logits, caches = forward(params, tok[:, None], pos, caches, spec)
    return (new_logits[:, 0], caches), (tok, jax.nn.log_softmax(logits, axis=-1))

  (last, _), (toks, logps) = jax.lax.scan(step, (logits[:, 0], caches),
                                          jnp.arange(n_tokens - 1, dtype=jnp.int32))
  toks = jnp.concatenate([toks.T, choose(last, n_tokens - 1)[:, None]], axis=1)
  logps = jnp.concatenate([jnp.swapaxes(logps, 0, 1),
                           jax.nn.log_softmax(last, axis=-1)[:, None]], axis=1)
  return toks, logps


def rollout(params, spec: ModelSpec, prompts, n_tokens: int, *, method: str = "dense",
            method_spec=None, cache_dtype=jnp.bfloat16, teacher=None
            ) -> tuple[np.ndarray, np.ndarray]:
  """Greedy (or teacher-forced) decoding of equal-length prompts through a fresh cache.

  Args:
    params: parameters (a method's calibrated ones for a calibrated method).
    spec: ModelSpec.
    prompts: int [B, P] token ids (no padding).
    n_tokens: N >= 1 tokens to decode.
    method, method_spec: registered cache method and its spec (dense: DenseSpec()).
    cache_dtype: cache storage dtype.
    teacher: optional int [B, N]: feed these tokens instead of the greedy ones.
  Returns:
    (tokens int32 [B, N], log-probs float32 [B, N, V]) as numpy arrays.
  """
  if method_spec is None:
    from kvlowrank.methods import DenseSpec  # pylint: disable=import-outside-toplevel
    method_spec = DenseSpec()
  prompts = jnp.asarray(prompts, jnp.int32)
  b, p = prompts.shape
  caches = init_caches(method, method_spec, spec, params, batch=b, capacity=p + n_tokens,
                       dtype=cache_dtype)
  force = teacher is not None
  teacher = jnp.zeros((b, n_tokens), jnp.int32) if teacher is None else \
      jnp.asarray(teacher, jnp.int32)
  toks, logps = _rollout(params, prompts, caches, teacher, jnp.asarray(force),
                         spec=spec, n_tokens=n_tokens)
  return np.asarray(toks), np.asarray(logps)


def kl_divergence(logp_ref, logp) -> np.ndarray:
  """KL(p_ref || p) over the last axis, in float64; log-probs in, [...] out."""
  lr = np.asarray(logp_ref, np.float64)
  lq = np.asarray(logp, np.float64)
  pr = np.exp(lr)
  # 0 * log 0 = 0: terms where the reference has no mass never contribute.
  return np.sum(pr * np.where(pr > 0, lr - lq, 0.0), axis=-1)


@dataclasses.dataclass(frozen=True)
class DriftResult:
  """Outcome of one drift measurement (JSON-friendly through `asdict`)."""

  greedy_match: float      # fraction of identical greedy tokens, over prompts x N
  kl: float                # mean KL(dense || method) along the dense trajectory (nats)
  kl_max: float            # largest per-position KL
  first_mismatch: float    # mean index of the first differing token (N if none)
  n_prompts: int
  n_tokens: int
  prompt_len: int
  seconds: float

  def asdict(self) -> dict:
    return dataclasses.asdict(self)


def reference(params, spec: ModelSpec, prompts, n_tokens: int, cache_dtype=jnp.bfloat16
              ) -> tuple[np.ndarray, np.ndarray]:
  """The dense model's greedy tokens [B, N] and their log-probs [B, N, V] (the baseline
  every method is compared with; callers may memoise it across methods)."""
  return rollout(params, spec, prompts, n_tokens, method="dense", cache_dtype=cache_dtype)


def drift(ref_params, params, spec: ModelSpec, prompts, n_tokens: int, *, method: str,
          method_spec, cache_dtype=jnp.bfloat16, ref: Optional[tuple] = None
          ) -> DriftResult:
  """Generation drift of `method` against the dense model (see the module docstring).

  Args:
    ref_params: the loaded (uncalibrated) model's parameters: the dense reference.
    params: the parameters the method runs with (calibrated ones where it calibrates).
    spec: ModelSpec.
    prompts: int [B, P] equal-length prompts.
    n_tokens: N generated tokens per prompt.
    method, method_spec: the registered cache method and its spec.
    cache_dtype: cache storage dtype (the dense reference uses it too).
    ref: optional precomputed `reference(ref_params, spec, prompts, n_tokens,
      cache_dtype)`.
  Returns:
    DriftResult.
  """
  prompts = np.asarray(prompts, np.int32)
  if prompts.ndim != 2 or prompts.shape[1] < 1:
    raise ValueError(f"drift prompts must be int [B, P >= 1], got shape {prompts.shape}")
  if n_tokens < 1:
    raise ValueError(f"drift n_tokens must be >= 1, got {n_tokens}")
  start = time.perf_counter()
  ref_toks, ref_logp = ref if ref is not None else reference(
      ref_params, spec, prompts, n_tokens, cache_dtype)
  toks, _ = rollout(params, spec, prompts, n_tokens, method=method,
                    method_spec=method_spec, cache_dtype=cache_dtype)
  _, logp = rollout(params, spec, prompts, n_tokens, method=method,
                    method_spec=method_spec, cache_dtype=cache_dtype, teacher=ref_toks)
  same = toks == ref_toks
  first = np.where(same.all(axis=1), n_tokens, np.argmin(same, axis=1))
  kl = kl_divergence(ref_logp, logp)
  return DriftResult(greedy_match=float(same.mean()), kl=float(kl.mean()),
                     kl_max=float(kl.max()), first_mismatch=float(first.mean()),
                     n_prompts=int(prompts.shape[0]), n_tokens=int(n_tokens),
                     prompt_len=int(prompts.shape[1]),
                     seconds=time.perf_counter() - start)
