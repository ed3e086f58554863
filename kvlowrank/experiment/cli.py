"""How every launcher in experiments/ ends: one line on a user error, exit 1.

`run(main)` replaces `app.run(main, ...)` in a launcher:

* a bad config, flag or file (ValueError, OSError such as FileNotFoundError, the
  one-line flag errors of `kvlowrank.config_lib.flags_parser`) prints one line,
  `error: <message naming the field or file>`, on stderr and exits with status 1;
  `--debug` or `--verbosity=1` (absl's -v) shows the traceback instead;
* Ctrl-C prints one line and exits with status 130 (the shell's code for SIGINT).
  Finished results are already on disk (kvlowrank.experiment.records appends
  atomically), so the process leaves through `os._exit` after flushing its output,
  without finalising the interpreter while XLA's and orbax's worker threads may be
  mid-task (a suspect for the segmentation fault once seen after a Ctrl-C in a sweep;
  not reproduced here).
  A Ctrl-C used to be lost at times: JAX runs a callback at every garbage collection
  (`gc.callbacks`), and a KeyboardInterrupt raised while it runs is printed as
  "Exception ignored in: _xla_gc_callback" and dropped, so the sweep went on. The
  SIGINT handler installed here (`_on_sigint`) re-delivers the signal a moment later when
  it lands inside a gc callback, and a second Ctrl-C exits at once;
* anything else (a bug) keeps its traceback.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from typing import Callable

from absl import app
from absl import flags

from kvlowrank import config_lib

_DEBUG = flags.DEFINE_bool("debug", False, "Show the full traceback of an error instead of "
                           "its one-line message.")

# What a user's input can raise: a bad config value or field, a missing or bad file.
USER_ERRORS = (ValueError, OSError)
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def one_line(error: BaseException) -> str:
  """The message of `error` on one line (KeyError's repr quotes and newlines dropped)."""
  msg = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
  msg = " ".join(str(msg).split())
  return msg or type(error).__name__


def _verbose() -> bool:
  try:
    return bool(flags.FLAGS.debug) or flags.FLAGS.verbosity >= 1
  except flags.UnparsedFlagAccessError:
    return False


def _leave(status: int) -> None:
  """Flushes stdout/stderr and exits without finalising the interpreter (module doc)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)  # pylint: disable=protected-access


_interrupting = False


def _in_gc_callback(frame) -> bool:
  """Whether `frame` (or a caller) is a `gc.callbacks` function, where an exception is
  printed and dropped instead of propagating."""
  codes = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
  while frame is not None:
    if frame.f_code in codes:
      return True
    frame = frame.f_back
  return False


def _on_sigint(signum, frame):
  """SIGINT: KeyboardInterrupt, re-delivered 50 ms later if it would be dropped inside a
  gc callback (module docstring); a second one while the first unwinds exits at once."""
  global _interrupting
  if _interrupting:
    print("interrupted (Ctrl-C twice): exiting now", file=sys.stderr)
    _leave(EXIT_INTERRUPTED)
  if _in_gc_callback(frame):
    threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
    return
  _interrupting = True
  raise KeyboardInterrupt


def guarded(main: Callable[[list[str]], object]) -> Callable[[list[str]], object]:
  """`main` with the launcher error handling of the module docstring."""

  def wrapped(argv):
    try:
      return main(argv)
    except KeyboardInterrupt:
      print("interrupted (Ctrl-C): finished results are kept; rerun the same command to "
            "resume", file=sys.stderr)
      _leave(EXIT_INTERRUPTED)
    except USER_ERRORS as e:
      if _verbose():
        raise
      print(f"error: {one_line(e)}", file=sys.stderr)
      _leave(EXIT_ERROR)
    return None

  return wrapped


def print_report(paths: dict) -> None:
  """What a launcher prints at the end when a report was written: the table's path, the
  plots' paths, then the markdown table itself (`paths`: "markdown" and "plots")."""
  print(f"table:    {paths['markdown']}")
  for p in paths["plots"]:
    print(f"plot:     {p}")
  with open(paths["markdown"], encoding="utf-8") as f:
    print(f.read())


def run(main: Callable[[list[str]], object], *, uses_jax: bool = True) -> None:
  """`absl.app.run(main)` for a launcher: config-flag parsing with one-line errors
  (`config_lib.flags_parser`), JAX's absl flags when `uses_jax`, and `guarded`."""
  if uses_jax:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.config_with_absl()
  if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
    signal.signal(signal.SIGINT, _on_sigint)
  try:
    app.run(guarded(main), flags_parser=config_lib.flags_parser)
  except KeyboardInterrupt:  # during flag parsing / config loading
    print("interrupted (Ctrl-C)", file=sys.stderr)
    _leave(EXIT_INTERRUPTED)
