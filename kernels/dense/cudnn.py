"""Dense decode attention through cuDNN's fused attention (`jax.nn.dot_product_attention`).

T = 1 query per sequence, GQA by head count, ragged lengths through
`key_value_seq_lengths` (cuDNN's padding mask). cuDNN needs V's head dim equal
to K's. The softmax statistics come back as `return_residual`; the GPU tests
check that they equal the natural-log LSE of the other implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import check_shapes


def decode_attention_cudnn(q, k, v, lengths, *, scale=None, out_dtype=None):
  """Same contract as `decode_attention_reference`; GPU only."""
  check_shapes(q, k, v, lengths)
  if v.shape[-1] != k.shape[-1]:
    raise ValueError(f"cudnn needs v head dim == k head dim, got {v.shape} vs {k.shape}")
  h = q.shape[-1]
  scale = h ** -0.5 if scale is None else scale
  out, lse = jax.nn.dot_product_attention(
      q[:, None].astype(k.dtype), k, v, scale=scale,
      key_value_seq_lengths=lengths.astype(jnp.int32), implementation="cudnn",
      return_residual=True)
  return out[:, 0].astype(out_dtype or q.dtype), lse[:, 0].astype(jnp.float32)
