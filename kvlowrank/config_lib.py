"""Typed boundary between ConfigDicts (configs/, command lines) and frozen dataclass specs.

Two helpers, used by every launcher:

* `parse_arg("k=v,k2=v2", **defaults)` parses the string after `:` in
  `--config=configs/x.py:k=v,...` (big_vision's `parse_arg`): values are typed by the
  defaults, a bare name means True, bools are parsed strictly, unknown names are errors.
* `to_dataclass(section, Cls)` converts a ConfigDict section (or any mapping) into a
  frozen dataclass, rejecting unknown keys and mistyped values, so that the ConfigDict
  never reaches jitted code and typos fail loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Optional

import ml_collections

_TRUE = ("true", "True", "1", "yes")
_FALSE = ("false", "False", "0", "no")


def _parse_value(name: str, text: str, default: Any) -> Any:
  """Parses `text` to the type of `default`; ValueError naming `name` on failure."""
  if isinstance(default, bool):
    if text in _TRUE:
      return True
    if text in _FALSE:
      return False
    raise ValueError(f"config arg {name!r}: expected a bool (true/false), got {text!r}")
  if isinstance(default, int):
    try:
      return int(text)
    except ValueError:
      raise ValueError(f"config arg {name!r}: expected an int, got {text!r}") from None
  if isinstance(default, float):
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"config arg {name!r}: expected a float, got {text!r}") from None
  return text  # str, or None default: keep the string


def parse_arg(arg: Optional[str], **defaults) -> ml_collections.ConfigDict:
  """Parses "k=v,k2=v2" (big_vision style) into a ConfigDict typed by `defaults`.

  Args:
    arg: the string after `:` in `--config=path.py:arg`, or None / "" for defaults.
    **defaults: every accepted name with its default; the default's type (bool, int,
      float, str) decides how the value is parsed. A bare `name` sets a bool to True.
  Returns:
    ConfigDict holding every default, overridden by the values given in `arg`.
  Raises:
    ValueError: naming an unknown key, a repeated key, a bare non-bool name, or a
      value that does not parse to the default's type.
  """
  out = dict(defaults)
  seen = set()
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    name, has_value, text = item.partition("=")
    name = name.strip()
    if name not in defaults:
      raise ValueError(f"unknown config arg {name!r}; known: {', '.join(sorted(defaults))}")
    if name in seen:
      raise ValueError(f"config arg {name!r} given twice in {arg!r}")
    seen.add(name)
    if not has_value:
      if not isinstance(defaults[name], bool):
        raise ValueError(f"config arg {name!r} needs a value ({name}=...); only bools may "
                         "be given bare")
      out[name] = True
    else:
      out[name] = _parse_value(name, text.strip(), defaults[name])
  return ml_collections.ConfigDict(out)


def _check_type(where: str, value: Any, hint: Any) -> Any:
  """Checks/coerces `value` against a simple type hint; returns the value to store."""
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(hint)
    if value is None and type(None) in args:
      return None
    errors = []
    for a in args:
      if a is type(None):
        continue
      try:
        return _check_type(where, value, a)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(errors[0] if errors else f"{where}: got {value!r}")
  if hint is bool:
    if not isinstance(value, bool):
      raise ValueError(f"{where}: expected a bool, got {value!r}")
    return value
  if hint is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{where}: expected an int, got {value!r}")
    return value
  if hint is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{where}: expected a float, got {value!r}")
    return float(value)
  if hint is str:
    if not isinstance(value, str):
      raise ValueError(f"{where}: expected a str, got {value!r}")
    return value
  if origin is tuple and isinstance(value, (list, tuple)):
    return tuple(value)  # JSON round trips turn tuples into lists
  if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
    return to_dataclass(value, hint, where=where)
  return value


def to_dataclass(section, cls, *, where: Optional[str] = None):
  """Builds the frozen dataclass `cls` from a ConfigDict section (or mapping).

  Fields whose type is itself a dataclass are converted recursively from sub-sections.

  Args:
    section: ml_collections.ConfigDict / FrozenConfigDict / Mapping, or an instance of
      `cls` (returned as is).
    cls: the dataclass type to build.
    where: name of the section in error messages (default: the class name).
  Returns:
    An instance of `cls`.
  Raises:
    ValueError: naming unknown keys, missing required fields, or mistyped values.
  """
  where = where or cls.__name__
  if isinstance(section, cls):
    return section
  if isinstance(section, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    values = section.to_dict()
  elif isinstance(section, Mapping):
    values = dict(section)
  else:
    raise ValueError(f"{where}: expected a config section (mapping), got {type(section)}")
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ValueError(f"{where}: unknown config key(s) {', '.join(map(repr, unknown))}; "
                     f"known: {', '.join(sorted(fields))}")
  missing = sorted(n for n, f in fields.items() if n not in values
                   and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING)
  if missing:
    raise ValueError(f"{where}: missing config key(s) {', '.join(map(repr, missing))}")
  hints = typing.get_type_hints(cls)
  kwargs = {n: _check_type(f"{where}.{n}", v, hints.get(n, Any)) for n, v in values.items()}
  return cls(**kwargs)


def _first_message(e: BaseException) -> str:
  """The innermost message of `e` (ml_collections wraps a KeyError in an AttributeError)."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  return str(e.args[0]) if e.args else str(e)


def unknown_key_message(e: BaseException, argv: list[str]) -> str:
  """One line naming the unknown key of a locked-config override and the flag that set it
  (ml_collections' own message is a KeyError repr with a newline and quotes)."""
  msg = _first_message(e)
  found = re.search(r"""['"]([^'"]+)['"]""", msg)
  key = found.group(1) if found else msg.split("\n")[0].strip()
  hint = re.search(r'Did you mean "([^"]+)"', msg)
  overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--") and "." in a.split("=")[0]]
  named = [o for o in overrides if o.rsplit(".", 1)[-1] == key] or overrides
  return (f"unknown config key {key!r} in {', '.join(named)}"
          + (f" (did you mean {hint.group(1)!r}?)" if hint else "")
          + ": the config is locked, only keys defined by the config file can be set")


def flags_parser(argv: list[str]) -> list[str]:
  """absl `app.run(main, flags_parser=...)` parser with one-line errors (exit 1): a bad
  flag or config file, and overrides of keys that a locked config does not define
  (`--config.bogus=1`).

  ml_collections reports those as a bare AttributeError deep in a traceback; this turns
  it into `SystemExit` naming the unknown key and the override that set it.
  """
  from absl import flags  # only launchers need absl
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if "--debug" in argv:
      raise
    raise SystemExit(f"error: {flag_error_message(e)}") from None
  except (AttributeError, KeyError) as e:
    if "--debug" in argv:
      raise
    raise SystemExit(f"error: {unknown_key_message(e, argv)}") from None


def flag_error_message(e: BaseException) -> str:
  """One line for an absl flag error. A config file that raised while it was loaded
  (e.g. `parse_arg` on an unknown `:arg`) comes wrapped with its whole traceback in the
  message: keep the flag and the exception's own message."""
  msg = str(e)
  if "Traceback (most recent call last)" in msg:
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    last = re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1])
    flag = re.match(r"^(flag \S+): ", msg)
    return f"{flag.group(1) if flag else 'flags'}: {last}"
  return " ".join(msg.split()) + " (--helpshort lists the flags)"
