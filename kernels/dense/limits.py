"""What inputs each dense GPU decode kernel takes: the one copy of their shape and dtype rules.

Triton-free (shapes and dtypes only, no device), so that the dispatcher's `kernel_fit` can
ask without importing Triton; the kernels' own wrappers (`triton_decode.plan`,
`cudnn.decode_attention_cudnn`) raise the same errors from the same functions.

  triton  K and V head dims powers of two >= 16 (`tl.arange` tiles, MMA K >= 16); one
          sequence's K or V cache below 2^31 elements (the kernel indexes a sequence in int32).
  cudnn   V head dim == K head dim and K/V of one dtype (`jax.nn.dot_product_attention`);
          fp16 or bf16 K/V, head dim a multiple of 8 and at most 128 (cuDNN's flash-attention
          bound on every GPU; Hopper also takes up to 256, which the pure `kernel_fit` does
          not assume and the wrapper leaves to cuDNN).
"""

from __future__ import annotations

import jax.numpy as jnp

# K/V dtypes the GPU kernels compute in: the MMAs take them as operands with fp32
# accumulation. fp32 K/V would enter Triton's `tl.dot` as TF32 (a 10-bit mantissa), which
# the fp32 reference does not do, so a dispatcher sends them elsewhere.
KERNEL_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128        # on every GPU generation
CUDNN_MAX_HEAD_DIM_HOPPER = 256


def _pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def check_triton_shapes(q_shape, k_shape, v_shape, block_s: int = 64):
  """ValueError naming the field unless the split-K Triton kernel takes these shapes.

  Args:
    q_shape: (B, N, H); k_shape: (B, S, K, H); v_shape: (B, S, K, Hv).
    block_s: the kernel's token tile.
  """
  h = q_shape[-1]
  s, kh = k_shape[1], k_shape[2]
  hv = v_shape[-1]
  for name, val in (("head dim", h), ("value head dim", hv), ("block_s", block_s)):
    if not _pow2(val) or val < 16:
      raise ValueError(f"triton decode attention: {name} must be a power of 2 >= 16, got {val}")
  if s * kh * max(h, hv) >= 2 ** 31:
    raise ValueError(f"triton decode attention: one sequence's cache ({s}x{kh}x{max(h, hv)}) "
                     "exceeds int32 indexing")


def check_cudnn_inputs(k, v, max_head_dim: int = CUDNN_MAX_HEAD_DIM):
  """ValueError naming the field unless cuDNN's fused attention takes these K/V (with a
  head-dim bound of `max_head_dim`)."""
  if v.shape[-1] != k.shape[-1]:
    raise ValueError(f"cudnn needs v head dim == k head dim, got {v.shape} vs {k.shape}")
  if jnp.dtype(v.dtype) != jnp.dtype(k.dtype):
    raise ValueError(f"cudnn needs v dtype == k dtype, got {jnp.dtype(v.dtype).name} vs "
                     f"{jnp.dtype(k.dtype).name}")
  check_kernel_dtype("k", k)
  h = k.shape[-1]
  if h % 8 or h > max_head_dim:
    raise ValueError(f"cudnn needs a head dim that is a multiple of 8 and <= {max_head_dim}, "
                     f"got {h}")


def check_kernel_dtype(name: str, x):
  """ValueError unless `x` (K or V) is one of KERNEL_DTYPES."""
  dt = jnp.dtype(x.dtype).name
  if dt not in KERNEL_DTYPES:
    raise ValueError(f"{name} is {dt}; the GPU decode kernels take {' or '.join(KERNEL_DTYPES)}")
