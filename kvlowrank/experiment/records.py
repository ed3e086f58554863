"""Results files: one JSON object per line, appended atomically.

`append` rewrites the file through a temporary file in the same folder and `os.replace`,
so a reader (or a sweep restarted after a kill at any instant) sees either the file
before or after the append, never a torn line: a finished point is never lost and an
unfinished one never looks finished.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RESULTS = "results.jsonl"


def read(path) -> list[dict]:
  """All records of a JSONL file ([] if it does not exist).

  Raises:
    ValueError naming the file and line of a malformed record.
  """
  path = Path(path)
  if not path.exists():
    return []
  out = []
  for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{i}: malformed JSON record ({e})") from e
    if not isinstance(rec, dict):
      raise ValueError(f"{path}:{i}: record is not a JSON object")
    out.append(rec)
  return out


def append(path, record: dict) -> None:
  """Appends one record atomically (write temp file + fsync + os.replace)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
  old = path.read_bytes() if path.exists() else b""
  if old and not old.endswith(b"\n"):
    old += b"\n"
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(old + line.encode("utf-8"))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def done_keys(path) -> set[str]:
  """The `key` fields of the records in `path`."""
  return {r["key"] for r in read(path) if "key" in r}
