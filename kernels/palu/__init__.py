"""Palu fused latent decode attention (G-LRD key/value latents, RoPE keys, split-K).

`palu_attention(q, hk, hv, b_k, lengths, ...)` returns (out [B, N, rv], lse)
with the semantics of `reference.palu_attention_reference`; latents are bf16 or fp16
arrays or `PackedLatent` (2/3/4/8-bit codes in `quant.packing` rows, per-token scale/zero).
Implementations:
  "reference"  plain jnp float32 (runs anywhere; also what prefill uses: it
               reconstructs K for all tokens and runs dense attention);
  "xla"        the same reconstruction path on the input dtypes (bf16 einsums);
  "triton"     the fused kernel in `triton_palu` (bf16/fp16 latents and 2/3/4-bit packed
               latents without row padding, `triton_fit`; fp16 latents are computed in
               fp16, other float arrays are rounded to bf16);
  "mosaic"     the warp-specialised Pallas Mosaic GPU kernel in `mosaic_palu`
               (Hopper; bf16 latents or both latents packed at 2 or 4 bits with fp16
               scales, H = 128, ranks multiple of 64, no key bias, `mosaic_fit`).
None picks "mosaic" on a Hopper GPU when the inputs fit it with its default knobs and no
kernel options are passed (`mosaic_fit`), else "triton" on a GPU with jax-triton, else
"reference". How the kernels compare with dense attention: BENCHMARKS.md.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from ..common import platform, triton_backend
from ..dense.xla import decode_attention_xla, matmul_dtype
from .packed import PackedLatent, dequantize_latent, quantize_latent  # noqa: F401
from .reference import check_shapes, palu_attention_reference, rope_angles, rope_inv_freq

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")


def mosaic_fit(q, hk, hv, b_k, lengths, k_bias=None) -> str | None:
  """None when the Mosaic kernel takes these inputs with its default knobs, else why not.

  Pure shape/dtype checks (`check_shapes`, the kernel's own `mosaic_plan.check_inputs` and
  `plan`), no device needed. fp16 latents are refused here although the kernel takes them:
  it would round them to bf16, which the triton kernel does not.
  """
  from .mosaic_plan import check_inputs, packed_bits, plan  # pylint: disable=C0415
  try:
    check_shapes(q, hk, hv, b_k, lengths, k_bias)
    check_inputs(hk, hv, k_bias)
    bits = packed_bits(hk)
    for name, x in (("hk", hk), ("hv", hv)):
      if bits is None and jnp.dtype(x.dtype) != jnp.bfloat16:
        return f"{name} is {jnp.dtype(x.dtype).name}, not bfloat16"
    plan(q.shape, hk.shape, hv.shape, b_k.shape, bits=bits)
  except ValueError as e:
    return str(e)
  return None


def triton_fit(q, hk, hv, b_k, lengths, k_bias=None) -> str | None:
  """None when the Triton kernel takes these inputs with its default knobs, else why not.

  Pure shape checks (`check_shapes` and the kernel's `triton_palu_launch.plan`), no device
  and no Triton needed: head dim a power of two >= 32, ranks multiples of 16 that split
  into power-of-two pieces, packed latents of 2, 3 or 4 bits whose rows hold no padding
  (rank a multiple of `quant.packing.row_block(bits)`), ...
  """
  from .triton_plan import DEFAULT_BLOCK_S, latent_bits, plan  # pylint: disable=C0415
  try:
    check_shapes(q, hk, hv, b_k, lengths, k_bias)
    plan(q.shape, hk.shape, hv.shape, b_k.shape, kbits=latent_bits(hk), vbits=latent_bits(hv),
         has_bias=k_bias is not None, block_s=DEFAULT_BLOCK_S)
  except ValueError as e:
    return str(e)
  return None


def resolve_implementation(implementation=None, *, args=None, options=None) -> str:
  """The implementation that `palu_attention` will run for this request.

  Args:
    implementation: None or one of IMPLEMENTATIONS.
    args: (q, hk, hv, b_k, lengths, k_bias) of the call; with implementation None on a
      Hopper GPU, "mosaic" is picked when they fit it (`mosaic_fit`) and `options` is empty
      (kernel knobs name one backend's parameters, so a call passing any keeps "triton").
    options: the call's kernel knobs.
  """
  if (implementation is None and args is not None and not options
      and platform.hopper_available() and mosaic_fit(*args) is None):
    return "mosaic"
  return triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("triton", "mosaic"), needs_triton=("triton",),
                                op="palu_attention")


def _palu_attention_xla(q, hk, hv, b_k, lengths, inv, k_bias, scale, out_dtype):
  """Unfused baseline: reconstruct K (bf16 einsum), RoPE, dense XLA attention over latents."""
  gr, g, _, _, _ = check_shapes(q, hk, hv, b_k, lengths, k_bias)
  h = q.shape[-1]
  lat = lambda x: dequantize_latent(x).astype(jnp.bfloat16) if isinstance(x, PackedLatent) else x
  hk_b, hv_b = lat(hk), lat(hv)
  mdt = matmul_dtype(hk_b.dtype)
  keys = jnp.einsum("bsgr,grc->bsgc", hk_b.astype(mdt), b_k.astype(mdt),
                    preferred_element_type=jnp.float32)
  if k_bias is not None:
    keys = keys + k_bias.astype(jnp.float32)
  bsz, s = keys.shape[:2]
  keys = keys.reshape(bsz, s, gr * g, h)
  ang = rope_angles(inv, jnp.arange(s))
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  k1, k2 = keys[..., :h // 2], keys[..., h // 2:]
  keys = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1).astype(jnp.bfloat16)
  values = jnp.repeat(hv_b, g, axis=2)
  return decode_attention_xla(q, keys, values, lengths, scale=scale, out_dtype=out_dtype)


def palu_attention(q, hk, hv, b_k, lengths, *, rope_theta=10000.0, inv_freq=None, k_bias=None,
                   scale=None, out_dtype=None, implementation=None, **options):
  """Palu decode attention; see `reference.palu_attention_reference` for Args/Returns.

  Args:
    implementation: None (the fastest that fits here: see `resolve_implementation`) |
      "reference" | "xla" | "triton" | "mosaic".
    **options: kernel knobs (triton: block_s, num_splits, absorb, target_programs, trans,
      num_warps, num_stages, heads_per_program, poison, return_partials, rope, rope_dtype;
      see `palu_attention_triton`. mosaic: heads_per_program, stages, v_stages, num_splits,
      target_programs, return_partials, rope; see `palu_attention_mosaic`).
  """
  impl = resolve_implementation(implementation, args=(q, hk, hv, b_k, lengths, k_bias),
                                options=options)
  if implementation not in (None, impl):
    warnings.warn(f"palu_attention: {implementation!r} unavailable here, running {impl!r}")
  if impl == "reference":
    return palu_attention_reference(q, hk, hv, b_k, lengths, rope_theta=rope_theta,
                                    inv_freq=inv_freq, k_bias=k_bias, scale=scale,
                                    out_dtype=out_dtype)
  inv = rope_inv_freq(q.shape[-1], rope_theta, inv_freq)
  if impl == "xla":
    return _palu_attention_xla(q, hk, hv, b_k, lengths, inv, k_bias, scale, out_dtype)
  check_shapes(q, hk, hv, b_k, lengths, k_bias)
  if impl == "mosaic":
    from .mosaic_palu import palu_attention_mosaic  # pylint: disable=import-outside-toplevel
    return palu_attention_mosaic(q, hk, hv, b_k, lengths, inv, k_bias=k_bias, scale=scale,
                                 out_dtype=out_dtype, **options)
  from .triton_palu_launch import palu_attention_triton  # pylint: disable=import-outside-toplevel
  return palu_attention_triton(q, hk, hv, b_k, lengths, inv, k_bias=k_bias, scale=scale,
                               out_dtype=out_dtype, **options)
