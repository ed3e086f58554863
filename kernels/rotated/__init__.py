"""Ragged-head decode attention over a rotated (FDC / ZACK) cache: per-KV-head kept widths.

`ragged_attention(q_rot, k_rot, v_rot, lengths, k_widths=..., v_widths=..., scale=...)`
returns (out [B, G, sum v], lse [B, K, G]) with the semantics of
`reference.ragged_attention_reference` (the operand contract is in its docstring); with
`heads_width=W`, out [B, K, G, W] per head, zero-padded (`to_heads`).
Implementations:
  "reference"  plain jnp float32 (runs anywhere; prefill uses it too);
  "triton"     the split-K kernel in `triton_ragged`: (request, KV head) tasks cut into chunks
               along the sequence, launched longest first (LPT, `lpt`); bf16/fp16 caches,
               widths <= 256 (`triton_fit`); its launch records and split-K combine run as
               one small Triton launch each (`triton_records`, `triton_combine`).
None picks "triton" on a GPU with jax-triton when the operands fit it (`triton_fit`) or kernel
knobs are passed, else "reference".
`ragged_attention_quantized(q_rot, keys, values, lengths, ...)`: the same over K'/V' held as
planar KIVI codes (the quantized rotated cache's store), read as codes by
`triton_ragged_quant` (2/4-bit, groups of 16: `quantized_fit`).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from ..common import triton_backend
from .reference import check_inputs, ragged_attention_reference, unpack

IMPLEMENTATIONS = ("reference", "triton")


def triton_fit(q_shape, k_widths, v_widths, dtype, capacity=None) -> str | None:
  """None when the Triton kernel takes these operands with its default knobs, else why not
  (one line). Pure shape/dtype checks (`triton_plan.check_fit`): no device, no Triton.

  Args:
    q_shape: (B, G, sum(k_widths)); dtype: the cache dtype (bf16 or fp16);
    capacity: cache slots S, if known (int32 indexing bound).
  """
  from .triton_plan import check_fit  # pylint: disable=import-outside-toplevel
  try:
    check_fit(tuple(q_shape), tuple(k_widths), tuple(v_widths), jnp.dtype(dtype), capacity)
  except ValueError as e:
    return str(e)
  return None


def resolve_implementation(implementation=None, *, args=None, options=None, fit=None,
                           op="ragged_attention") -> str:
  """The implementation `op` runs: `implementation` if it can run here (GPU kernels fall back
  to "reference" without a GPU or jax-triton); for None, "triton" where it can run and `args`
  fit it (`fit(*args)` is None; default `triton_fit`, args = (q_shape, k_widths, v_widths,
  dtype, capacity)) or `options` (kernel knobs) are passed, else "reference"."""
  impl = triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("triton",), needs_triton=("triton",), op=op)
  if (implementation is None and impl == "triton" and args is not None and not options
      and (fit or triton_fit)(*args) is not None):
    return "reference"
  return impl


def to_heads(out, v_widths, width: int):
  """Packed out [B, G, sum v] → [B, K, G, width]: head h's v_h columns, then zeros."""
  check_heads_width(v_widths, width)
  return unpack(out, v_widths, width).swapaxes(1, 2)


def check_heads_width(v_widths, width):
  if width is not None and (int(width) != width or width < max(v_widths)):
    raise ValueError(f"ragged_attention: heads_width must be an int >= max(v_widths)="
                     f"{max(v_widths)}, got {width!r}")


