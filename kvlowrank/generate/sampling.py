"""Token samplers: frozen, hashable dataclasses (static args of the jitted decode loop).

Each implements `next_tokens(logits [B, V] fp32, rng) -> [B] int32`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from kvlowrank import config_lib


class Sampler(abc.ABC):
  """Picks the next token of every row from its logits."""

  @abc.abstractmethod
  def next_tokens(self, logits, rng):
    """logits [B, V] fp32, rng a PRNG key → next tokens [B] int32."""


def _check_temperature(temperature: float, who: str):
  if not temperature > 0:
    raise ValueError(f"{who}.temperature must be > 0 (use Greedy for argmax), got "
                     f"{temperature}")


@dataclasses.dataclass(frozen=True)
class Greedy(Sampler):
  """Argmax decoding (ties → lowest id, as jnp.argmax)."""

  def next_tokens(self, logits, rng):
    del rng
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Temperature(Sampler):
  """Samples from softmax(logits / temperature) over the full vocabulary."""

  temperature: float = 1.0

  def __post_init__(self):
    _check_temperature(self.temperature, "Temperature")

  def next_tokens(self, logits, rng):
    return jax.random.categorical(rng, logits / self.temperature, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopK(Sampler):
  """Samples among the k highest logits (Fan et al. 2018), after temperature scaling."""

  k: int
  temperature: float = 1.0

  def __post_init__(self):
    if int(self.k) < 1:
      raise ValueError(f"TopK.k must be >= 1, got {self.k}")
    _check_temperature(self.temperature, "TopK")

  def next_tokens(self, logits, rng):
    k = min(self.k, logits.shape[-1])
    top_logits, top_ids = jax.lax.top_k(logits / self.temperature, k)
    choice = jax.random.categorical(rng, top_logits, axis=-1)
    return jnp.take_along_axis(top_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP(Sampler):
  """Nucleus sampling (Holtzman et al. 2020): the smallest set of most likely tokens
  whose probability mass reaches p, after temperature scaling."""

  p: float
  temperature: float = 1.0

  def __post_init__(self):
    if not 0.0 < self.p <= 1.0:
      raise ValueError(f"TopP.p must be in (0, 1], got {self.p}")
    _check_temperature(self.temperature, "TopP")

  def next_tokens(self, logits, rng):
    scaled = logits / self.temperature
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep token i when the mass strictly before it is < p: the top token is always
    # kept and the kept set is the smallest prefix whose mass reaches p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < self.p, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(rng, kept, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


SAMPLERS = ("greedy", "temperature", "top_k", "top_p")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """The `sampler` section of a config: `name` picks the sampler; the other fields are
  used by the samplers that take them (temperature by all but greedy)."""

  name: str = "greedy"
  temperature: float = 1.0
  top_k: int = 50
  top_p: float = 0.9


def make_sampler(name: str, *, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None) -> Sampler:
  """Builds a sampler by name ("greedy", "temperature", "top_k", "top_p").

  Raises:
    ValueError: unknown name, or a missing/invalid parameter for that sampler.
  """
  if name == "greedy":
    return Greedy()
  if name == "temperature":
    return Temperature(temperature)
  if name == "top_k":
    if top_k is None:
      raise ValueError("sampler 'top_k' needs top_k")
    return TopK(top_k, temperature)
  if name == "top_p":
    if top_p is None:
      raise ValueError("sampler 'top_p' needs top_p")
    return TopP(top_p, temperature)
  raise ValueError(f"unknown sampler name {name!r}; known: {', '.join(SAMPLERS)}")


def sampler_from_config(section) -> Sampler:
  """ConfigDict `sampler` section → Sampler (unknown keys are a ValueError)."""
  cfg = config_lib.to_dataclass(section, SamplerConfig, where="sampler")
  return make_sampler(cfg.name, temperature=cfg.temperature, top_k=cfg.top_k,
                      top_p=cfg.top_p)
