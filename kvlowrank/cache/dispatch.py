"""Which implementation a cache's `attend` runs, and the one log line when it is not a kernel.

Every method spec has an `implementation` field (copied onto its caches) and
`KVCache.attend(..., implementation=None)` may override it per call. `None` means the
fastest path that fits: on a GPU, a decode step (T = 1) runs the method's fused kernel;
anything a kernel does not cover (no GPU, prefill T > 1, head dim or ranks a kernel does not
take, a sliding window, fp32 caches...) runs the method's jnp reference. A named kernel
that does not fit also runs the reference. Either way the reason is logged once per
(method, reason), at trace time (the choice is static: shapes, dtypes and the platform).

`choose` is pure given its `platform` argument, so the CPU tests check the choice a GPU
would make (`Platform(gpu=True, hopper=True)`) without one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

log = logging.getLogger("kvlowrank.dispatch")

REFERENCE = "reference"
_LOGGED: set = set()


@dataclasses.dataclass(frozen=True)
class Platform:
  """What the kernels need from the machine: a CUDA GPU (Triton, cuDNN) and Hopper (the
  Pallas Mosaic GPU kernels)."""

  gpu: bool
  hopper: bool
  triton: bool = True   # jax-triton and Triton import (checked where a GPU is)

  @classmethod
  def detect(cls) -> "Platform":
    # Imported here: the kernels' platform probes import jax_triton lazily.
    from kvlowrank_kernels.common import platform, triton_backend  # pylint: disable=C0415
    return cls(gpu=triton_backend.gpu_available(), hopper=platform.hopper_available(),
               triton=triton_backend.available())


# A candidate kernel: (name, needs, fit) where needs is "gpu" or "hopper" and fit() returns
# None when the kernel takes this call's operands, else the reason (one line).
Candidate = tuple[str, str, Callable[[], Optional[str]]]


def choose(op: str, requested: Optional[str], candidates: Sequence[Candidate], *,
           decode: bool, platform: Optional[Platform] = None) -> tuple[str, Optional[str]]:
  """The implementation to run and, when it is the reference, why.

  Args:
    op: the method's name (for the messages).
    requested: None (fastest that fits), "reference", or one candidate's name.
    candidates: the method's kernels, fastest first.
    decode: whether this call is one token per row (T = 1); kernels are decode kernels.
    platform: the machine (default: detected).
  Returns:
    (implementation name, reason or None): the reason says why the reference runs, or why
    faster kernels were passed over for the one that runs.
  Raises:
    ValueError: `requested` is not None, "reference" or a candidate name.
  """
  names = [c[0] for c in candidates]
  if requested is not None and requested != REFERENCE and requested not in names:
    raise ValueError(f"{op}: implementation must be None, {REFERENCE!r} or one of {names}, "
                     f"got {requested!r}")
  if requested == REFERENCE:
    return REFERENCE, None
  if not decode:
    return REFERENCE, "prefill (T > 1): the kernels are decode kernels"
  if not candidates:
    return REFERENCE, "no kernel for this method"
  platform = Platform.detect() if platform is None else platform
  reasons = []
  for name, needs, fit in candidates:
    if requested is not None and name != requested:
      continue
    if needs == "hopper" and not platform.hopper:
      reasons.append(f"{name}: needs a Hopper GPU")
      continue
    if not platform.gpu:
      reasons.append(f"{name}: needs a GPU")
      continue
    why = fit()
    if why is None:
      return name, "; ".join(reasons) or None
    reasons.append(f"{name}: {why}")
  return REFERENCE, "; ".join(reasons)


def log_once(op: str, impl: str, reason: Optional[str], what: str = "attention") -> None:
  """Logs, once per (op, what, impl, reason), which implementation `op`'s `what` (its
  attention, or a cache's decode update) runs instead of a faster one, and why: a warning
  when a GPU is there but the reference runs for another reason than prefill, else at
  INFO."""
  if reason is None or (op, what, impl, reason) in _LOGGED:
    return
  _LOGGED.add((op, what, impl, reason))
  quiet = impl != REFERENCE or reason.startswith("prefill") or all(
      r.endswith(("needs a GPU", "needs a Hopper GPU")) for r in reason.split("; "))
  (log.info if quiet else log.warning)("%s %s runs %s: %s", op, what, impl, reason)
