"""Jitted batched generation: one prefill call, then a `lax.while_loop` of decode steps.

Prompts of different lengths are right-padded (to a multiple of WIDTH_BUCKET): row b
holds its prompt at columns [0, len_b) with positions 0..len_b-1, and padding columns
get position -1 (never written to the cache, never attended; kvlowrank/cache/base.py).
Column t of the prefill is therefore slot t of every row's cache, which keeps
per-token-group caches (KIVI-style groups along the token axis) aligned across rows.
Each row then decodes at its own position len_b, len_b + 1, ...; a row that has emitted
an EOS id feeds position -1 (a no-op for its cache) until the whole batch is done or
max_new_tokens is reached.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.methods import DenseSpec, init_caches
from kvlowrank.generate.sampling import Greedy, Sampler
from kvlowrank import parallel
from kvlowrank.model import xla_options
from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec

PAD_TOKEN = -1  # fills `tokens` beyond each row's length in the raw [B, max_new] buffer
# Prompt widths and EOS-id lists are padded up to multiples of these, so that prompts of
# similar lengths (and different EOS sets) reuse one compiled prefill / decode loop.
WIDTH_BUCKET = 8
EOS_BUCKET = 8
_BARS: list = []  # the open progress bar of `generate(..., progress=True)`, if any


def bucket(n: int) -> int:
  """n rounded up to a multiple of 2**max(4, bit_length(n) - 4): at most 1/8 more (16 for
  n <= 128). The default cache capacity and the decode loop's output width are bucketed,
  so calls whose prompt and max_new_tokens differ a little reuse one compiled prefill and
  decode loop instead of compiling their own."""
  step = 1 << max(4, int(n).bit_length() - 4)
  return -(-int(n) // step) * step


def _tick(step):
  """Host side of the decode loop's progress callback: `step` tokens generated so far."""
  if _BARS and int(step) > _BARS[-1].n:
    _BARS[-1].update(int(step) - _BARS[-1].n)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """Generated continuations, one entry per prompt.

  tokens: generated ids per row, *excluding* the EOS id that stopped the row.
  lengths: len(tokens[b]).
  stop_reasons: "eos" (row emitted one of `eos_ids`) or "max_new_tokens".
  decode_steps: decode forward calls run by the while loop (after the prefill).
  """

  tokens: tuple[tuple[int, ...], ...]
  lengths: tuple[int, ...]
  stop_reasons: tuple[str, ...]
  decode_steps: int


def _is_eos(tokens, eos_ids):
  """tokens [B], eos_ids [E] (padded with -1, which no token equals) → [B] bool."""
  return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def _forward(mesh):
  """The model's forward on one device (mesh None) or on a mesh (`kvlowrank.parallel`)."""
  return forward if mesh is None else functools.partial(parallel.forward, mesh)


# No buffer donation: a cache method may keep arrays that alias params (factors).
@functools.partial(jax.jit, static_argnames=("spec", "sampler", "allow", "mesh"))
def _prefill(params, tokens, positions, last_idx, caches, rng, *, spec: ModelSpec,
             sampler: Sampler, allow: bool = False, mesh=None):
  """Prompt pass: fills the caches, samples each row's first new token [B]."""
  logits, caches = _forward(mesh)(params, tokens, positions, caches, spec,
                                  logits_at=last_idx, allow_beyond_max_seq_len=allow)
  return sampler.next_tokens(logits[:, 0], rng), caches


@functools.partial(jax.jit, static_argnames=("spec", "sampler", "width", "allow",
                                             "progress", "mesh"),
                   compiler_options=xla_options.DECODE)
