"""Launch plan of the Triton Palu kernel (`triton_palu_launch`), importable without Triton:
the shape rules `triton_fit` checks and the geometry the launch and the CPU interpreter
check share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import splitk
from ..quant import packing
from .packed import PackedLatent

DEFAULT_BLOCK_S = 128  # tokens per tile of `palu_attention_triton` (its default)


def _split_rank(r: int):
  """r = A + B with A the largest power of two <= r; B padded to a power of two (0 if none)."""
  a = 1 << (r.bit_length() - 1)
  rb = r - a
  rbp = 0 if rb == 0 else max(16, 1 << (rb - 1).bit_length())
  return a, rb, max(rbp, 16)


def plan(q_shape, hk_shape, hv_shape, bk_shape, *, kbits=16, vbits=16, has_bias=False,
         block_s=32, num_splits=None, absorb=None, target_programs=None, trans=False,
         heads_per_program=None):
  """Launch geometry shared by the JAX wrapper and the CPU interpreter check.

  Raises a one-line ValueError for inputs the kernel does not take (`triton_fit` in
  `__init__` reports it).
  kbits, vbits: 16 (bf16/fp16 latents) or the bits of a `PackedLatent` (2, 3 or 4, rows
    without padding: the rank a multiple of `packing.row_block(bits)`).
  heads_per_program: KV heads of a group per program (divides g; default g). Fewer heads
    per program need fewer reconstruction operands in shared memory (more programs per
    SM) but read the group's latent tile once per program (L2 hits for the repeats).
  """
  b, n, h = q_shape
  s, gr, rk = hk_shape[1], hk_shape[2], hk_shape[3]
  rv = hv_shape[3]
  g = bk_shape[2] // h
  qpk = n // (gr * g)
  for name, val, bits in (("rk", rk, kbits), ("rv", rv, vbits)):
    if val % 16 or val < 16:
      raise ValueError(f"triton latent attention: {name} must be a multiple of 16, got {val}")
    if bits not in (2, 3, 4, 16):
      raise ValueError(f"triton latent attention: {name} latents must be 16-bit or packed "
                       f"with 2, 3 or 4 bits, got {bits}")
    if bits != 16 and val % packing.row_block(bits):
      raise ValueError(f"triton latent attention: packed {name} ({val}) must be a multiple of "
                       f"{packing.row_block(bits)} at {bits} bits (rows without padding)")
  if h < 32 or h & (h - 1):
    raise ValueError(f"triton latent attention: head dim must be a power of 2 >= 32, got {h}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"triton latent attention: block_s must be a power of 2 >= 16, got {block_s}")
  # The GPU tests caught wrong results for tiny packed tiles (block_s = 16 with 2-bit
  # keys; 3-bit latents with a 16-wide rank piece) where the CPU interpreter agrees
  # with the reference; not root-caused, so those shapes are refused.
  if block_s < 32 and (kbits != 16 or vbits != 16):
    raise ValueError("triton latent attention: packed latents need block_s >= 32")
  if s * gr * max(rk, rv) >= 2 ** 31:
    raise ValueError("triton latent attention: one sequence's latent cache exceeds int32 indexing")
  rka, rkb, rkbp = _split_rank(rk)
  rva, rvb, rvbp = _split_rank(rv)
  for name, bits, pieces in (("rk", kbits, (rka, rkb)), ("rv", vbits, (rva, rvb))):
    if bits != 16 and min(p for p in pieces if p) < 32:
      raise ValueError(f"triton latent attention: packed {name} must split into power-of-two "
                       f"pieces >= 32 (got {pieces})")
  if absorb is None:
    absorb = qpk == 1
  if absorb and qpk != 1:
    raise ValueError("triton latent attention: absorb=True needs one query head per KV head")
  hpp = g if heads_per_program is None else int(heads_per_program)
  if hpp < 1 or g % hpp:
    raise ValueError(f"triton latent attention: heads_per_program ({heads_per_program}) must "
                     f"divide the group's KV heads ({g})")
  ns = splitk.choose_num_splits(b * gr * (g // hpp), s, block_s, requested=num_splits,
                                  target=target_programs or splitk.TARGET_PROGRAMS)
  return dict(
      grid=(b * gr * (g // hpp), ns),
      constexprs=dict(GR=gr, G=g, QPK=qpk, NQP=max(16, 1 << (hpp * qpk - 1).bit_length()), H=h,
                      RK=rk, RKA=rka, RKB=rkb, RKBP=rkbp, RV=rv, RVA=rva, RVB=rvb, RVBP=rvbp,
                      KBITS=kbits, VBITS=vbits, HAS_BIAS=bool(has_bias),
                      BLOCK_S=block_s, ABSORB=bool(absorb), TRANS=bool(trans),
                      HPP=hpp), num_splits=ns,
      out_shapes=[jax.ShapeDtypeStruct((b, n, ns, rv), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, ns), jnp.float32)])


def latent_bits(x) -> int:
  """16 for a float latent array, else the PackedLatent's bits (what `plan` takes)."""
  return x.bits if isinstance(x, PackedLatent) else 16
