"""Dense decode attention as plain XLA ops on the cache dtype (the framework baseline).

Scores and the value product are bf16 einsums with float32 accumulation
(`preferred_element_type`), the masked softmax is float32. XLA lowers the two
einsums to batched GEMV/GEMM calls that each stream K or V once. XLA:CPU has no
bf16 x bf16 -> f32 dot, so on a CPU the operands are upcast first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import check_shapes


def matmul_dtype(dtype):
  """`dtype` for XLA products on the device; float32 on XLA:CPU (no bf16 x bf16 -> f32 dot)."""
  return jnp.float32 if jax.default_backend() == "cpu" else dtype


def decode_attention_xla(q, k, v, lengths, *, scale=None, out_dtype=None):
  """Same contract as `decode_attention_reference`, computed on the input dtype."""
  check_shapes(q, k, v, lengths)
  b, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  scale = h ** -0.5 if scale is None else scale
  k, v = k.astype(matmul_dtype(k.dtype)), v.astype(matmul_dtype(v.dtype))
  qg = q.astype(k.dtype).reshape(b, kh, n // kh, h)
  scores = jnp.einsum("bkgh,bskh->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
  valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
  scores = jnp.where(valid, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(valid, jnp.exp(scores - m_safe), 0.0)
  z = jnp.sum(e, axis=-1, keepdims=True)
  out = jnp.einsum("bkgs,bskv->bkgv", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = out / jnp.where(z > 0, z, 1.0)
  lse = jnp.where(z > 0, m_safe + jnp.log(jnp.where(z > 0, z, 1.0)), -jnp.inf)
  return (out.reshape(b, n, v.shape[-1]).astype(out_dtype or q.dtype), lse.reshape(b, n))
