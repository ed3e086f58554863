"""GEAR decode attention: KIVI planar backbone + exact window + low-rank / sparse residuals.

`gear_attention(q, keys, values, k_win, v_win, q_len, w_len, lowrank=..., sparse_k=...,
sparse_v=...)` returns (out [B, N, H], lse [B, N]) with the semantics of
`reference.gear_attention_reference` (operand layout: `operands`). Variants: GEAR (all three
groups), GEAR-L (lowrank only), outlier-only (sparse only); with none it is KIVI attention.
Implementations:
  "reference"  jnp float32, factored low-rank math, runs anywhere;
  "triton"     `triton_gear`: the Triton KIVI planar kernel with its GEAR flags on
               (dequantization, outliers and the factored low-rank terms in one pass;
               2/4-bit planar codes, chunks a multiple of the loop step).
None picks "triton" on a GPU with jax-triton, else "reference". `triton_fit` says whether the
kernel takes a problem (pure shape/dtype checks, no device needed).
GEAR-L over a backbone stored in the Mosaic warp layout (`kivi.mosaic_layout.KiviMosaic`)
runs `gear_attention_mosaic` (`mosaic_gear`: the Mosaic KIVI warp kernel with the low-rank
terms; Hopper), `mosaic_fit` saying whether it takes a problem; the cache dispatches it.
"""

from __future__ import annotations

import warnings

from ..common import triton_backend
from ..kivi.planar import KiviKeys, KiviValues
from .mosaic_plan import fit as mosaic_fit
from .mosaic_gear import gear_attention_mosaic
from .operands import GearLowRank, GearSparseKeys, GearSparseValues
from .reference import check_gear_shapes, gear_attention_reference

__all__ = ["GearLowRank", "GearSparseKeys", "GearSparseValues", "gear_attention",
           "gear_attention_mosaic", "gear_attention_reference", "mosaic_fit",
           "resolve_implementation", "triton_fit"]

IMPLEMENTATIONS = ("reference", "triton")
TRITON_OPTIONS = frozenset(("block_s", "block_w", "num_splits", "target_programs", "num_warps",
                            "num_stages", "min_rows", "poison", "return_partials", "fast",
                            "max_registers"))


def triton_fit(q_shape, keys: KiviKeys, values: KiviValues, w_cap: int, lowrank=None,
               sparse_k=None, sparse_v=None) -> str | None:
  """None when the Triton kernel takes this query shape, store, window capacity and residual
  operands with its default knobs, else why not (one line, from `triton_plan.plan`)."""
  from .triton_plan import plan  # pylint: disable=import-outside-toplevel
  if not (isinstance(keys, KiviKeys) and isinstance(values, KiviValues)):
    return "the Triton GEAR kernel reads planar KiviKeys/KiviValues only"
  try:
    b, _, h = q_shape
    check_operands_only(b, keys, h, lowrank, sparse_k, sparse_v)
    plan(tuple(q_shape), keys, values, w_cap, lowrank, sparse_k, sparse_v)
  except ValueError as e:
    return str(e)
  return None


def check_operands_only(b, keys, h, lowrank, sparse_k, sparse_v):
  """The residual operands' contract checks (ValueError naming the field)."""
  from .operands import check_operands  # pylint: disable=import-outside-toplevel
  _, kh, s, _ = keys.codes.shape
  check_operands(b, kh, s, h, lowrank, sparse_k, sparse_v)


def resolve_implementation(implementation=None) -> str:
  """The implementation `gear_attention` will run (None: "triton" where usable)."""
  return triton_backend.resolve(implementation, known=IMPLEMENTATIONS, default_gpu="triton",
                                needs_gpu=("triton",), needs_triton=("triton",),
                                op="gear_attention")


def gear_attention(q, keys, values, k_win, v_win, q_len, w_len, *, lowrank=None, sparse_k=None,
                   sparse_v=None, scale=None, out_dtype=None, implementation=None, **knobs):
  """GEAR decode attention; see `reference.gear_attention_reference` for Args/Returns.

  Args:
    implementation: None | "reference" | "triton".
    **knobs: Triton knobs (block_s, block_w, num_splits, target_programs, num_warps,
      num_stages, min_rows, poison, return_partials, fast; `triton_gear.gear_attention_triton`).
  """
  if unknown := sorted(set(knobs) - TRITON_OPTIONS):
    raise ValueError(f"gear_attention: unknown option(s) {unknown} (known: "
                     f"{sorted(TRITON_OPTIONS)})")
  if not (isinstance(keys, KiviKeys) and isinstance(values, KiviValues)):
    raise ValueError("gear_attention: keys/values must be KiviKeys and KiviValues, got "
                     f"{type(keys).__name__}, {type(values).__name__}")
  check_gear_shapes(q, keys, values, k_win, v_win, q_len, w_len, lowrank, sparse_k, sparse_v)
  impl = resolve_implementation(implementation)
  if implementation not in (None, impl):
    warnings.warn(f"gear_attention: {implementation!r} unavailable here, running {impl!r}")
  groups = dict(lowrank=lowrank, sparse_k=sparse_k, sparse_v=sparse_v)
  if impl == "reference":
    return gear_attention_reference(q, keys, values, k_win, v_win, q_len, w_len, scale=scale,
                                    out_dtype=out_dtype, **groups)
  from .triton_gear import gear_attention_triton  # pylint: disable=import-outside-toplevel
  return gear_attention_triton(q, keys, values, k_win, v_win, q_len, w_len, scale=scale,
                               out_dtype=out_dtype, **groups, **knobs)
