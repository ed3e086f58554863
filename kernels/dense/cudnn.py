"""Dense decode attention through cuDNN's fused attention (`jax.nn.dot_product_attention`).

T = 1 query per sequence, GQA by head count, ragged lengths through
`key_value_seq_lengths` (cuDNN's padding mask). cuDNN needs V's head dim equal
to K's, fp16/bf16 K and V of one dtype, a head dim that is a multiple of 8
(`limits.check_cudnn_inputs`). The softmax statistics come back as `return_residual`;
the GPU tests check that they equal the natural-log LSE of the other implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .limits import CUDNN_MAX_HEAD_DIM_HOPPER, check_cudnn_inputs
from .reference import check_shapes


def decode_attention_cudnn(q, k, v, lengths, *, scale=None, out_dtype=None):
  """Same contract as `decode_attention_reference`; GPU only."""
  check_shapes(q, k, v, lengths)
  # The device-dependent head-dim bound (128, or 256 on Hopper) is left to cuDNN.
  check_cudnn_inputs(k, v, max_head_dim=CUDNN_MAX_HEAD_DIM_HOPPER)
  h = q.shape[-1]
  scale = h ** -0.5 if scale is None else scale
  out, lse = jax.nn.dot_product_attention(
      q[:, None].astype(k.dtype), k, v, scale=scale,
      key_value_seq_lengths=lengths.astype(jnp.int32), implementation="cudnn",
      return_residual=True)
  return out[:, 0].astype(out_dtype or q.dtype), lse[:, 0].astype(jnp.float32)
