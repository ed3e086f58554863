"""Launch plan of the Triton KIVI kernel (`triton_kivi`): its checks and geometry.

Apart from the kernel so that it imports without Triton: the dispatcher's `triton_fit` asks
it whether the kernel takes a cache on any machine.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ..common import splitk
from .planar import VALUE_BLOCK, KiviKeys, KiviValues

KERNEL_BITS = (2, 4)  # the code widths the kernel's dequantization reads


def _pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def plan(q_shape, keys: KiviKeys, values: KiviValues, w_cap: int, *, block_s=None, block_w=32,
         num_splits=None, target_programs=None, fast=None, min_rows=1):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check.

  Args:
    q_shape: (B, N, H).
    keys, values: the quantized prefix (2- or 4-bit).
    w_cap: window capacity W.
    block_s: tokens per loop step (power of 2 >= 16); default 32. Processed as sub-tiles of
      at most VALUE_BLOCK tokens, each inside one key group when the key group is a power
      of 2 >= 16 (other key groups gather each token's key scales: correct, slow).
    block_w: tokens per window tile (power of 2 >= 16).
    num_splits, target_programs: split-K override / program target (`splitk`).
    fast: inline-PTX dequantization (default: on unless TRITON_INTERPRET=1).
    min_rows: least MMA N (query rows per program, padded to a power of 2).
  Returns:
    dict(grid, constexprs, num_splits, out_shapes).
  """
  del w_cap
  b, n, h = q_shape
  _, kh, s, _ = keys.codes.shape
  for name, bits in (("keys.bits", keys.bits), ("values.bits", values.bits)):
    if bits not in KERNEL_BITS:
      raise ValueError(f"triton kivi attention: {name} must be 2 or 4, got {bits}")
  if not _pow2(h) or h < 16:
    raise ValueError(f"triton kivi attention: head dim must be a power of 2 >= 16, got {h}")
  kcw, vcw = keys.plane_width, values.plane_width
  if kcw < 16:
    raise ValueError(f"triton kivi attention: keys.plane_width is {kcw} (head dim {h} at "
                     f"{keys.bits} bits); needs head dim >= {16 * 8 // keys.bits}")
  if vcw < 16:
    raise ValueError(f"triton kivi attention: values.plane_width is {vcw} (head dim {h}, "
                     f"values.group {values.group}, {values.bits} bits); needs the value "
                     f"group to be a multiple of 16 and head dim >= {16 * 8 // values.bits}")
  for name, x in (("keys", keys), ("values", values)):
    if x.codes.shape[-1] != h * x.bits // 8:
      raise ValueError(f"triton kivi attention: {name}.codes rows must be {h * x.bits // 8} "
                       f"bytes (head dim {h} at {x.bits} bits), got {x.codes.shape[-1]}")
  block_s = 32 if block_s is None else block_s
  for name, val in (("block_s", block_s), ("block_w", block_w), ("min_rows", min_rows)):
    if not _pow2(val) or (val < 16 and name != "min_rows"):
      raise ValueError(f"triton kivi attention: {name} must be a power of 2"
                       f"{'' if name == 'min_rows' else ' >= 16'}, got {val}")
  if s % VALUE_BLOCK:
    raise ValueError(f"triton kivi attention: values.codes capacity ({s}) must be a multiple "
                     f"of planar.VALUE_BLOCK ({VALUE_BLOCK})")
  if s * h >= 2 ** 31:
    raise ValueError("triton kivi attention: one head's cache exceeds int32 indexing")
  if fast is None:
    fast = os.environ.get("TRITON_INTERPRET") != "1"
  qpk = n // kh
  ns = splitk.choose_num_splits(b * kh, s, block_s, requested=num_splits,
                                target=target_programs or splitk.TARGET_PROGRAMS)
  kf16 = int(keys.scale.dtype == jnp.float16)
  vf16 = int(values.scale.dtype == jnp.float16)
  return dict(
      grid=(b * kh, ns + 1),
      constexprs=dict(KH=kh, QPK=qpk, QP=max(min_rows, 1 << (qpk - 1).bit_length()), H=h,
                      KBITS=keys.bits, VBITS=values.bits, KCW=kcw, VCW=vcw, G=keys.group,
                      GV=values.group, VB=VALUE_BLOCK, BLOCK_S=block_s, BLOCK_W=block_w,
                      KF16=kf16, VF16=vf16, FAST=bool(fast)),
      num_splits=ns,
      out_shapes=[jax.ShapeDtypeStruct((b, n, ns + 1, h), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, ns + 1), jnp.float32)])
