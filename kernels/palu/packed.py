"""Quantized Palu latents in the kernel's layout: packed codes + per-(token, group) scale/zero.

Following Palu's latency setup (per-token asymmetric quantization, one
scale/zero pair for a head group's whole latent slice of one token), a latent
h [B, S, Gr, R] is stored as
  codes uint8 [B, S, Gr, R * bits / 8]  (`bitpack` layout; 3-bit = two planes),
  scale, zero [B, S, Gr]                 (float; h ~= code * scale + zero).
The zero is the float minimum (KIVI style), not Palu's rounded integer zero point.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import bitpack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLatent:
  """A quantized latent tensor [B, S, Gr, dim] (see module docstring)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  bits: int = dataclasses.field(metadata=dict(static=True))
  dim: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self):
    return (*self.codes.shape[:-1], self.dim)

  def __post_init__(self):
    if not hasattr(self.codes, "shape"):  # pytree unflattening with placeholders
      return
    want = bitpack.packed_bytes(self.dim, self.bits)
    if self.codes.shape[-1] != want:
      raise ValueError(f"PackedLatent.codes last dim {self.codes.shape[-1]} != {want} "
                       f"(dim={self.dim}, bits={self.bits})")
    if self.scale.shape != self.codes.shape[:-1] or self.zero.shape != self.codes.shape[:-1]:
      raise ValueError(f"PackedLatent.scale/zero must be {self.codes.shape[:-1]}, got "
                       f"{self.scale.shape} and {self.zero.shape}")


def quantize_latent(x, bits: int, scale_dtype=None) -> PackedLatent:
  """Per-(token, group) asymmetric quantization of a latent x [B, S, Gr, R]."""
  if x.ndim != 4:
    raise ValueError(f"latent must be [B, S, Gr, R], got shape {x.shape}")
  if scale_dtype is None:
    scale_dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
  codes, scale, zero = bitpack.minmax_quantize(x, bits, axis=-1, scale_dtype=scale_dtype)
  return PackedLatent(codes=bitpack.pack_codes(codes, bits), scale=scale[..., 0],
                      zero=zero[..., 0], bits=bits, dim=x.shape[-1])


def dequantize_latent(p: PackedLatent):
  """float32 [B, S, Gr, dim]."""
  codes = bitpack.unpack_codes(p.codes, p.bits, p.dim).astype(jnp.float32)
  return codes * p.scale.astype(jnp.float32)[..., None] + p.zero.astype(jnp.float32)[..., None]


def latent_f32(x):
  """A latent (array or PackedLatent) as float32 [B, S, Gr, dim]."""
  if isinstance(x, PackedLatent):
    return dequantize_latent(x)
  return x.astype(jnp.float32)
