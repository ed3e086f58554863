"""Run a jax-triton kernel launch under Triton's CPU interpreter (TRITON_INTERPRET=1).

The Triton kernels run through jax-triton on a GPU only. The interpreter
executes the same `@triton.jit` source on a CPU with torch tensors, which
catches indexing, masking and algebra bugs before any device time is spent
(not performance, nor GPU-only codegen issues: the GPU tests still run them).

Usage (the env var must be set before the kernel modules are imported, so the
checks run in a subprocess; see `test_triton_interpret.py`):

    with interpreted_launch():
      out = kivi_attention_triton(...)   # `triton_backend.launch` now interprets

Needs `triton` and `torch` importable (CPU wheels); tests skip without them.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np


def _to_torch(x):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  if isinstance(x, jax.Array):
    if x.dtype == jnp.uint32:
      return torch.from_numpy(np.array(x).view(np.int32))
    if x.dtype == jnp.bfloat16:
      return torch.from_numpy(np.array(x.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))
  if isinstance(x, np.floating):
    return float(x)
  if isinstance(x, np.integer):
    return int(x)
  return x


def _to_jax(t, dtype=None):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  if dtype is not None and jnp.dtype(dtype) == jnp.uint32:
    return jnp.asarray(t.numpy().view(np.uint32))
  if t.dtype == torch.bfloat16:
    return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
  return jnp.asarray(t.numpy())


def _patch_interpreter():
  """Three Triton 3.6 interpreter bugs: it turns 1-element arrays into ints with
  int(arr), which NumPy >= 2.4 refuses for arrays of ndim > 0 (use .item()); bf16
  tl.dot; and float32 -> bf16 by truncation (below)."""
  from triton.runtime import interpreter  # pylint: disable=import-outside-toplevel
  if getattr(interpreter, "_kvlowrank_patched", False):
    return
  original = interpreter._patch_lang_tensor  # pylint: disable=protected-access

  def patched(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

  interpreter._patch_lang_tensor = patched  # pylint: disable=protected-access

  # Triton 3.6's interpreter stores bf16 as raw uint16 and multiplies those raw bits in
  # tl.dot; widen bf16 operands to float32 first (exact).
  import triton.language as tl  # pylint: disable=import-outside-toplevel
  builder_cls = interpreter.InterpreterBuilder
  dot = builder_cls.create_dot

  def widen(h):
    if h.dtype == tl.bfloat16:
      data = (h.data.astype(np.uint32) << 16).view(np.float32)
      return interpreter.TensorHandle(data, tl.float32)
    return h

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

  builder_cls.create_dot = create_dot

  # ... and it converts float32 to bf16 by truncation, where the GPU (cvt.rn) rounds to
  # nearest even: round here too, so that kernels that store bf16 agree with XLA.
  cast = builder_cls.cast_impl

  def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
      bits = np.ascontiguousarray(src.data, np.float32).view(np.uint32).astype(np.uint64)
      rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
      return interpreter.TensorHandle(rounded, tl.bfloat16)
    return cast(self, src, dst_type)

  builder_cls.cast_impl = cast_impl
  builder_cls.create_fp_trunc = cast_impl
  interpreter._kvlowrank_patched = True  # pylint: disable=protected-access


def launch_interpreted(kernel, *args, out_shapes, grid, num_warps: int, num_stages: int,
                       poison: bool = False, aliases=None, max_registers=None, inits=True,
                       **constexprs):
  """Drop-in for `triton_backend.launch` that runs the kernel in the interpreter (an
  aliased output starts as a copy of its input, as XLA gives it; uint32 arrays travel as
  int32, bit for bit; a register cap only reaches the kernel as its constexpr)."""
  del num_warps, num_stages
  if max_registers is not None:
    from kvlowrank_kernels.common import triton_backend  # pylint: disable=import-outside-toplevel
    constexprs[triton_backend.MAX_REGISTERS] = int(max_registers)
  import torch  # pylint: disable=import-outside-toplevel
  if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("set TRITON_INTERPRET=1 before importing the kernel modules")
  _patch_interpreter()
  tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
         "int32": torch.int32, "uint8": torch.uint8, "uint32": torch.int32}
  outs = []
  for s in out_shapes:
    t = torch.empty(tuple(s.shape), dtype=tdt[str(s.dtype)])
    t.fill_(float("nan") if poison else 0)
    outs.append(t)
  targs = [_to_torch(a) for a in args]
  import jax  # pylint: disable=import-outside-toplevel
  arrays = [t for a, t in zip(args, targs) if isinstance(a, jax.Array)]  # as jax-triton counts
  for i, o in (aliases or {}).items():
    outs[o].copy_(arrays[i])
  if poison:
    init_args = [o.clone() for o in outs]
  else:
    init_args = [torch.zeros(1, dtype=o.dtype) for o in outs] if inits else []
  kernel[grid](*targs, *init_args, *outs, **constexprs)
  return [_to_jax(o, s.dtype) for o, s in zip(outs, out_shapes)]


@contextlib.contextmanager
def interpreted_launch():
  """Routes every `triton_backend.launch` through the interpreter while active."""
  from kvlowrank_kernels.common import triton_backend  # pylint: disable=import-outside-toplevel
  saved = triton_backend.launch
  triton_backend.launch = launch_interpreted
  try:
    yield
  finally:
    triton_backend.launch = saved
