"""Calling Triton kernels from JAX through jax-triton 0.3.x, and detecting whether we can.

jax-triton 0.3.x takes `out_shape=` (0.4.x renamed it and needs Triton >= 3.7).
Output pointers follow the inputs in the kernel signature. Python ints and
floats are passed as scalar kernel arguments: strides derived from them carry
no divisibility hint, so kernels derive row strides from constexpr head dims
instead and take only the cache capacity and batch as run-time ints (one
compiled kernel then serves every context length and batch size).

Each kernel has one entry point, which declares one init pointer per output (never read)
after its other arguments, right before the output pointers. `poison=True` (tests) passes
NaN-filled buffers there, aliased to the outputs, so an element the kernel fails to write
stays NaN; otherwise they are 1-element dummies. Kernels that are never poisoned may omit
them (`inits=False`).

`max_registers=n` caps the registers per thread (Triton's `maxnreg`, the PTX `.maxnreg`
directive), which jax-triton 0.3.1 does not pass: `_install_register_cap` wraps its
`get_or_create_triton_kernel` so that a kernel launched with the constexpr `MAXNREG` (which
the kernel must declare, unused) compiles with `maxnreg=MAXNREG`. The constexpr is part of
jax-triton's compile-cache key, so capped and uncapped builds of one kernel do not collide.

Every launch lowers to jaxlib's typed-FFI Triton handler `triton_kernel_call_ffi` (the one
JAX's own Pallas-Triton lowering uses), not to the legacy `triton_kernel_call` that jax-triton
0.3.1 emits: the FFI handler is marked command-buffer compatible, so XLA records the launches
in its CUDA graphs with the fusions, GEMMs and Mosaic calls around them, while a legacy custom
call splits the graph and leaves the GPU waiting at each launch outside it
(`results/decode_ablations.md`, "the launches outside the CUDA graphs"). `_install_ffi_lowering`
re-registers jax-triton's CUDA lowering so that it re-targets the op jax-triton builds (the
same compressed kernel proto, passed as the handler's `opaque` attribute); where the jaxlib
lacks the handler, jax-triton's lowering stays as it is.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp

from . import splitk


def gpu_available() -> bool:
  """True when JAX's default backend is a GPU."""
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """True when jax-triton and Triton import and JAX's default backend is a GPU."""
  if importlib.util.find_spec("triton") is None or importlib.util.find_spec("jax_triton") is None:
    return False
  if not gpu_available():
    return False
  try:
    import jax_triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except Exception:  # pylint: disable=broad-except  (an incompatible JAX fails here)
    return False
  return True


def resolve(implementation, *, known, default_gpu, needs_gpu, needs_triton, op):
  """Maps a requested implementation to the one that will run.

  Args:
    implementation: None (best available), or one of `known`.
    known: accepted names.
    default_gpu: what None means where the GPU backends are usable.
    needs_gpu: names that need a GPU; they fall back to "reference" without one.
    needs_triton: names that also need jax-triton.
    op: op name for error messages.
  Returns:
    the implementation name to run.
  """
  if implementation is not None and implementation not in known:
    raise ValueError(f"{op}: implementation must be None or one of {known}, "
                     f"got {implementation!r}")
  if implementation is None:
    implementation = default_gpu
  if implementation in needs_triton and not available():
    return "reference"
  if implementation in needs_gpu and not gpu_available():
    return "reference"
  return implementation


def poison_value(dtype) -> float:
  """NaN for floating outputs (the only kind the kernels write)."""
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"poisoning supports floating outputs only, got {dtype}")
  return math.nan


MAX_REGISTERS = "MAXNREG"  # the constexpr that carries `max_registers` to the compiler


def _with_maxnreg(backend_init_func, maxnreg: int):
  """A jax-triton backend factory whose Triton options carry `maxnreg`."""
  def init(device, compute_capability):
    backend = backend_init_func(device, compute_capability)
    parse = backend.parse_options
    backend.parse_options = lambda opts: parse({**opts, "maxnreg": maxnreg})
    return backend
  return init


@functools.lru_cache(maxsize=None)
def _install_register_cap() -> None:
  """Makes jax-triton compile kernels launched with constexpr MAXNREG = n under `maxnreg=n`."""
  from jax_triton import triton_lib  # pylint: disable=import-outside-toplevel
  create = triton_lib.get_or_create_triton_kernel

  def get_or_create(backend_init_func, *args, metaparams, **kwargs):
    cap = metaparams.get(MAX_REGISTERS)
    if cap:
      backend_init_func = _with_maxnreg(backend_init_func, int(cap))
    return create(backend_init_func, *args, metaparams=metaparams, **kwargs)

  triton_lib.get_or_create_triton_kernel = get_or_create


TRITON_FFI_TARGET = "triton_kernel_call_ffi"