def ragged_attention(q_rot, k_rot, v_rot, lengths, *, k_widths, v_widths, scale,
                     out_dtype=None, implementation=None, heads_width=None, **knobs):
  """Ragged-head decode attention; see `reference.ragged_attention_reference`.

  Args:
    implementation: None (see `resolve_implementation`) | "reference" | "triton".
    heads_width: None: out [B, G, sum v] packed (the contract); an int W >= max(v_widths):
      out [B, K, G, W], head h's v_h columns then zeros (`to_heads`; the layout of a W_o
      padded per head, which the Triton path gathers in its combine directly).
    **knobs: Triton kernel options (block_s, target_chunks, chunk_tokens, schedule,
      num_warps, num_stages, poison, return_partials; `triton_ragged.ragged_attention_triton`).
  """
  check_inputs(q_rot, k_rot, v_rot, lengths, k_widths, v_widths)
  impl = resolve_implementation(
      implementation, args=(q_rot.shape, k_widths, v_widths, k_rot.dtype, k_rot.shape[1]),
      options=knobs)
  if implementation not in (None, impl):
    warnings.warn(f"ragged_attention: {implementation!r} unavailable here, running {impl!r}")
  check_heads_width(v_widths, heads_width)
  if impl == "reference":
    out, lse = ragged_attention_reference(q_rot, k_rot, v_rot, lengths, k_widths=k_widths,
                                          v_widths=v_widths, scale=scale, out_dtype=out_dtype)
    return (out if heads_width is None else to_heads(out, v_widths, heads_width)), lse
  from .triton_ragged import ragged_attention_triton  # pylint: disable=import-outside-toplevel
  return ragged_attention_triton(q_rot, k_rot, v_rot, lengths, k_widths=tuple(k_widths),
                                 v_widths=tuple(v_widths), scale=scale, out_dtype=out_dtype,
                                 heads_width=heads_width, **knobs)


def quantized_fit(q_shape, keys, values, k_widths, v_widths, dtype) -> str | None:
  """None when the quantized Triton kernel reads this planar store (`triton_plan.check_store`)
  with a query [B, G, sum(k_widths)] of `dtype` (bf16 or fp16) in its default knobs, else why
  not (one line)."""
  from .triton_plan import check_store  # pylint: disable=import-outside-toplevel
  try:
    check_store(keys, values, tuple(k_widths), tuple(v_widths))
  except ValueError as e:
    return str(e)
  return triton_fit(q_shape, k_widths, v_widths, dtype, keys.codes.shape[2])


def ragged_attention_quantized(q_rot, keys, values, lengths, *, k_widths, v_widths, scale,
                               out_dtype=None, implementation=None, heads_width=None, **knobs):
  """`ragged_attention` over K'/V' held as planar KIVI codes of one pseudo-head (the
  quantized rotated cache's inner store: `kivi.planar.KiviKeys` [B, 1, S, Σk bits / 8],
  `KiviValues`), attending slots [0, lengths[b]) of row b. "reference": the store
  dequantized (`kivi.planar`, to the scales' dtype), cast to q_rot's dtype, then
  `ragged_attention_reference`; "triton": the kernel reading the codes, dequantizing each tile
  to the scales' dtype, its MMAs in that dtype (`triton_ragged_quant`). None picks "triton"
  where it can run and the store fits it (`quantized_fit`) or knobs are passed."""
  from ..kivi import planar  # pylint: disable=import-outside-toplevel
  dtype = q_rot.dtype
  check_heads_width(v_widths, heads_width)
  impl = resolve_implementation(
      implementation, args=(q_rot.shape, keys, values, k_widths, v_widths, dtype),
      options=knobs, fit=quantized_fit, op="ragged_attention_quantized")
  if implementation not in (None, impl):
    warnings.warn(f"ragged_attention_quantized: {implementation!r} unavailable here, "
                  f"running {impl!r}")
  if impl == "reference":
    kh = planar.dequantize_keys(keys, sum(k_widths))[:, :, 0].astype(dtype)
    vh = planar.dequantize_values(values, sum(v_widths))[:, :, 0].astype(dtype)
    return ragged_attention(q_rot, kh, vh, lengths, k_widths=k_widths, v_widths=v_widths,
                            scale=scale, out_dtype=out_dtype, implementation="reference",
                            heads_width=heads_width)
  from .triton_ragged_quant import ragged_attention_quantized_triton  # pylint: disable=C0415
  return ragged_attention_quantized_triton(q_rot, keys, values, lengths,
                                           k_widths=tuple(k_widths), v_widths=tuple(v_widths),
                                           scale=scale, out_dtype=out_dtype,
                                           heads_width=heads_width, **knobs)
