"""Cache protocol v1.

A model-level cache is a tuple with one cache per layer. Each per-layer cache is
a frozen dataclass registered as a pytree (arrays are leaves; shape-determining
fields are static metadata), so caches flow through `jax.jit` and `lax` loops.
All methods are pure and return new caches.

Addressing: slot s holds the token at position s (sequences start at 0), so a
cache of `capacity` slots holds positions [0, capacity). Tokens with position
< 0 are padding: never written, never attended. `lengths[b]` is one past the
highest position written for sequence b (ragged batches).

The attention block hands the cache everything a method may need (`AttnInputs`:
normed layer input x, pre- and post-RoPE keys, values, positions) plus the
layer's parameter dict; a cache stores what it wants (dense K/V, low-rank
latents of x, quantized codes...) and projections it does not use are removed
by XLA's dead-code elimination under jit.

`attend` returns (out [B,T,N,Hv], lse [B,T,N]) so that attention over several
segments (e.g. a compressed prefix and an exact recent window) can be merged
with `kvlowrank.model.attention.combine`. Its `implementation` argument (None: the
cache's own, from its method spec's `implementation` field; None there too: the fastest
that fits) picks the method's fused decode kernel or its jnp reference
(`kvlowrank.cache.dispatch`): the cache's arrays are the kernel's operands. Hv is the cache's value width: the
head dim for caches that reconstruct V, a latent rank for caches whose value
reconstruction is folded into W_o (Palu).

Cross-layer caches (XQuant-CL) override `step`, which threads a `carry` from
layer i to layer i+1 within one forward call; per-layer caches ignore it.

Capacity: a call may not hand a cache more tokens than it has slots, nor a position
>= its capacity (such a token used to be dropped like padding: wrong logits, no error).
`check_capacity` raises for what is known when the call is traced: the token axis T
(static shape; padding columns count) and the positions when they are concrete (eager
calls). Every subclass's `update` runs it (`KVCache.__init_subclass__`), and
`kvlowrank.model.forward` runs it once per call. Positions traced under `jit` are not
known then: `forward` turns the logits of a row with a position beyond the capacity
into NaN (`poison_rows`), so the error shows up instead of a plausible wrong answer.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import dispatch
from kvlowrank.spec import ModelSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttnInputs:
  """What the attention block offers to a cache for the T new tokens."""

  x: jax.Array        # [B, T, D]   normed layer input (what feeds q/k/v_proj)
  k: jax.Array        # [B, T, K, H] keys after bias and RoPE
  k_pre: jax.Array    # [B, T, K, H] keys after bias, before RoPE
  v: jax.Array        # [B, T, K, H] values (after bias)
  positions: jax.Array  # [B, T] int32, <0 = padding


def scatter_slots(buf, new, positions):
  """Writes new [B, T, ...] into buf [B, S, ...] at slots = positions; padding dropped."""
  s = buf.shape[1]
  slots = jnp.where(positions >= 0, positions, s)  # out of range → dropped
  bidx = jnp.arange(buf.shape[0])[:, None]
  new = new.astype(buf.dtype)
  if buf.dtype in (jnp.bfloat16, jnp.float16):
    # Same bits, scattered as uint16: XLA:CPU has no 16-bit float scatter and otherwise
    # widens the whole buffer to f32 and back around every write.
    u16 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)
    out = u16(buf).at[bidx, slots].set(u16(new), mode="drop")
    return jax.lax.bitcast_convert_type(out, buf.dtype)
  return buf.at[bidx, slots].set(new, mode="drop")


def gather_rows(a, idx):
  """a [B, N, ...], idx [B, M] int -> a[b, idx[b, m]]: [B, M, ...] (per-row slot reads)."""
  return a[jnp.arange(a.shape[0])[:, None], idx]


def scatter_rows(buf, idx, ok, vals):
  """buf[b, idx[b, m]] = vals[b, m] where ok [B, M]; the other writes are dropped."""
  idx = jnp.where(ok, idx, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(vals.astype(buf.dtype),
                                                             mode="drop")


def mask_padding_queries(out, lse, q_positions, dtype):
  """A kernel's (out [B, T, N, Hv], lse [B, T, N]) with padding queries (position < 0) set
  to 0 and -inf, as the reference gives them, and out cast to `dtype`."""
  live = q_positions >= 0
  return (jnp.where(live[..., None, None], out, 0).astype(dtype),
          jnp.where(live[..., None], lse, -jnp.inf))


def new_lengths(lengths, positions):
  """lengths [B] updated with the highest valid position + 1 among positions [B, T]."""
  return jnp.maximum(lengths, jnp.max(jnp.where(positions >= 0, positions + 1, 0), axis=1)
                     ).astype(jnp.int32)


def concrete(x) -> Optional[np.ndarray]:
  """x as a numpy array when its value is known now (not a tracer), else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
          TypeError):
    return None


