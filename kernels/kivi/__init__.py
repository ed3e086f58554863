"""KIVI quantized decode attention: 2/4-bit per-channel keys, per-token values, exact window.

`kivi_attention(q, keys, values, k_win, v_win, q_len, w_len, ...)` returns
(out [B, N, H], lse) with the semantics of `reference.kivi_attention_reference`.
Implementations: "reference" (jnp float32, runs anywhere; prefill uses it or
dense attention on the unquantized prompt), "xla" (dequantize to bf16 + XLA
dense attention per segment), "triton" (`triton_kivi`, dequantization fused;
planar codes, see `packing`), "mosaic" (Pallas Mosaic GPU, 2-bit with groups of 32:
`mosaic_kivi_warp` (warp-level mma.sync, the default) or, with kernel="wgmma", `mosaic_kivi`;
planar inputs are first relaid out with `mosaic_layout.to_mosaic`, a pass over the cache per
call; a cache stored in a kernel's layout calls that kernel's function directly).
None picks "triton" on a GPU with jax-triton, else "reference".
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from ..common import triton_backend
from ..common.splitk import combine_partials
from ..dense.xla import decode_attention_xla
from .planar import (KiviKeys, KiviValues, dequantize_keys, dequantize_values,  # noqa: F401
                      quantize_keys, quantize_values)
from .reference import check_shapes, kivi_attention_reference

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")


def resolve_implementation(implementation=None) -> str:
  """The implementation that `kivi_attention` will run for this request."""
  return triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("triton", "mosaic"), needs_triton=("triton",),
                                op="kivi_attention")


def kivi_attention(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len, *,
                   scale=None, out_dtype=None, implementation=None, **options):
  """KIVI decode attention; see `reference.kivi_attention_reference` for Args/Returns.

  Args:
    implementation: None | "reference" | "xla" | "triton" | "mosaic".
    **options: triton knobs (block_s, block_w, num_splits, target_programs, num_warps,
      num_stages, min_rows, poison, skip, fast; see `triton_kivi.kivi_attention_triton`);
      mosaic knobs (kernel: "warp" (default) or "wgmma"; warpgroups, stages, num_splits,
      window_implementation; see `mosaic_kivi_warp.kivi_attention_mosaic_warp` and
      `mosaic_kivi.kivi_attention_mosaic`).
  """
  impl = resolve_implementation(implementation)
  if implementation not in (None, impl):
    warnings.warn(f"kivi_attention: {implementation!r} unavailable here, running {impl!r}")
  if impl == "reference":
    return kivi_attention_reference(q, keys, values, k_win, v_win, q_len, w_len, scale=scale,
                                    out_dtype=out_dtype)
  check_shapes(q, keys, values, k_win, v_win, q_len, w_len)
  if impl == "xla":
    h = q.shape[-1]
    kf = dequantize_keys(keys, h).astype(jnp.bfloat16)
    vf = dequantize_values(values, h).astype(jnp.bfloat16)
    o1, l1 = decode_attention_xla(q, kf, vf, q_len, scale=scale, out_dtype=jnp.float32)
    o2, l2 = decode_attention_xla(q, k_win, v_win, w_len, scale=scale, out_dtype=jnp.float32)
    return combine_partials(jnp.stack([o1, o2], -2), jnp.stack([l1, l2], -1),
                            out_dtype or q.dtype)
  if impl == "mosaic":
    # pylint: disable=import-outside-toplevel
    from .mosaic_kivi import kivi_attention_mosaic
    from .mosaic_kivi_warp import kivi_attention_mosaic_warp
    from .mosaic_layout import to_mosaic
    # pylint: enable=import-outside-toplevel
    kernel = options.pop("kernel", "warp")
    fns = {"warp": kivi_attention_mosaic_warp, "wgmma": kivi_attention_mosaic}
    if kernel not in fns:
      raise ValueError(f"kivi_attention: kernel must be 'warp' or 'wgmma', got {kernel!r}")
    return fns[kernel](q, to_mosaic(keys, values, layout=kernel), k_win, v_win, q_len, w_len,
                       scale=scale, out_dtype=out_dtype, **options)
  from .triton_kivi import kivi_attention_triton  # pylint: disable=import-outside-toplevel
  return kivi_attention_triton(q, keys, values, k_win, v_win, q_len, w_len, scale=scale,
                               out_dtype=out_dtype, **options)
