"""Quantized Palu latents: packed codes + one scale/zero per (token, group).

Following Palu's latency setup (per-token asymmetric quantization, one scale/zero pair for a
head group's whole latent slice of one token), a latent h [B, S, Gr, R] is quantized by the
project's one quantizer (`quant.quantizer.quantize_codes` over the last axis, one group) and
stored as
  codes uint8 [B, S, Gr, packing.packed_bytes(R, bits)]  (`quant.packing`, plane width 1:
                                                          3-bit = a 2-bit then a 1-bit plane),
  scale, zero [B, S, Gr]                                  (h ~= code * scale + zero).
The zero is the float minimum (KIVI style), not Palu's rounded integer zero point; a
constant slice stores scale 0 and code 0 (the quantizer's rule).

Any R is stored: rows are zero-padded to a whole number of `packing.row_block(bits)` codes.
The Triton kernel reads rows without padding only (`triton_palu_launch.plan` refuses the
others), where the layout is the kernel's: code c in byte c // ppb at bits b (c % ppb), and
for 3 bits the 2-bit plane (R / 4 bytes) then the 1-bit plane (R / 8 bytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import packing
from ..quant.quantizer import dequantize_codes, quantize_codes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLatent:
  """A quantized latent tensor [B, S, Gr, dim] (see module docstring)."""

  codes: jax.Array   # uint8 [B, S, Gr, packing.packed_bytes(dim, bits)]
  scale: jax.Array   # [B, S, Gr]
  zero: jax.Array    # [B, S, Gr]
  bits: int = dataclasses.field(metadata=dict(static=True))
  dim: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    return (*self.codes.shape[:-1], self.dim)

  def nbytes(self) -> int:
    """Bytes of the stored arrays (packed codes with their padding, scales, zero points)."""
    return int(sum(a.size * a.dtype.itemsize for a in (self.codes, self.scale, self.zero)))

  def __post_init__(self):
    if not hasattr(self.codes, "shape"):  # pytree unflattening with placeholders
      return
    packing.check_bits(self.bits, "PackedLatent.bits")
    if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim < 1:
      raise ValueError(f"PackedLatent.dim must be a positive int, got {self.dim!r}")
    want = packing.packed_bytes(self.dim, self.bits)
    if self.codes.shape[-1] != want:
      raise ValueError(f"PackedLatent.codes last dim {self.codes.shape[-1]} != {want} "
                       f"(dim={self.dim}, bits={self.bits})")
    if self.scale.shape != self.codes.shape[:-1] or self.zero.shape != self.codes.shape[:-1]:
      raise ValueError(f"PackedLatent.scale/zero must be {self.codes.shape[:-1]}, got "
                       f"{self.scale.shape} and {self.zero.shape}")


def quantize_latent(x, bits: int, scale_dtype=None) -> PackedLatent:
  """Per-(token, group) asymmetric quantization of a latent x [B, S, Gr, R].

  Args:
    x: float latent [B, S, Gr, R], any R.
    bits: 2, 3, 4 or 8 (the Triton kernel reads 2, 3 and 4).
    scale_dtype: dtype of scale and zero; default x's dtype if bf16/fp16, else float32.
  """
  if x.ndim != 4:
    raise ValueError(f"latent must be [B, S, Gr, R], got shape {x.shape}")
  if scale_dtype is None:
    scale_dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
  codes, scale, zero = quantize_codes(x, bits=bits, axis=-1, group_size=None,
                                      scale_dtype=scale_dtype)
  return PackedLatent(codes=packing.pack(codes, bits), scale=scale[..., 0],
                      zero=zero[..., 0], bits=int(bits), dim=int(x.shape[-1]))


def dequantize_latent(p: PackedLatent):
  """float32 [B, S, Gr, dim]."""
  codes = packing.unpack(p.codes, p.bits, p.dim)
  return dequantize_codes(codes, p.scale[..., None], p.zero[..., None], axis=-1,
                          group_size=p.dim)


def latent_f32(x):
  """A latent (array or PackedLatent) as float32 [B, S, Gr, dim]."""
  if isinstance(x, PackedLatent):
    return dequantize_latent(x)
  return x.astype(jnp.float32)
