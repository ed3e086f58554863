"""Reading `.safetensors` checkpoints (single file or sharded) into numpy arrays.

A minimal reader of the safetensors format (8-byte little-endian header length,
JSON header, raw little-endian tensor bytes) instead of `safetensors.numpy`,
because numpy has no bfloat16 (we use `ml_dtypes`, a JAX dependency) and because
every malformed or truncated file must fail with an error naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
  """Lazily readable tensors of one `.safetensors` file (memory-mapped)."""

  def __init__(self, path: Path):
    self.path = Path(path)
    size = self.path.stat().st_size
    with open(self.path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise ValueError(f"{self.path}: not a safetensors file (shorter than its 8-byte header)")
      (n,) = struct.unpack("<Q", head)
      if n > size - 8:
        raise ValueError(f"{self.path}: corrupt or truncated safetensors file (header claims "
                         f"{n} bytes, file has {size})")
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    self._data_start = 8 + n
    self._entries = header
    for name, e in header.items():
      end = e["data_offsets"][1]
      if self._data_start + end > size:
        raise ValueError(f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte "
                         f"{self._data_start + end}, file has {size}")
      if e["dtype"] not in _DTYPES:
        raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']!r}")
    self._mmap = None

  def keys(self):
    return self._entries.keys()

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a numpy array in its stored dtype."""
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    e = self._entries[name]
    start, end = e["data_offsets"]
    dtype = _DTYPES[e["dtype"]]
    raw = self._mmap[self._data_start + start:self._data_start + end]
    count = int(np.prod(e["shape"], dtype=np.int64))
    if raw.size != count * dtype.itemsize:
      raise ValueError(f"{self.path}: tensor {name!r} has {raw.size} bytes, expected "
                       f"{count * dtype.itemsize} for shape {e['shape']} {e['dtype']}")
    return raw.view(dtype).reshape(e["shape"])


class SafetensorsCheckpoint:
  """All tensors of a HF checkpoint directory: `model.safetensors` or sharded shards."""

  def __init__(self, directory: Path):
    self.directory = Path(directory)
    index = self.directory / INDEX_FILE
    self._where: dict[str, SafetensorsFile] = {}
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index}: corrupt index (needs a 'weight_map'): {e}") from e
      files: dict[str, SafetensorsFile] = {}
      for name, shard in weight_map.items():
        if shard not in files:
          p = self.directory / shard
          if not p.exists():
            raise FileNotFoundError(f"{index}: shard {shard!r} (holding {name!r}) not found at {p}")
          files[shard] = SafetensorsFile(p)
        self._where[name] = files[shard]
      for name, f in self._where.items():
        if name not in f.keys():
          raise ValueError(f"{f.path}: tensor {name!r} listed in {INDEX_FILE} is not in the shard")
    else:
      paths = sorted(self.directory.glob("*.safetensors"))
      if not paths:
        raise FileNotFoundError(f"{self.directory}: no *.safetensors weights (and no {INDEX_FILE})")
      for p in paths:
        f = SafetensorsFile(p)
        for name in f.keys():
          self._where[name] = f

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def get(self, name: str) -> np.ndarray:
    """Tensor `name`; ValueError naming the tensor and directory if absent."""
    if name not in self._where:
      raise ValueError(f"{self.directory}: missing tensor {name!r} in the safetensors checkpoint")
    return self._where[name].get(name)