def _decode(params, first, next_pos, eos_ids, max_new_tokens, caches, rng, *,
            spec: ModelSpec, sampler: Sampler, width: int, allow: bool = False,
            progress: bool = False, mesh=None):
  """Decode loop. first [B] (sampled by the prefill), next_pos [B] = prompt lengths,
  eos_ids [E] int32 padded with -1, max_new_tokens a traced int32 <= width (the output
  buffer's static width, `bucket(max_new_tokens)`).

  Returns (out [B, width] with PAD_TOKEN past each row's end, n_generated [B]
  counting the EOS token, hit_eos [B], steps). `progress` adds a host callback per step
  (kvlowrank.generate.loop._tick); without it the loop has none.
  """
  b = first.shape[0]
  out = jnp.full((b, width), PAD_TOKEN, jnp.int32).at[:, 0].set(first)
  hit_eos = _is_eos(first, eos_ids)
  n_gen = jnp.ones((b,), jnp.int32)

  def cond(state):
    i, _, _, _, done, _, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, out, tok, pos, done, n_gen, caches, rng = state
    rng, sub = jax.random.split(rng)
    step_pos = jnp.where(done, -1, pos)  # finished rows: padding, cache untouched
    logits, caches = _forward(mesh)(params, tok[:, None], step_pos[:, None], caches, spec,
                                    allow_beyond_max_seq_len=allow)
    new = sampler.next_tokens(logits[:, 0], sub)
    live = ~done
    out = out.at[:, i].set(jnp.where(live, new, PAD_TOKEN))
    tok = jnp.where(live, new, tok)
    n_gen = n_gen + live
    pos = pos + live
    eos_now = live & _is_eos(new, eos_ids)
    if progress:
      jax.debug.callback(_tick, i + 1)
    return i + 1, out, tok, pos, done | eos_now, n_gen, caches, rng

  done0 = hit_eos | (max_new_tokens <= 1)
  state = (jnp.int32(1), out, first, next_pos, done0, n_gen, caches, rng)
  state = jax.lax.while_loop(cond, body, state)
  i, out, tok, _, _, n_gen, _, _ = state
  return out, n_gen, _is_eos(tok, eos_ids), i - 1


