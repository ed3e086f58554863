"""KIVI quantized decode attention: per-channel keys, per-token values, exact window.

`kivi_attention(q, keys, values, k_win, v_win, q_len, w_len, ...)` returns
(out [B, N, H], lse) with the semantics of `reference.kivi_attention_reference`. The
quantized prefix is either planar `KiviKeys`/`KiviValues` (`planar`: 2/3/4/8-bit) or a
`KiviMosaic` cache (`mosaic_layout`: 2-bit, groups of 32, H = 128) passed as `keys` with
`values=None`. Implementations:
  "reference"  jnp float32, runs anywhere (prefill uses it or dense attention on the
               unquantized prompt);
  "xla"        dequantize to bf16 + XLA dense attention per segment;
  "triton"     `triton_kivi`, dequantization fused; planar 2/4-bit codes only (it cannot
               read a KiviMosaic cache);
  "mosaic"     `mosaic_kivi_warp` (Pallas Mosaic GPU, Hopper; warp-level mma.sync) on a
               KiviMosaic cache as stored; planar inputs are first relaid out with
               `mosaic_layout.to_mosaic`, a pass over the cache per call (for tests and
               benchmarks: a cache meant for this kernel is stored in its layout).
"reference" and "xla" read a KiviMosaic cache through `mosaic_layout.from_mosaic` (its
lossless inverse relayout), so they give the planar cache's numbers. The Mosaic kernel's
epilogue (the exact window's attention and the merge with its split partials) runs as one
Triton launch where jax-triton runs (`triton_window`; "xla" beside it is the reference). A KIVI
cache's decode-step update is one Triton launch too (`triton_update` on a warp-layout store,
`triton_update_planar` on a planar one at 2/4/8 bits; reference: `KiviCache._decode_update`);
these import Triton, so they are imported where used.
None picks "mosaic" for a KiviMosaic cache on a Hopper GPU, "triton" for planar inputs on a
GPU with jax-triton, else "reference". `mosaic_fit` / `triton_fit` say whether the two
kernels take a query shape and cache (pure shape/dtype checks, no device needed).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from ..common import platform, triton_backend
from ..common.splitk import combine_partials
from ..dense.xla import decode_attention_xla
from .mosaic_layout import KiviMosaic, check_mosaic, check_planar, from_mosaic, to_mosaic
from .planar import (KiviKeys, KiviValues, dequantize_keys, dequantize_values,  # noqa: F401
                     quantize_keys, quantize_values)
from .reference import check_shapes, kivi_attention_reference

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")
# Kernel knobs `kivi_attention` passes on (`triton_kivi.kivi_attention_triton`,
# `mosaic_kivi_warp.kivi_attention_mosaic_warp`).
TRITON_OPTIONS = frozenset(("block_s", "block_w", "num_splits", "target_programs", "num_warps",
                            "num_stages", "min_rows", "poison", "return_partials", "fast"))
MOSAIC_OPTIONS = frozenset(("warpgroups", "stages", "num_splits", "window_implementation",
                            "return_partials"))


def mosaic_fit(q_shape, cache) -> str | None:
  """None when the Mosaic warp kernel takes this query shape and cache with its default
  knobs, else why not (one line, from the layout's checks and the kernel's `plan`).

  Args:
    q_shape: (B, N, H) of the decode query.
    cache: a KiviMosaic, or a (KiviKeys, KiviValues) pair (which the dispatcher relays out).
  """
  from .mosaic_kivi_warp import plan  # pylint: disable=import-outside-toplevel
  try:
    if isinstance(cache, KiviMosaic):
      check_mosaic(cache)
      cache_shape, group = cache.kc.shape, cache.group
    else:
      keys, values = cache
      check_planar(keys, values)
      b, kh, s = keys.codes.shape[:3]
      cache_shape, group = (b, kh, s // 128), keys.group
    plan(tuple(q_shape), cache_shape, kgroup=group)
  except ValueError as e:
    return str(e)
  return None


def triton_fit(q_shape, keys: KiviKeys, values: KiviValues, w_cap: int) -> str | None:
  """None when the Triton kernel takes this query shape, planar keys/values and window
  capacity with its default knobs, else why not (one line, from `triton_plan.plan`)."""
  from .triton_plan import plan  # pylint: disable=import-outside-toplevel
  if isinstance(keys, KiviMosaic):
    return "the Triton kernel cannot read a KiviMosaic cache (planar KiviKeys/KiviValues only)"
  try:
    plan(tuple(q_shape), keys, values, w_cap)
  except ValueError as e:
    return str(e)
  return None


def resolve_implementation(implementation=None, *, mosaic_cache: bool = False) -> str:
  """The implementation that `kivi_attention` will run for this request.

  Args:
    implementation: None or one of IMPLEMENTATIONS.
    mosaic_cache: whether the cache is a KiviMosaic (then None means "mosaic" on a Hopper
      GPU, else "reference").
  """
  if implementation is None and mosaic_cache:
    implementation = "mosaic" if platform.hopper_available() else "reference"
  return triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("triton", "mosaic"), needs_triton=("triton",),
                                op="kivi_attention")


def kivi_attention(q, keys, values=None, k_win=None, v_win=None, q_len=None, w_len=None, *,
                   scale=None, out_dtype=None, implementation=None, **options):
  """KIVI decode attention; see `reference.kivi_attention_reference` for Args/Returns.

  Args:
    keys, values: planar KiviKeys and KiviValues, or a KiviMosaic cache and None (or
      omitted, with the rest passed by keyword).
    k_win, v_win, q_len, w_len: required (defaults only so that `values` may be omitted).
    implementation: None | "reference" | "xla" | "triton" | "mosaic".
    **options: triton knobs (block_s, block_w, num_splits, target_programs, num_warps,
      num_stages, min_rows, poison, return_partials, fast; see
      `triton_kivi.kivi_attention_triton`); mosaic knobs (warpgroups, stages, num_splits,
      window_implementation, return_partials; see
      `mosaic_kivi_warp.kivi_attention_mosaic_warp`).
  """
  missing = [n for n, x in (("k_win", k_win), ("v_win", v_win), ("q_len", q_len),
                            ("w_len", w_len)) if x is None]
  if missing:
    raise ValueError(f"kivi_attention: missing {', '.join(missing)}")
  mosaic_cache = isinstance(keys, KiviMosaic)
  if mosaic_cache and values is not None:
    raise ValueError("kivi_attention: with a KiviMosaic cache as keys, values must be None "
                     f"(the cache holds both), got {type(values).__name__}")
  if not mosaic_cache and not (isinstance(keys, KiviKeys) and isinstance(values, KiviValues)):
    raise ValueError("kivi_attention: keys/values must be KiviKeys and KiviValues, or a "
                     f"KiviMosaic and None; got {type(keys).__name__}, "
                     f"{type(values).__name__}")
  allowed = {"triton": TRITON_OPTIONS, "mosaic": MOSAIC_OPTIONS}.get(
      implementation, TRITON_OPTIONS | MOSAIC_OPTIONS)
  if unknown := sorted(set(options) - allowed):
    raise ValueError(f"kivi_attention: unknown option(s) {unknown} for implementation="
                     f"{implementation!r} (known: {sorted(allowed)})")
  if mosaic_cache and implementation == "triton":
    raise ValueError("kivi_attention: implementation 'triton' cannot read a KiviMosaic cache "
                     "(use 'mosaic', or planar KiviKeys/KiviValues)")
  impl = resolve_implementation(implementation, mosaic_cache=mosaic_cache)
  if implementation not in (None, impl):
    warnings.warn(f"kivi_attention: {implementation!r} unavailable here, running {impl!r}")
  if impl == "mosaic":
    # pylint: disable-next=import-outside-toplevel
    from .mosaic_kivi_warp import kivi_attention_mosaic_warp
    cache = keys if mosaic_cache else to_mosaic(keys, values)
    return kivi_attention_mosaic_warp(q, cache, k_win, v_win, q_len, w_len, scale=scale,
                                      out_dtype=out_dtype, **options)
  if mosaic_cache:
    keys, values = from_mosaic(keys)
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
  from .triton_kivi import kivi_attention_triton  # pylint: disable=import-outside-toplevel
  return kivi_attention_triton(q, keys, values, k_win, v_win, q_len, w_len, scale=scale,
                               out_dtype=out_dtype, **options)
