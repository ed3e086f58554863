"""Dense single-token (decode) GQA attention over a slot cache: the baseline kernels.

`decode_attention(q, k, v, lengths, implementation=...)` returns (out, lse) with
the semantics of `reference.decode_attention_reference`. Implementations:
  "reference"  plain jnp, float32 (runs anywhere);
  "xla"        jnp einsums on the cache dtype with float32 accumulation;
  "cudnn"      `jax.nn.dot_product_attention(implementation="cudnn")`;
  "triton"     split-K flash-decoding kernel (`triton_decode`).
None picks "triton" on a GPU with jax-triton when the inputs fit it (`kernel_fit`: bf16 or
fp16 K/V, head dims the kernel takes) or kernel knobs are passed, else "reference".
GPU-only implementations asked for by name fall back to "reference" (with a warning) where
no GPU or jax-triton is available.
"""

from __future__ import annotations

import warnings

from ..common import splitk  # noqa: F401
from ..common import triton_backend
from .limits import check_cudnn_inputs, check_kernel_dtype, check_triton_shapes
from .reference import check_shapes, decode_attention_reference
from .xla import decode_attention_xla

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "triton")
GPU_KERNELS = ("triton", "cudnn")


def kernel_fit(q, k, v, lengths, implementation: str = "triton") -> str | None:
  """None when the GPU kernel `implementation` takes these inputs, else why not (one line).

  Pure shape/dtype checks (`limits`: the same functions the kernels' wrappers raise from),
  no device needed: K and V bf16 or fp16 (fp32 would run the MMAs in TF32), the head
  dims the kernel takes with its default knobs (triton: powers of two >= 16, a sequence
  within int32 indexing; cudnn: V head dim == K head dim, one K/V dtype, a multiple of 8
  and <= 128).

  Args:
    q, k, v, lengths: as `decode_attention`: arrays, or anything with their .shape, .ndim
      and .dtype (`jax.ShapeDtypeStruct`), since only shapes and dtypes are read.
    implementation: "triton" (what None picks) or "cudnn".
  """
  if implementation not in GPU_KERNELS:
    raise ValueError(f"kernel_fit: implementation must be one of {GPU_KERNELS}, "
                     f"got {implementation!r}")
  try:
    check_shapes(q, k, v, lengths)
    check_kernel_dtype("k", k)
    check_kernel_dtype("v", v)
    if implementation == "triton":
      check_triton_shapes(q.shape, k.shape, v.shape)
    else:
      check_cudnn_inputs(k, v)
  except ValueError as e:
    return str(e)
  return None


def resolve_implementation(implementation=None, *, args=None, options=None) -> str:
  """The implementation that `decode_attention` will run for this request.

  Args:
    implementation: None or one of IMPLEMENTATIONS.
    args: (q, k, v, lengths) of the call; with implementation None where "triton" can run,
      it is picked when they fit it (`kernel_fit`) or `options` is not empty (the knobs
      are the Triton kernel's: its wrapper then names what it does not take), else
      "reference".
    options: the call's kernel knobs.
  """
  impl = triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("cudnn", "triton"), needs_triton=("triton",),
                                op="decode_attention")
  if (implementation is None and impl == "triton" and args is not None and not options
      and kernel_fit(*args) is not None):
    return "reference"
  return impl


def decode_attention(q, k, v, lengths, *, scale=None, out_dtype=None, implementation=None,
                     **options):
  """Decode attention; see `reference.decode_attention_reference` for Args/Returns.

  Args:
    implementation: None (see `resolve_implementation`) | "reference" | "xla" | "cudnn" |
      "triton".
    **options: backend knobs (triton: block_s, num_splits, num_warps, num_stages, poison).
  """
  impl = resolve_implementation(implementation, args=(q, k, v, lengths), options=options)
  if implementation not in (None, impl):
    warnings.warn(f"decode_attention: {implementation!r} unavailable here, running {impl!r}")
  if impl == "reference":
    return decode_attention_reference(q, k, v, lengths, scale=scale, out_dtype=out_dtype)
  if impl == "xla":
    return decode_attention_xla(q, k, v, lengths, scale=scale, out_dtype=out_dtype)
  if impl == "cudnn":
    from .cudnn import decode_attention_cudnn  # pylint: disable=import-outside-toplevel
    return decode_attention_cudnn(q, k, v, lengths, scale=scale, out_dtype=out_dtype)
  from .triton_decode import decode_attention_triton  # pylint: disable=import-outside-toplevel
  return decode_attention_triton(q, k, v, lengths, scale=scale, out_dtype=out_dtype, **options)
