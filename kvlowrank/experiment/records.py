"""Results files: one JSON object per line, appended atomically; whole JSON documents
rewritten atomically (`write_json`, the benchmarks' results).

`append` rewrites the file through a temporary file in the same folder and `os.replace`,
so a reader (or a sweep restarted after a kill at any instant) sees either the file
before or after the append, never a torn line: a finished point is never lost and an
unfinished one never looks finished. The file keeps its mode, or gets the usual one for
a new file (0666 less the umask; the temporary file alone would be 0600).

A record with `"status": "failed"` is a point that could not run (its `error` says why):
reports list it, and a rerun tries it again (`done_keys` skips only finished points).
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


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def append(path, record: dict, *, replace: bool = False) -> None:
  """Appends one record atomically (write temp file + fsync + os.replace).

  Args:
    path: the JSONL file (created with mode 0666 & ~umask; an existing file keeps its
      mode).
    record: a JSON-serialisable dict.
    replace: first drop the records whose `key` equals record["key"] (a rerun that
      overwrites a point, or a failed point that now ran).
  """
  path = Path(path)
  line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
  old = path.read_bytes() if path.exists() else b""
  if replace and old:
    keep = [ln for ln in old.decode("utf-8").splitlines(keepends=True)
            if not ln.strip() or json.loads(ln).get("key") != record.get("key")]
    old = "".join(keep).encode("utf-8")
  if old and not old.endswith(b"\n"):
    old += b"\n"
  _write_atomic(path, old + line.encode("utf-8"))


def write_json(path, obj: dict) -> None:
  """Writes one JSON document atomically (temp file + fsync + os.replace): a benchmark
  that rewrites its results after every measurement leaves a whole, readable file at any
  instant, so a run cut short (a time limit, a kill) keeps what it measured."""
  _write_atomic(Path(path),
                (json.dumps(obj, indent=1, allow_nan=True) + "\n").encode("utf-8"))


def _write_atomic(path: Path, data: bytes) -> None:
  """Replaces path's contents by data (creating its folder; the file keeps its mode, or
  gets 0666 & ~umask when new)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def failed(record: dict) -> bool:
  """True for the record of a point that could not run."""
  return record.get("status") == "failed"


def done_keys(path) -> set[str]:
  """The `key` fields of the finished (not failed) records in `path`."""
  return {r["key"] for r in read(path) if "key" in r and not failed(r)}


def find(path, key: str):
  """The latest finished record of `key` in `path`, or None."""
  found = None
  for r in read(path):
    if r.get("key") == key and not failed(r):
      found = r
  return found
