"""Exact dense K/V cache (bf16 or fp32): the oracle every compressed cache is tested against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvlowrank.cache import base
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class DenseSpec:
  """No knobs: stores post-RoPE K and V at the cache dtype."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache(base.KVCache):
  k: jax.Array        # [B, S, K, H] post-RoPE keys
  v: jax.Array        # [B, S, K, H]
  lens: jax.Array     # [B] int32
  sliding_window: int | None = base.static_field(default=None)

  name = "dense"

  @classmethod
  def init(cls, spec: ModelSpec, *, batch: int, capacity: int, dtype=jnp.bfloat16):
    shape = (batch, capacity, spec.n_kv_heads, spec.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lens=jnp.zeros((batch,), jnp.int32), sliding_window=spec.sliding_window)

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  @property
  def lengths(self):
    return self.lens

  def update(self, inputs: base.AttnInputs, lp):
    pos = inputs.positions
    return dataclasses.replace(
        self, k=base.scatter_slots(self.k, inputs.k, pos),
        v=base.scatter_slots(self.v, inputs.v, pos), lens=base.new_lengths(self.lens, pos))

  def slot_positions(self):
    b, s = self.k.shape[:2]
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return k_pos, k_pos < self.lens[:, None]

  def attend(self, q, q_positions, lp, *, spec: ModelSpec):
    k_pos, valid = self.slot_positions()
    return dot_product_attention(q, self.k, self.v, q_positions, k_pos, valid,
                                 sliding_window=self.sliding_window, out_dtype=q.dtype)

  def materialize(self):
    _, valid = self.slot_positions()
    return self.k, self.v, valid

  def bytes_per_token(self) -> float:
    return 2 * self.k.shape[2] * self.k.shape[3] * self.k.dtype.itemsize


@base.register_cache("dense")
def _make_dense(method_spec, spec: ModelSpec, params, *, batch, capacity, dtype):
  return tuple(DenseCache.init(spec, batch=batch, capacity=capacity, dtype=dtype)
               for _ in range(spec.n_layers))