def _check_prompts(prompts, spec: ModelSpec) -> list[list[int]]:
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  rows = []
  for i, p in enumerate(prompts):
    row = [int(t) for t in p]
    if not row:
      raise ValueError(f"prompt {i} is empty: generation needs at least one token")
    bad = [t for t in row if not 0 <= t < spec.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside [0, {spec.vocab_size}): {bad[:5]}")
    rows.append(row)
  return rows


def generate(params, spec: ModelSpec, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, sampler: Sampler = Greedy(),
             rng: Optional[jax.Array] = None, cache_method: str = "dense",
             cache_spec=DenseSpec(), cache_dtype=None,
             eos_ids: Optional[Sequence[int]] = None,
             capacity: Optional[int] = None,
             allow_beyond_max_seq_len: bool = False,
             progress: bool = False, mesh=None) -> GenerationResult:
  """Generates continuations of a batch of prompts with a registered KV cache.

  Args:
    params: parameter pytree (kvlowrank.model.params layout; methods' extra entries ok).
    spec: static ModelSpec.
    prompts: B token-id lists, possibly of different lengths.
    max_new_tokens: tokens to generate per row at most (>= 1), EOS included.
    sampler: a kvlowrank.generate.sampling sampler (static; hashable).
    rng: PRNG key for stochastic samplers (default jax.random.key(0)).
    cache_method: registered cache method name (see kvlowrank.cache.cache_methods()).
    cache_spec: that method's spec dataclass (DenseSpec() for "dense").
    cache_dtype: cache storage dtype; default: the dtype of params["embed"].
    eos_ids: ids that stop a row; default spec.eos_ids; () never stops early.
    capacity: cache slots (positions [0, capacity)); default `bucket(max prompt length +
      max_new_tokens)` (at most 1/8 more, so that nearby lengths share compiled code). At
      least the padded prompt width is allocated (the prefill call hands the cache that
      many columns, padding included).
    allow_beyond_max_seq_len: let prompt + max_new_tokens run past spec.max_seq_len
      (the model's trained context); by default an error.
    progress: show a tqdm bar of the tokens generated (a host callback per decode step).
    mesh: a `kvlowrank.parallel.make_mesh` (data, model) mesh to decode on several devices
      (KV heads split over "model", prompts over "data"); None: one device.
  Returns:
    GenerationResult.
  Raises:
    ValueError: bad prompts, max_new_tokens < 1, a prompt that with max_new_tokens
      does not fit in `capacity`, or that runs past spec.max_seq_len unless allowed.
  """
  rows = _check_prompts(prompts, spec)
  if int(max_new_tokens) < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  max_new_tokens = int(max_new_tokens)
  lens = np.array([len(r) for r in rows], np.int32)
  longest = int(np.argmax(lens))
  if capacity is None:
    capacity = bucket(int(lens.max()) + max_new_tokens)
  if lens[longest] > capacity:
    raise ValueError(f"prompt {longest} has {lens[longest]} tokens, more than the cache "
                     f"capacity={capacity}")
  if lens[longest] + max_new_tokens > capacity:
    raise ValueError(f"prompt {longest} ({lens[longest]} tokens) + max_new_tokens="
                     f"{max_new_tokens} exceeds the cache capacity={capacity}")
  if lens[longest] + max_new_tokens - 1 > spec.max_seq_len and not allow_beyond_max_seq_len:
    raise ValueError(f"prompt {longest} ({lens[longest]} tokens) + max_new_tokens="
                     f"{max_new_tokens} runs past the model's max_seq_len="
                     f"{spec.max_seq_len} (allow_beyond_max_seq_len=True to run anyway)")
  eos_ids = tuple(int(e) for e in (spec.eos_ids if eos_ids is None else eos_ids))
  rng = jax.random.key(0) if rng is None else rng
  cache_dtype = params["embed"].dtype if cache_dtype is None else cache_dtype

  b = len(rows)
  width = -(-int(lens.max()) // WIDTH_BUCKET) * WIDTH_BUCKET
  tokens = np.zeros((b, width), np.int32)  # pad id 0: any valid id, masked by position -1
  positions = np.full((b, width), -1, np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
    positions[i, :len(r)] = np.arange(len(r))
  if mesh is not None:
    parallel.check_layout(spec, mesh, batch=b)
  caches = init_caches(cache_method, cache_spec, spec, params, batch=b,
                       capacity=max(capacity, width), dtype=cache_dtype)
  if mesh is not None:
    params, caches = parallel.shard_params(params, spec, mesh), parallel.shard_caches(caches,
                                                                                       mesh)
  rng_prefill, rng_decode = jax.random.split(rng)
  first, caches = _prefill(params, jnp.asarray(tokens), jnp.asarray(positions),
                           jnp.asarray(lens - 1), caches, rng_prefill, spec=spec,
                           sampler=sampler, allow=bool(allow_beyond_max_seq_len), mesh=mesh)
  eos = np.full(max(1, -(-len(eos_ids) // EOS_BUCKET)) * EOS_BUCKET, -1, np.int32)
  eos[:len(eos_ids)] = eos_ids
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
    _BARS.append(tqdm(total=max_new_tokens, desc=f"generating ({cache_method})",
                      unit="tok", leave=False, initial=1))
  try:
    out, n_gen, hit_eos, steps = _decode(
        params, first, jnp.asarray(lens), jnp.asarray(eos), jnp.int32(max_new_tokens), caches,
        rng_decode, spec=spec, sampler=sampler, width=bucket(max_new_tokens),
        allow=bool(allow_beyond_max_seq_len), progress=progress, mesh=mesh)
    out, n_gen, hit_eos, steps = jax.device_get((out, n_gen, hit_eos, steps))
    if progress:
      jax.effects_barrier()  # every step's callback has run
  finally:
    if progress:
      _BARS.pop().close()
  toks, reasons = [], []
  for i in range(b):
    n = int(n_gen[i]) - int(bool(hit_eos[i]))  # drop the stopping EOS id
    toks.append(tuple(int(t) for t in out[i, :n]))
    reasons.append("eos" if hit_eos[i] else "max_new_tokens")
  return GenerationResult(tokens=tuple(toks), lengths=tuple(len(t) for t in toks),
                          stop_reasons=tuple(reasons), decode_steps=int(steps))
