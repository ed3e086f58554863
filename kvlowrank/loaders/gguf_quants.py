"""Dequantization of GGUF (ggml) tensor blocks to float32, in numpy.

Supported ggml types and their block layouts (ggml-common.h; QK = 32 values per block):
  F32, F16, BF16   plain little-endian floats
  Q8_0  [d: f16][q: 32 x int8]                    x = d * q
  Q4_0  [d: f16][qs: 16 bytes]                    x = d * (nibble - 8)
  Q4_1  [d: f16][m: f16][qs: 16 bytes]            x = d * nibble + m
For Q4_*, byte j of qs holds value j in its low nibble and value j + 16 in its high
nibble. Any other type raises a ValueError naming the tensor and the type.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from gguf import GGMLQuantizationType as Q

QK = 32
_BLOCK_BYTES = {Q.Q8_0: 2 + QK, Q.Q4_0: 2 + QK // 2, Q.Q4_1: 4 + QK // 2}
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
  """[nb, 1] float32 from the little-endian f16 at byte `start` of each block."""
  return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """[nb, 16] packed bytes -> [nb, 32] values in 0..15 (low nibbles first, then high)."""
  return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequantize_blocks(raw: np.ndarray, qtype: Q) -> np.ndarray:
  """Flat uint8 bytes of whole blocks -> flat float32 values."""
  nbytes = _BLOCK_BYTES[qtype]
  blocks = raw.reshape(-1, nbytes)
  if qtype == Q.Q8_0:
    out = _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)
  elif qtype == Q.Q4_0:
    out = _f16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)
  else:  # Q4_1
    out = _f16(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)
  return out.reshape(-1)


def dequantize(data: np.ndarray, qtype: int, shape: Sequence[int], name: str) -> np.ndarray:
  """One GGUF tensor -> float32 array of `shape` (numpy order, i.e. reversed ggml `ne`).

  Args:
    data: the tensor's data as GGUFReader exposes it (typed for F32/F16, raw uint8
      otherwise).
    qtype: ggml type id.
    shape: logical numpy shape.
    name: tensor name, for error messages.
  Returns:
    float32 array of `shape`.
  """
  try:
    qtype = Q(int(qtype))
  except ValueError:
    raise ValueError(f"GGUF tensor {name!r} has unknown ggml type id {int(qtype)}") from None
  if qtype not in SUPPORTED:
    raise ValueError(f"GGUF tensor {name!r} has unsupported type {qtype.name}; supported: "
                     f"{', '.join(t.name for t in SUPPORTED)}")
  count = int(np.prod(shape, dtype=np.int64))
  raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  if qtype == Q.F32:
    out = raw.view("<f4")
  elif qtype == Q.F16:
    out = raw.view("<f2").astype(np.float32)
  elif qtype == Q.BF16:
    # bf16 is the top half of an fp32 bit pattern.
    out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
  else:
    if count % QK or raw.size != count // QK * _BLOCK_BYTES[qtype]:
      raise ValueError(f"GGUF tensor {name!r} ({qtype.name}, shape {tuple(shape)}) has "
                       f"{raw.size} bytes, expected {count // QK * _BLOCK_BYTES[qtype]}")
    out = dequantize_blocks(raw, qtype)
  if out.size != count:
    raise ValueError(f"GGUF tensor {name!r} ({qtype.name}) has {out.size} values, expected "
                     f"{count} for shape {tuple(shape)}")
  return out.astype(np.float32, copy=False).reshape(shape)