def check_capacity(capacity: int, positions, what: str = "cache capacity",
                   hint: str = "allocate capacity >= the context length") -> None:
  """Raises when tokens cannot fit a cache of `capacity` slots (module docstring).

  Args:
    capacity: the cache's slots (positions [0, capacity)).
    positions: [B, T] int positions of the new tokens (< 0: padding).
    what, hint: how the message names the limit, and what to do.
  Raises:
    ValueError: T > capacity (static), or a concrete position >= capacity.
  """
  t = positions.shape[-1]
  if t > capacity:
    raise ValueError(f"{t} tokens in one call exceed the {what}={capacity}: {hint}")
  pos = concrete(positions)
  if pos is not None and pos.size and int(pos.max()) >= capacity:
    raise ValueError(f"position {int(pos.max())} is beyond the {what}={capacity} "
                     f"(positions [0, {capacity})): {hint}")


def poison_rows(logits, positions, limit: int):
  """logits [B, T', V] with every row that has a position >= limit set to NaN (the
  traced-position counterpart of `check_capacity`)."""
  over = jnp.any(positions >= limit, axis=-1)
  return jnp.where(over[:, None, None], jnp.nan, logits)


def _checked_update(update):
  @functools.wraps(update)
  def wrapper(self, inputs, lp, *args, **kwargs):
    check_capacity(self.capacity, inputs.positions, f"{type(self).__name__} capacity")
    return update(self, inputs, lp, *args, **kwargs)
  wrapper._capacity_checked = True  # pylint: disable=protected-access
  return wrapper


def update_unchecked(cache, inputs: AttnInputs, lp):
  """`cache.update` without its static token-count check (`check_capacity`), for callers
  that hand it more token columns than it has slots, the surplus as padding (position -1):
  the eviction wrapper (its evicted candidates), and a cache that stores through an inner
  cache of its own capacity after checking its own (FDC/ZACK's quantized K'/V')."""
  update = type(cache).update
  return getattr(update, "__wrapped__", update)(cache, inputs, lp)