def retarget_to_ffi(results):
  """Rewrites the custom call that produced `results` (jax-triton's legacy
  `triton_kernel_call`, api_version 2, its backend_config the compressed kernel proto) into a
  call of the typed-FFI handler, in the form `jax.interpreters.mlir.custom_call` gives a
  dictionary backend_config (as JAX's Pallas-Triton lowering builds this call): backend_config
  "", api_version 1, and `mhlo.backend_config` = {opaque: the same bytes}, which XLA's import
  turns into a typed-FFI call. Returns `results`."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  op = results[0].owner
  op = getattr(op, "operation", op)
  config = op.attributes["backend_config"]
  if "mhlo.backend_config" in op.attributes or not isinstance(config, ir.StringAttr):
    raise TypeError(f"retarget_to_ffi: expected a legacy call with a string backend_config, "
                    f"got {op.attributes['call_target_name']}")
  op.attributes["call_target_name"] = ir.StringAttr.get(TRITON_FFI_TARGET)
  op.attributes["api_version"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)
  op.attributes["backend_config"] = ir.StringAttr.get("")
  op.attributes["mhlo.backend_config"] = ir.DictAttr.get({"opaque": config})
  return results


def ffi_handler_registered() -> bool:
  """True when this jaxlib's CUDA plugin registers `triton_kernel_call_ffi`."""
  try:
    from jax._src.lib import gpu_triton  # pylint: disable=import-outside-toplevel
    plugin = getattr(gpu_triton, "_cuda_triton", None)
    return plugin is not None and TRITON_FFI_TARGET in plugin.registrations()
  except Exception:  # pylint: disable=broad-except  (a jaxlib without the plugin API)
    return False


def legacy_cuda_lowering():
  """jax-triton's own CUDA lowering rule (the legacy `triton_kernel_call`), as it registers it."""
  from jax_triton import triton_lib  # pylint: disable=import-outside-toplevel
  return functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)


@functools.lru_cache(maxsize=None)
def _install_ffi_lowering() -> bool:
  """Makes jax-triton's CUDA lowering emit `triton_kernel_call_ffi`; False where the jaxlib
  lacks the handler (jax-triton's own lowering then stays)."""
  if not ffi_handler_registered():
    return False
  from jax.interpreters import mlir  # pylint: disable=import-outside-toplevel
  from jax_triton import triton_lib  # pylint: disable=import-outside-toplevel
  legacy = legacy_cuda_lowering()

  def lowering(ctx, *args, **params):
    return retarget_to_ffi(legacy(ctx, *args, **params))

  mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")
  return True


def launch(kernel, *args, out_shapes, grid, num_warps: int, num_stages: int,
           poison: bool = False, aliases=None, max_registers: int | None = None,
           inits: bool = True, **constexprs):
  """Runs a Triton kernel on JAX arrays.

  Args:
    kernel: the `@triton.jit` entry (inputs..., one init pointer per output, outputs...,
      constexprs).
    *args: arrays and Python scalars, in kernel order (without the init pointers).
    out_shapes: sequence of `jax.ShapeDtypeStruct`.
    grid: launch grid (tuple of ints).
    num_warps, num_stages: Triton compile options.
    poison: the init pointers get NaN-filled buffers aliased to the outputs.
    aliases: {array argument index: output index}: outputs written in place of those
      inputs (the kernel starts from the input's contents; not with poison).
    max_registers: cap on registers per thread; 0: no cap, the compiler's choice (up to
      255); None: the kernel does not declare the constexpr `MAXNREG` (no cap either).
    inits: False: the kernel declares no init pointers, so it cannot be poisoned. The KIVI
      cache update (aliased outputs, which poison excludes) and window epilogue (never
      poisoned) launch so, rather than declare pointers that no launch would fill.
    **constexprs: compile-time kernel parameters.
  Returns:
    list of output arrays.
  """
  if max_registers and not 24 <= max_registers <= 255:
    raise ValueError(f"launch: max_registers must be 0 or in [24, 255], got {max_registers}")
  import jax_triton as jt  # pylint: disable=import-outside-toplevel
  _install_ffi_lowering()
  out_shapes = list(out_shapes)
  if max_registers is not None:
    if max_registers:
      _install_register_cap()
    constexprs[MAX_REGISTERS] = int(max_registers)
  if aliases and poison:
    raise ValueError("launch: poison and aliases exclude each other")
  if poison and not inits:
    raise ValueError("launch: poison needs a kernel with init pointers")
  aliases = dict(aliases or {})
  if poison:
    n_arrays = sum(1 for a in args if isinstance(a, jax.Array))
    aliases = {n_arrays + i: i for i in range(len(out_shapes))}
    init_args = [jnp.full(s.shape, poison_value(s.dtype), s.dtype) for s in out_shapes]
  else:
    init_args = [jnp.zeros((1,), s.dtype) for s in out_shapes] if inits else []
  outs = jt.triton_call(*args, *init_args, kernel=kernel, out_shape=out_shapes, grid=grid,
                        num_warps=num_warps, num_stages=num_stages,
                        input_output_aliases=aliases, **constexprs)
  return list(outs)


def launch_split_k(kernel, *args, out_dtype, return_partials=False, **launch_kw):
  """`launch` of a split-K decode kernel whose outputs are the (o, lse) partials, then
  `splitk.combine_partials`. Returns (out, lse), plus the raw (o, lse) if return_partials."""
  o, lse = launch(kernel, *args, **launch_kw)
  return splitk.combine_result(o, lse, out_dtype, return_partials)
