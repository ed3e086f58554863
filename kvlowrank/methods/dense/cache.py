"""Exact dense K/V cache (bf16 or fp32): the oracle every compressed cache is tested against.

A decode step (T = 1) on a GPU runs the best dense decode kernel that fits
(`kvlowrank_kernels.dense.decode_attention`: cuDNN, else the Triton split-K kernel) on the
cache's own [B, S, K, H] arrays, so the compressed methods are compared with a fast
uncompressed cache, not with the jnp reference; everything else runs the reference
(`model.attention.dot_product_attention`, in query chunks for long prompts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from typing import Optional

from kvlowrank.cache import base, dispatch
from kvlowrank.model.attention import dot_product_attention
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels import dense as dense_kernels

IMPLEMENTATIONS = ("cudnn", "triton")   # the kernels, fastest first (besides "reference")
# Slots are allocated in whole 64-token tiles, the decode kernels' key blocks.
CAPACITY_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class DenseSpec:
  """Stores post-RoPE K and V at the cache dtype.

  implementation: None (the fastest that fits: `cache.dispatch`), "reference", "cudnn" or
    "triton".
  """

  implementation: Optional[str] = None

  def __post_init__(self):
    if self.implementation not in (None, dispatch.REFERENCE) + IMPLEMENTATIONS:
      raise ValueError(f"DenseSpec.implementation must be None, 'reference' or one of "
                       f"{IMPLEMENTATIONS}, got {self.implementation!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache(base.KVCache):
  k: jax.Array        # [B, S, K, H] post-RoPE keys
  v: jax.Array        # [B, S, K, H]
  lens: jax.Array     # [B] int32
  sliding_window: int | None = base.static_field(default=None)
  implementation: Optional[str] = base.static_field(default=None)

  name = "dense"

  def shard_axes(self) -> dict:
    """K/V split by KV head (`base.KVCache.shard_axes`)."""
    return {".k": (0, 2), ".v": (0, 2), ".lens": (0, None)}

  @classmethod
  def init(cls, spec: ModelSpec, *, batch: int, capacity: int, dtype=jnp.bfloat16,
           implementation: Optional[str] = None):
    capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
    shape = (batch, capacity, spec.n_kv_heads, spec.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lens=jnp.zeros((batch,), jnp.int32), sliding_window=spec.sliding_window,
               implementation=implementation)

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

  def kernel_candidates(self, q_shape):
    """cuDNN, then Triton, where they take a query [B, N, H] over this cache."""
    q = jax.ShapeDtypeStruct(q_shape, self.k.dtype)
    return [(name, "gpu", lambda name=name: dense_kernels.kernel_fit(q, self.k, self.v,
                                                                     self.lens, name))
            for name in IMPLEMENTATIONS]

  def attend(self, q, q_positions, lp, *, spec: ModelSpec, implementation=None):
    impl = self.decode_implementation(q.shape, implementation)
    if impl != dispatch.REFERENCE:
      out, lse = dense_kernels.decode_attention(q[:, 0], self.k, self.v, self.lens,
                                                out_dtype=q.dtype, implementation=impl)
      return base.mask_padding_queries(out[:, None], lse[:, None], q_positions, q.dtype)
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
  if isinstance(method_spec, Mapping):
    method_spec = DenseSpec(**method_spec)
  # Other methods' specs may build a dense cache (e.g. a baseline with extra knobs): only
  # an `implementation` field is read.
  impl = getattr(method_spec, "implementation", None)
  return tuple(DenseCache.init(spec, batch=batch, capacity=capacity, dtype=dtype,
                               implementation=impl)
               for _ in range(spec.n_layers))