class KVCache(abc.ABC):
  """Protocol every per-layer cache implements (see module docstring)."""

  name: ClassVar[str] = "abstract"

  def __init_subclass__(cls, **kwargs):
    """Wraps a subclass's own `update` with `check_capacity` (module docstring)."""
    super().__init_subclass__(**kwargs)
    upd = cls.__dict__.get("update")
    if upd is not None and not getattr(upd, "__isabstractmethod__", False) and not getattr(
        upd, "_capacity_checked", False):
      cls.update = _checked_update(upd)

  @property
  @abc.abstractmethod
  def capacity(self) -> int:
    ...

  @property
  @abc.abstractmethod
  def lengths(self) -> jax.Array:
    ...

  @abc.abstractmethod
  def update(self, inputs: AttnInputs, lp: dict) -> "KVCache":
    """Stores the new tokens; returns the new cache."""

  @abc.abstractmethod
  def attend(self, q, q_positions, lp: dict, *, spec: ModelSpec,
             implementation: Optional[str] = None):
    """q [B,T,N,H] (RoPE applied) → (out [B,T,N,Hv], lse [B,T,N]).

    implementation: None (the cache's own choice) | "reference" | one of the method's
    kernels (`kvlowrank.cache.dispatch`)."""

  def kernel_candidates(self, q_shape) -> list:
    """This cache's decode kernels for queries [B, N, H], fastest first, as
    `dispatch.Candidate`s (name, needs, fit); none by default."""
    del q_shape
    return []

  def choose_implementation(self, q_shape, implementation: Optional[str] = None,
                            platform=None) -> tuple[str, Optional[str]]:
    """(what `attend` runs for queries of shape [B, T, N, H], the reason when it is not the
    fastest kernel): `dispatch.choose` over `kernel_candidates`, with the cache's own
    `implementation` unless one is given; no kernel takes a sliding window."""
    req = getattr(self, "implementation", None) if implementation is None else implementation
    return self.choose_requested(q_shape, req, platform)

  def choose_requested(self, q_shape, req: Optional[str], platform=None):
    """`choose_implementation` for the request `req` as given (None: the fastest that fits,
    not the cache's own): for caches that map their own request names first."""
    b, t, n, h = q_shape
    cands = self.kernel_candidates((b, n, h))
    if not cands:
      return dispatch.REFERENCE, None if req == dispatch.REFERENCE else "no decode kernel"
    if getattr(self, "sliding_window", None) is not None:
      cands = [(name, needs, lambda: "sliding-window attention") for name, needs, _ in cands]
    return dispatch.choose(self.name, req, cands, decode=t == 1, platform=platform)

  def decode_implementation(self, q_shape, implementation: Optional[str] = None) -> str:
    """`choose_implementation` for this machine, logging once why a kernel does not run."""
    impl, reason = self.choose_implementation(q_shape, implementation)
    dispatch.log_once(self.name, impl, reason)
    return impl

  @abc.abstractmethod
  def materialize(self):
    """Dense reconstruction (k [B,S,K,H] post-RoPE, v [B,S,K,H], valid [B,S]). Test oracle."""

  def shard_axes(self) -> dict:
    """How this cache splits over a (data, model) mesh (`kvlowrank.parallel`).

    Returns {path prefix: (batch axis, head axis)} covering every array leaf, a path being
    `jax.tree_util.keystr` of a leaf (".k", ".store" for all of a sub-tree's leaves); the
    head axis is the one of KV heads (or latent groups, whole on one device), None for an
    array every device of the model axis keeps whole; the batch axis is None for weights
    kept on the cache. A cache that does not declare it cannot be sharded."""
    raise NotImplementedError(f"{type(self).__name__} does not declare shard_axes(): it "
                              f"cannot be split over a mesh")

  def rows_per_pass(self) -> Optional[int]:
    """How many batch rows one forward pass may run on this cache at once (None: any). A
    cache whose step holds temporaries of rows × capacity beyond its own storage (XQuant-CL's
    fp32 carry) bounds them; `kvlowrank.model.forward` then runs the batch that many rows at a
    time (`kvlowrank.model.row_slices`)."""
    return None

  def for_spec(self, spec: ModelSpec) -> "KVCache":
    """This cache with `spec` as the model spec it keeps (if any): `kvlowrank.parallel`
    hands each device its local spec (its share of the heads) and takes the global one
    back."""
    del spec
    return self

  def deferring(self, on: bool) -> "KVCache":
    """This cache with its one-token updates leaving periodic work for `settle` (on) or
    doing it themselves (off). `kvlowrank.model.forward` runs `settle_step` at the start of a
    decode step (T = 1: the work the previous step left) and turns deferring on for its
    layers: one `lax.cond` per step for every layer, where a conditional in each layer's
    update was measurably slower (GEAR's chunk compression: `results/gear_kernel.md`).
    So a decode step's result may hold deferred work; every reader (`attend`, `segments`,
    `materialize`, a later update) accepts it. Default: no deferred work (this cache
    unchanged)."""
    del on
    return self

  def pending(self) -> Optional[jax.Array]:
    """A scalar bool: `settle` has work (a deferred update left it), or None (never)."""
    return None

  def settle(self) -> "KVCache":
    """Does the deferred work (run under `settle_step`'s conditional where `pending`)."""
    return self

  def nbytes(self) -> int:
    """Bytes of cache storage actually allocated (all array leaves)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))

  def step(self, inputs: AttnInputs, q, lp: dict, carry: Any, *, spec: ModelSpec):
    """update then attend; cross-layer caches override to use `carry`."""
    cache = self.update(inputs, lp)
    out, lse = cache.attend(q, inputs.positions, lp, spec=spec)
    return out, lse, cache, carry


_REGISTRY: dict[str, Callable[..., tuple]] = {}


def register_cache(name: str):
  """Registers a model-level cache factory: f(method_spec, model_spec, params, *, batch,
  capacity, dtype) -> tuple of per-layer caches."""
  def deco(factory):
    if name in _REGISTRY:
      raise ValueError(f"cache method {name!r} registered twice")
    _REGISTRY[name] = factory
    return factory
  return deco


def cache_methods() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def init_caches(method: str, method_spec, spec: ModelSpec, params, *, batch: int,
                capacity: int, dtype=jnp.bfloat16) -> tuple:
  """Builds the model-level cache (tuple of per-layer caches) for a registered method."""
  if method not in _REGISTRY:
    # The built-in caches register themselves when their method packages are imported; a
    # caller that reached this protocol module directly may not have imported them yet.
    import kvlowrank.methods  # noqa: F401  pylint: disable=import-outside-toplevel
  if method not in _REGISTRY:
    raise ValueError(f"unknown cache method {method!r}; known: {', '.join(cache_methods())}")
  if capacity <= 0 or batch <= 0:
    raise ValueError(f"cache capacity and batch must be positive, got {capacity}, {batch}")
  return _REGISTRY[method](method_spec, spec, params, batch=batch, capacity=capacity,
                           dtype=dtype)


def leaf_axes(cache) -> tuple[list, Any]:
  """([(keystr path, leaf, (batch axis, head axis))] for every array leaf of `cache`, treedef):
  each leaf's axes from the longest prefix of its path that the cache's `shard_axes()`
  declares. Raises a one-line ValueError naming a leaf it does not cover."""
  axes = cache.shard_axes()
  leaves, treedef = jax.tree_util.tree_flatten_with_path(cache)
  out = []
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path)
    hits = [p for p in axes
            if key == p or (key.startswith(p) and key[len(p)] in ".[")]
    if not hits:
      raise ValueError(f"{type(cache).__name__}{key}: the cache's shard_axes() does not "
                       f"say how this array splits")
    out.append((key, leaf, axes[max(hits, key=len)]))
  return out, treedef


def settle_step(caches) -> tuple:
  """The caches' deferred work (`KVCache.deferring`) under one `lax.cond` on the OR of their
  `pending` flags, deferring turned off. `forward` runs it before a decode step's layers
  (the previous step's work), so the step's attention reads what the conditional wrote. The
  work's array writes must be able to run in place: XLA copied two code arrays per layer
  through the conditional while KIVI's value write could not (measured:
  `results/gear_kernel.md`, "One conditional per decode step"; `kernels/kivi/store.py`,
  `_warp_values`)."""
  caches = tuple(c.deferring(False) for c in caches)
  flags = [c.pending() for c in caches]
  idx = [i for i, f in enumerate(flags) if f is not None]
  if not idx:
    return caches
  sub = tuple(caches[i] for i in idx)
  sub = jax.lax.cond(functools.reduce(jnp.logical_or, [flags[i] for i in idx]),
                     lambda s: tuple(c.settle() for c in s), lambda s: s, sub)
  out = list(caches)
  for i, c in zip(idx, sub):
    out[i] = c
  return tuple(out)


def begin_decode_step(caches) -> tuple:
  """The caches as a decode (one-token) call takes them: the previous decode call's deferred
  work done (`settle_step`), deferring on. `model.forward` and `model.segments` call it."""
  return tuple(c.deferring(True) for c in settle_step(caches))


def end_decode_step(caches) -> tuple:
  """The caches a decode call returns: deferring off (their deferred work stays pending)."""
  return tuple(c.deferring(False) for c in caches)


def caches_nbytes(caches) -> int:
  return int(sum(c.nbytes() for c in caches))


def static_field(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)
