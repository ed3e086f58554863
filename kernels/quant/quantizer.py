"""Uniform asymmetric (min/max) group quantization with real bit-packed storage.

Formula (KIVI §3 / GEAR Eq. 2 / XQuant §2), per group of `group_size` consecutive
elements along `axis`, b = bits:

  mn, mx  = min(group), max(group)                       (computed in fp32)
  scale   = cast_sd((mx - mn) * fp32(1 / (2^b - 1)))     (sd = scale_dtype, default fp16 like KIVI)
  zero    = cast_sd(mn)                                  (a float zero point, not an integer)
  s, z    = float32(scale), float32(zero)                (codes use the *stored* values)
  code    = clip(round_half_even((x - z) / s), 0, 2^b - 1)   if s > 0, else 0
  x_hat   = code * s + z

Backends round the division differently: XLA:CPU computes (x - z) * (1 / s), XLA:GPU an
fp32 division (div.full); codes at a rounding tie may differ between them (a kernel that
writes the same codes, `kivi.triton_update`, follows the GPU's). The scale is written as a
product so that no backend divides there.

Zero-range guard: a group with mx == mn (or whose scale underflows to 0 in
scale_dtype) stores scale 0 and all-zero codes and dequantizes to `zero`; no
division by zero happens. Error bound: with scale_dtype=float32 every element
satisfies |x - x_hat| <= s/2 (up to fp32 rounding); a rounded fp16/bf16 scale and
zero add at most |mn - z| + (2^b - 1)|scale_fp32 - s| (the clip absorbs the top).

This is the one quantizer of the project: the caches (KIVI, Palu latents, XQuant rows) and
the kernels' test inputs all quantize through `quantize_codes`.

Storage (`QTensor`): codes are packed along the LAST axis of the tensor with
`packing.pack` (uint8, plane width 1; 3-bit codes as a 2-bit and a 1-bit plane), whatever
the quantization axis; scale and zero have the tensor's shape with `shape[axis]`
replaced by the number of groups. So per-channel key quantization of k [B,T,K,H]
(axis=1, groups of G tokens) stores codes [B,T,K,words(H)] and scales [B,T/G,K,H].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import packing

SCALE_DTYPES = ("float16", "bfloat16", "float32")


def canonical_scale_dtype(dtype, field: str = "scale_dtype") -> str:
  """Normalises a scale dtype (str or dtype) to its name; ValueError naming `field`."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in SCALE_DTYPES:
    raise ValueError(f"{field} must be one of {SCALE_DTYPES}, got {dtype!r}")
  return name


