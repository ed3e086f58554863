"""Dense single-token (decode) GQA attention over a slot cache: the baseline kernels.

`decode_attention(q, k, v, lengths, implementation=...)` returns (out, lse) with
the semantics of `reference.decode_attention_reference`. Implementations:
  "reference"  plain jnp, float32 (runs anywhere);
  "xla"        jnp einsums on the cache dtype with float32 accumulation;
  "cudnn"      `jax.nn.dot_product_attention(implementation="cudnn")`;
  "triton"     split-K flash-decoding kernel (`triton_decode`).
None picks "triton" on a GPU with jax-triton. GPU-only implementations fall back
to "reference" (with a warning) where no GPU or jax-triton is available.
"""

from __future__ import annotations

import warnings

from ..common import splitk  # noqa: F401
from ..common import triton_backend
from .reference import decode_attention_reference
from .xla import decode_attention_xla

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "triton")


def resolve_implementation(implementation=None) -> str:
  """The implementation that `decode_attention` will run for this request."""
  return triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("cudnn", "triton"), needs_triton=("triton",),
                                op="decode_attention")


def decode_attention(q, k, v, lengths, *, scale=None, out_dtype=None, implementation=None,
                     **options):
  """Decode attention; see `reference.decode_attention_reference` for Args/Returns.

  Args:
    implementation: None | "reference" | "xla" | "cudnn" | "triton".
    **options: backend knobs (triton: block_s, num_splits, num_warps, num_stages, poison).
  """
  impl = resolve_implementation(implementation)
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
