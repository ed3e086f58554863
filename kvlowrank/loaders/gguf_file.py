"""A fast GGUF (v2/v3, little-endian) container reader: metadata and raw tensor bytes.

`gguf.GGUFReader` builds a numpy view per metadata element, which takes seconds on a
GGUF with a 49k-token vocabulary (~100k strings); this reader parses the same layout
with `struct` on a memory map (tens of milliseconds) and checks every offset against
the file size, so truncated files fail with an error naming the file. Type ids and
block sizes come from the `gguf` package. Layout (gguf-py / ggml docs/gguf.md):
  magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
  kv_count x (string key, u32 value_type, value),
  tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset),
  padding to `general.alignment` (default 32), then tensor data at data_start + offset.
Strings are u64 length + UTF-8 bytes; arrays are u32 item_type, u64 count, items.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  ggml_type: int
  shape: tuple[int, ...]  # numpy order: reversed ggml `ne` (rows last-dim-contiguous)
  data: np.ndarray        # raw uint8 bytes of the tensor


class _Cursor:
  def __init__(self, buf, path: Path):
    self.buf, self.pos, self.path = buf, 0, path

  def take(self, fmt: str):
    size = struct.calcsize(fmt)
    if self.pos + size > len(self.buf):
      raise ValueError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)})")
    out = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += size
    return out[0] if len(out) == 1 else out

  def string(self) -> str:
    n = self.take("<Q")
    if self.pos + n > len(self.buf):
      raise ValueError(f"{self.path}: truncated GGUF file (string of {n} bytes at {self.pos})")
    s = self.buf[self.pos:self.pos + n]
    self.pos += n
    try:
      return s.decode("utf-8")
    except UnicodeDecodeError:  # some vocabularies hold invalid UTF-8 byte pieces
      return s.decode("utf-8", errors="surrogateescape")

  def value(self, vtype: int, key: str) -> Any:
    if vtype == _STRING:
      return self.string()
    if vtype in _SCALARS:
      return self.take(_SCALARS[vtype])
    if vtype != _ARRAY:
      raise ValueError(f"{self.path}: GGUF field {key!r} has unknown value type {vtype}")
    itype, count = self.take("<I"), self.take("<Q")
    if itype == _STRING:
      return [self.string() for _ in range(count)]
    if itype in _SCALARS:
      dtype = np.dtype(_SCALARS[itype])
      nbytes = count * dtype.itemsize
      if self.pos + nbytes > len(self.buf):
        raise ValueError(f"{self.path}: truncated GGUF file (array {key!r})")
      arr = np.frombuffer(self.buf, dtype, count=count, offset=self.pos)
      self.pos += nbytes
      return arr.tolist()
    return [self.value(itype, key) for _ in range(count)]  # nested arrays


class GGUFFile:
  """Parsed GGUF: `metadata` (key -> python value) and `tensors` (name -> TensorInfo)."""

  def __init__(self, path: Path):
    self.path = path = Path(path)
    with open(path, "rb") as f:
      magic = f.read(4)
      if magic != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
      self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(self._mm, path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
      raise ValueError(f"{path}: unsupported GGUF version {version} (need 2 or 3, little-endian)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key = cur.string()
      self.metadata[key] = cur.value(cur.take("<I"), key)
    infos = []
    for _ in range(n_tensors):
      name = cur.string()
      ne = [cur.take("<Q") for _ in range(cur.take("<I"))]
      infos.append((name, ne, cur.take("<I"), cur.take("<Q")))
    align = int(self.metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    size = len(self._mm)
    self.tensors: dict[str, TensorInfo] = {}
    for name, ne, qtype, offset in infos:
      count = int(np.prod(ne, dtype=np.int64))
      try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
      except (ValueError, KeyError):
        raise ValueError(f"{path}: GGUF tensor {name!r} has unknown ggml type id {qtype}") from None
      nbytes = count // block * block_bytes
      start = data_start + offset
      if start + nbytes > size:
        raise ValueError(f"{path}: truncated GGUF file: tensor {name!r} needs bytes "
                         f"[{start}, {start + nbytes}), file has {size}")
      data = np.frombuffer(self._mm, np.uint8, count=nbytes, offset=start)
      self.tensors[name] = TensorInfo(name, qtype, tuple(int(x) for x in reversed(ne)), data)