def resolve_group(shape, axis: int, group_size: Optional[int]) -> tuple[int, int]:
  """Validates (axis, group_size) against `shape`; returns (axis >= 0, group_size)."""
  ndim = len(shape)
  if ndim == 0:
    raise ValueError("quantize: x must have at least one dimension")
  if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
    raise ValueError(f"axis must be an int in [{-ndim}, {ndim}), got {axis!r}")
  axis = int(axis) % ndim
  n = shape[axis]
  g = n if group_size is None else group_size
  if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0:
    raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
  if n % g:
    raise ValueError(f"group_size ({g}) must divide the length of axis {axis} ({n})")
  return axis, int(g)


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantized tensor: packed codes plus one (scale, zero) per group (see module doc)."""

  codes: jax.Array   # uint8 [..., packed_bytes(shape[-1], bits)]
  scale: jax.Array   # shape with shape[axis] -> shape[axis] // group_size
  zero: jax.Array    # same shape/dtype as scale
  bits: int = _static()
  axis: int = _static()
  group_size: int = _static()
  shape: tuple = _static()

  @property
  def scale_dtype(self) -> str:
    return jnp.dtype(self.scale.dtype).name

  def nbytes(self) -> int:
    """Exact bytes of the stored arrays (packed codes + scales + zero points)."""
    return int(sum(a.size * a.dtype.itemsize for a in (self.codes, self.scale, self.zero)))


def quantized_nbytes(shape, *, bits: int, axis: int, group_size: Optional[int] = None,
                     scale_dtype="float16") -> int:
  """Bytes a `quantize(x, ...)` of this shape allocates (arithmetic, no arrays built)."""
  bits = packing.check_bits(bits)
  axis, g = resolve_group(tuple(shape), axis, group_size)
  shape = tuple(int(s) for s in shape)
  lead = int(np.prod(shape[:-1], dtype=np.int64))
  code_bytes = lead * packing.packed_bytes(shape[-1], bits)
  n_groups = int(np.prod(shape, dtype=np.int64)) // g
  sd = jnp.dtype(canonical_scale_dtype(scale_dtype)).itemsize
  return code_bytes + 2 * n_groups * sd


@functools.partial(jax.jit,
                   static_argnames=("bits", "axis", "group_size", "scale_dtype"))
def quantize_codes(x, *, bits: int, axis: int, group_size: Optional[int] = None,
                   scale_dtype="float16"):
  """Unpacked quantization (module-doc formula).

  Args:
    x: floating array.
    bits: 2, 3, 4 or 8.
    axis: axis along which groups of `group_size` consecutive elements share one
      (scale, zero); e.g. -1 = per-token for x [B,T,D], 1 = per-channel over tokens
      for keys [B,T,K,H].
    group_size: elements per group; None = the whole axis.
    scale_dtype: float16 (default, as KIVI), bfloat16 or float32.
  Returns:
    (codes uint32 with x's shape, scale, zero) with scale/zero shaped like x but
    shape[axis] // group_size along `axis`.
  """
  bits = packing.check_bits(bits)
  sd = jnp.dtype(canonical_scale_dtype(scale_dtype))
  if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
    raise ValueError(f"quantize: x must be floating point, got {jnp.asarray(x).dtype}")
  axis, g = resolve_group(x.shape, axis, group_size)
  xm = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
  xg = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // g, g))
  mn = jnp.min(xg, axis=-1)
  mx = jnp.max(xg, axis=-1)
  qmax = float(2 ** bits - 1)
  scale = ((mx - mn) * (1.0 / qmax)).astype(sd)
  zero = mn.astype(sd)
  # The codes use the stored (rounded) scale and zero. XLA:GPU may drop a f32 -> f16 -> f32
  # round trip inside a fusion (excess precision allowed), which would quantize with the
  # unrounded scale; the barrier keeps the rounding on every backend.
  scale, zero = jax.lax.optimization_barrier((scale, zero))
  s = scale.astype(jnp.float32)[..., None]
  z = zero.astype(jnp.float32)[..., None]
  pos = s > 0
  q = jnp.round((xg - z) / jnp.where(pos, s, 1.0))
  codes = jnp.where(pos, jnp.clip(q, 0.0, qmax), 0.0).astype(jnp.uint32)
  codes = jnp.moveaxis(codes.reshape(xm.shape), -1, axis)
  return codes, jnp.moveaxis(scale, -1, axis), jnp.moveaxis(zero, -1, axis)


def quantize(x, *, bits: int, axis: int, group_size: Optional[int] = None,
             scale_dtype="float16") -> QTensor:
  """Quantizes and bit-packs x (arguments as in `quantize_codes`). Returns a QTensor."""
  codes, scale, zero = quantize_codes(x, bits=bits, axis=axis, group_size=group_size,
                                      scale_dtype=scale_dtype)
  axis, g = resolve_group(x.shape, axis, group_size)
  return QTensor(codes=packing.pack(codes, bits), scale=scale, zero=zero, bits=int(bits),
                 axis=axis, group_size=g, shape=tuple(int(s) for s in x.shape))


@functools.partial(jax.jit, static_argnames=("axis", "group_size", "dtype"))
def dequantize_codes(codes, scale, zero, *, axis: int, group_size: int, dtype=jnp.float32):
  """x_hat = code * scale + zero with scale/zero repeated over each group (fp32 math)."""
  s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=axis)
  z = jnp.repeat(zero.astype(jnp.float32), group_size, axis=axis)
  return (codes.astype(jnp.float32) * s + z).astype(dtype)


def dequantize(qt: QTensor, dtype=jnp.float32):
  """Unpacks and dequantizes a QTensor to `dtype` (default float32)."""
  codes = packing.unpack(qt.codes, qt.bits, qt.shape[-1])
  return dequantize_codes(codes, qt.scale, qt.zero, axis=qt.axis, group_size=qt.group_size,
                          dtype=dtype)


def fake_quant(x, *, bits: int, axis: int, group_size: Optional[int] = None,
               scale_dtype="float16", dtype=None):
  """Quantize-dequantize without packing (simulation); equals dequantize(quantize(x)).

  Returns x_hat in `dtype` (default: x's dtype).
  """
  codes, scale, zero = quantize_codes(x, bits=bits, axis=axis, group_size=group_size,
                                      scale_dtype=scale_dtype)
  axis, g = resolve_group(x.shape, axis, group_size)
  return dequantize_codes(codes, scale, zero, axis=axis, group_size=g,
                          dtype=dtype or x.dtype)
