"""Shared by the eviction tests: a prompt prefilled in one call, then one token per call."""

import jax
import jax.numpy as jnp

from kvlowrank.model.transformer import forward

_forward = jax.jit(forward, static_argnums=(4,))


def prefill_then_decode(params, spec, caches, tokens, positions, prompt: int):
  """Feeds tokens[:, :prompt] in one call, then each later token alone; returns (logits
  [B, T, V], the caches after every call)."""
  logits, caches = _forward(params, tokens[:, :prompt], positions[:, :prompt], caches, spec)
  out, states = [logits], [caches]
  for i in range(prompt, tokens.shape[1]):
    lg, caches = _forward(params, tokens[:, i:i + 1], positions[:, i:i + 1], caches, spec)
    out.append(lg)
    states.append(caches)
  return jnp.concatenate(out, axis=1), states
