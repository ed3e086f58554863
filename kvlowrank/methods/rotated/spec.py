"""FDC / ZACK method specification (frozen, hashable) and the per-model layout it resolves to.

One spec serves both recipes (registered as the methods `fdc` and `zack`, which differ only
in how the value side is calibrated; the recipe is bound by the registration, not a field).
It carries the offline knobs (rate or target, width allocation and rounding, calibration
tokens, FDC's value decomposition) and the run-time cache knobs (KIVI-style quantization of
the stored K' and V').
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

ALLOCATIONS = ("adaptive", "uniform")
CALIBRATIONS = ("random", "data")
V_DECOMPOSITIONS = ("svd", "whiten")
SUPPORTED_BITS = (2, 4, 8)
RECIPES = ("fdc", "zack")


@dataclasses.dataclass(frozen=True)
class RotatedSpec:
  """FDC / ZACK configuration.

  Attributes:
    rate: the global singular-value removal rate r in [0, 1) (FDC Eq. 1 / ZACK Eq. 6): each
      KV head keeps the fewest leading rotated dims whose removed singular-value MASS (sums
      of singular values, not squares) is <= r, for keys and values alike. 0 keeps every
      dim with a non-zero singular value (exact). Ignored when `target_ratio` is set.
    target_ratio: None, or the fraction of the KV hidden dimension to remove in [0, 1):
      "adaptive" takes the smallest r whose widths remove at least this fraction (so two
      allocations compare at equal bytes), "uniform" gives every head the same width,
      ceil((1 - target_ratio) H) rounded up to `width_multiple`.
    allocation: "adaptive" (Eq. 1 widths per head and layer) or "uniform" (the papers'
      /AC ablation: one width everywhere; needs `target_ratio`).
    width_multiple: kept widths are rounded UP to a multiple of this (16: the contract of
      the ragged decode kernel, tensor-core tiles) with real rotated components.
      Deliberate departure from both papers, which zero-pad to multiples of 16: the extra
      components cost the same bytes and only improve accuracy. Must be a multiple of 8,
      and of `group_size` when `bits` is set.
    calibration: tokens for the Q-K rotation (and ZACK's value rotation): "random"
      (uniformly random vocabulary ids, FDC §5.1: >= 8K tokens) or "data" (the config's
      calib windows, WikiText-2 validation). Both use positions 0..calib.seq_len-1, which
      should span the evaluated context.
    v_decomposition: FDC's value factorisation through Palu's code: "whiten" (Palu's
      whitened SVD on the calib windows' XᵀX, whatever `calibration` says: FDC says V
      "follows Palu") or "svd" (plain SVD of W_V, FDC's literal text; data-free). Default
      "whiten", a deliberate choice: on SmolLM2 plain SVD of W_V at ~50% of the value dims
      gave a perplexity about a thousand times the whitened one's (results/rotated.md).
      Ignored by ZACK.
    bits: None (K', V' at the cache dtype) or 2/4/8: KIVI-style quantization of the stored
      K' (per channel, groups of `group_size` tokens) and V' (per token, groups of
      `group_size` channels) through the KIVI cache code, with a `residual`-token exact
      window (FDC §6.4 / ZACK §6.2 stack KVQuant-4 the same way).
    group_size, residual: the quantizer's group and exact window (KIVI's G and R); with
      `bits` set, G must divide width_multiple and the model's head_dim (a V' group never
      straddles two heads).
    implementation: decode attention: None (the fastest that fits), "reference" or "triton"
      (the ragged-head kernel, `kvlowrank_kernels.rotated`).
  """

  rate: float = 0.0
  target_ratio: Optional[float] = None
  allocation: str = "adaptive"
  width_multiple: int = 16
  calibration: str = "random"
  v_decomposition: str = "whiten"
  bits: Optional[int] = None
  group_size: int = 16
  residual: int = 32
  implementation: Optional[str] = None

  def __post_init__(self):
    if not 0.0 <= self.rate < 1.0:
      raise ValueError(f"RotatedSpec.rate must be in [0, 1), got {self.rate}")
    if self.target_ratio is not None and not 0.0 <= self.target_ratio < 1.0:
      raise ValueError(f"RotatedSpec.target_ratio must be None or in [0, 1), got "
                       f"{self.target_ratio}")
    if self.allocation not in ALLOCATIONS:
      raise ValueError(f"RotatedSpec.allocation must be one of {ALLOCATIONS}, got "
                       f"{self.allocation!r}")
    if self.allocation == "uniform" and self.target_ratio is None:
      raise ValueError("RotatedSpec.target_ratio must be set for allocation='uniform' (the "
                       "uniform width is (1 - target_ratio) head dims)")
    m = self.width_multiple
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m <= 0 or m % 8:
      raise ValueError(f"RotatedSpec.width_multiple must be a positive multiple of 8, got "
                       f"{m!r}")
    if self.calibration not in CALIBRATIONS:
      raise ValueError(f"RotatedSpec.calibration must be one of {CALIBRATIONS}, got "
                       f"{self.calibration!r}")
    if self.v_decomposition not in V_DECOMPOSITIONS:
      raise ValueError(f"RotatedSpec.v_decomposition must be one of {V_DECOMPOSITIONS}, got "
                       f"{self.v_decomposition!r}")
    if self.bits is not None and self.bits not in SUPPORTED_BITS:
      raise ValueError(f"RotatedSpec.bits must be None or one of {SUPPORTED_BITS}, got "
                       f"{self.bits!r}")
    g = self.group_size
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0:
      raise ValueError(f"RotatedSpec.group_size must be a positive int, got {g!r}")
    if self.bits is not None and m % g:
      # V' is quantized per token in groups of g channels of the packed row [Σv]: a group
      # must never straddle two heads, so every kept width (a multiple of width_multiple,
      # or head_dim: `method._validate`) must be a multiple of g. Checked here, before any
      # calibration.
      raise ValueError(f"RotatedSpec.width_multiple ({m}) must be a multiple of "
                       f"RotatedSpec.group_size ({g}) when bits is set: quantization groups "
                       f"of V' channels would straddle two heads")
    if self.residual < 0 or self.residual % g:
      raise ValueError(f"RotatedSpec.residual must be a multiple of group_size ({g}) and "
                       f">= 0, got {self.residual}")
    if self.implementation not in (None, "reference", "triton"):
      raise ValueError(f"RotatedSpec.implementation must be None, 'reference' or 'triton', "
                       f"got {self.implementation!r}")

  def replace(self, **kw) -> "RotatedSpec":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class RotatedLayout:
  """Kept widths per layer and KV head (what the compression produced)."""

  head_dim: int
  k_widths: tuple[tuple[int, ...], ...]   # [L][K]
  v_widths: tuple[tuple[int, ...], ...]

  def kept_dims(self) -> int:
    return int(sum(map(sum, self.k_widths)) + sum(map(sum, self.v_widths)))

  def dense_dims(self) -> int:
    return 2 * self.head_dim * sum(len(w) for w in self.k_widths)

  def compression_ratio(self) -> float:
    """Fraction of the KV hidden dimension removed (exact, from the integer widths)."""
    return 1.0 - self.kept_dims() / self.dense_dims()


def layout_from_params(params, head_dim: int) -> RotatedLayout:
  """The widths stored in rotated params (`rot_kw`, `rot_vw` int32 [K] per layer)."""
  lp0 = params["layers"][0]
  if "rot_kw" not in lp0:
    raise ValueError("params are not FDC/ZACK-compressed (no 'rot_kw'): calibrate with "
                     "method fdc or zack first (kvlowrank.methods.rotated.compress)")
  as_tuple = lambda a: tuple(int(x) for x in np.asarray(a))
  return RotatedLayout(head_dim=head_dim,
                       k_widths=tuple(as_tuple(lp["rot_kw"]) for lp in params["layers"]),
                       v_widths=tuple(as_tuple(lp["rot_vw"]) for lp in params["layers"]))
