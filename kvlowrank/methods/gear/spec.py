"""GearSpec: the knobs of GEAR (Kang et al. 2024) and its variants, validated.

One spec covers the paper's three variants, told apart by the sparsity s and the ranks:
  GEAR     (Q + S + L): sparsity > 0 and rank_prefill/rank_chunk > 0 (default: s = 2 %,
           r_p = 4, r_g = 2, the paper's Sec. 4 hyperparameters);
  GEAR-L   (Q + L):     sparsity = 0;
  outlier-only (Q + S, Table 8's "Outlier-A."): rank_prefill = rank_chunk = 0;
  s = 0 and r = 0 leave the backbone alone (with GEAR's streaming buffer).

Backbones (`backbone`), stored in a KIVI store (`kvlowrank_kernels.kivi.store`): the warp
layout of the Mosaic kernel where GEAR-L's kernel on it applies (`layout`), else planar:
  "kivi": keys per channel in groups of `group_size` tokens, values per token in groups of
          `group_size` channels (the paper's 2-bit backbone: g = 64, n_b = 64);
  "kcvt": the paper's coarse 4-bit backbone: one key group per channel of each compressed
          chunk (group = `buffer` tokens) and one value group per token vector of a KV
          head (group = head dim); see `backbone.py` for what differs from the paper.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvlowrank.cache import dispatch
from kvlowrank_kernels.gear import mosaic_plan
from kvlowrank_kernels.quant import packing
from kvlowrank_kernels.quant.quantizer import canonical_scale_dtype

BACKBONES = ("kivi", "kcvt")
OUTLIER_FILLS = ("mean", "zero")
LAYOUTS = ("auto", "warp", "planar")
IMPLEMENTATIONS: tuple = ("mosaic", "triton")   # the decode kernels (kvlowrank_kernels.gear)


def _int(value, field: str, lo: int, hi: Optional[int] = None) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (
      hi is not None and value > hi):
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"GearSpec.{field} must be an int {rng}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class GearSpec:
  """GEAR knobs (defaults: the paper's 2-bit GEAR over KIVI, g = 64, n_b = 64, s = 2 %,
  r_p = 4, r_g = 2, 3 power iterations).

  backbone: "kivi" | "kcvt" (module docstring);
  bits: backbone bits for keys and values (2, 3, 4, 8); 2^b - 1 levels, not the official
    code's bits**2 - 1 (`backbone.py`);
  group_size: g, the KIVI backbone's key group (tokens) and value group (channels);
    ignored by "kcvt";
  buffer: n_b, the streaming buffer: K and V stay exact until n_b tokens accumulate, then
    the chunk is compressed at once (a multiple of the KIVI group; <= 256: uint8 indices);
  sparsity: s in percent, in [0, 100): outliers per vector (keys: a channel of a chunk;
    values: a token of a KV head) = ceil(s/100 * length), the larger half taken from the
    top, the rest from the bottom (`outliers.py`);
  rank_prefill, rank_chunk: r_p (the prefill segment's factor) and r_g (each later
    chunk's); 0 disables that low-rank term; must not exceed the head dim (checked with
    the model) nor the buffer;
  iterations: power iterations (Algorithm 2; the official scripts' --loop 3);
  seed: the power iteration's random initialisation (`power.init_right`);
  outlier_fill: what replaces an outlier before quantizing: "mean" (of the vector's other
    entries: the official code's choice, which does not widen the group's range) or
    "zero" (the paper's X - S read literally); `outliers.py`;
  scale_dtype: scales and zero points (float16 as KIVI/GEAR);
  layout: the backbone store's layout: "auto" (the warp layout where the Mosaic GEAR-L
    kernel takes the configuration -- 2-bit KIVI, g = 32 or 64, head dim 128, fp16 scales, no
    outliers, ranks and buffer its plan takes, `kvlowrank_kernels.gear.mosaic_plan.
    config_fit` -- else planar), "warp" (an error where it does not apply) or "planar";
  implementation: None (fastest that fits: `cache.dispatch`), "reference", "mosaic" (the
    warp layout) or "triton" (planar).
  """

  backbone: str = "kivi"
  bits: int = 2
  group_size: int = 64
  buffer: int = 64
  sparsity: float = 2.0
  rank_prefill: int = 4
  rank_chunk: int = 2
  iterations: int = 3
  seed: int = 0
  outlier_fill: str = "mean"
  scale_dtype: str = "float16"
  layout: str = "auto"
  implementation: Optional[str] = None

  def __post_init__(self):
    if self.backbone not in BACKBONES:
      raise ValueError(f"GearSpec.backbone must be one of {BACKBONES}, got {self.backbone!r}"
                       " (Palu's latents and XQuant's rows are not GEAR backbones: "
                       "kvlowrank/methods/gear/backbone.py says why)")
    packing.check_bits(self.bits, "GearSpec.bits")
    g = _int(self.group_size, "group_size", 1)
    nb = _int(self.buffer, "buffer", 1, 256)
    if self.backbone == "kivi" and nb % g:
      raise ValueError(f"GearSpec.buffer ({nb}) must be a multiple of GearSpec.group_size "
                       f"({g}): a compressed chunk holds whole key groups")
    s = self.sparsity
    if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)) or \
        not 0 <= s < 100:
      raise ValueError(f"GearSpec.sparsity must be a percentage in [0, 100), got {s!r}")
    object.__setattr__(self, "sparsity", float(s))
    for f in ("rank_prefill", "rank_chunk"):
      r = _int(getattr(self, f), f, 0)
      if r > nb:
        raise ValueError(f"GearSpec.{f} ({r}) must not exceed GearSpec.buffer ({nb}): a "
                         "chunk of n_b tokens has rank <= n_b")
    _int(self.iterations, "iterations", 1, 8)
    _int(self.seed, "seed", 0)
    if self.outlier_fill not in OUTLIER_FILLS:
      raise ValueError(f"GearSpec.outlier_fill must be one of {OUTLIER_FILLS}, "
                       f"got {self.outlier_fill!r}")
    object.__setattr__(self, "scale_dtype",
                       canonical_scale_dtype(self.scale_dtype, "GearSpec.scale_dtype"))
    if self.layout not in LAYOUTS:
      raise ValueError(f"GearSpec.layout must be one of {LAYOUTS}, got {self.layout!r}")
    if self.implementation not in (None, dispatch.REFERENCE) + IMPLEMENTATIONS:
      raise ValueError(f"GearSpec.implementation must be None or 'reference'"
                       f"{' or one of ' + str(IMPLEMENTATIONS) if IMPLEMENTATIONS else ''}, "
                       f"got {self.implementation!r}")

  @property
  def variant(self) -> str:
    """"gear" (Q+S+L), "gear_l" (Q+L), "outlier" (Q+S) or "quant" (Q only)."""
    lr = self.rank_prefill > 0 or self.rank_chunk > 0
    sp = self.sparsity > 0
    return {(True, True): "gear", (False, True): "gear_l", (True, False): "outlier",
            (False, False): "quant"}[(sp, lr)]

  def store_layout(self, head_dim: int) -> str:
    """The backbone store's layout for a model of this head dim (ValueError naming
    GearSpec.layout when "warp" is asked for where it does not apply)."""
    if self.layout == "planar":
      return "planar"
    why = "the kcvt backbone" if self.backbone != "kivi" else mosaic_plan.config_fit(
        bits=self.bits, group=self.group_size, head_dim=head_dim,
        scale_dtype=self.scale_dtype, sparse=self.sparsity > 0,
        rank_prefill=self.rank_prefill, rank_chunk=self.rank_chunk, chunk=self.buffer)
    if self.layout == "warp" and why is not None:
      raise ValueError(f"GearSpec.layout='warp' does not hold {why}")
    return "warp" if why is None else "planar"

  def check_model(self, head_dim: int, where: str = "GearSpec") -> None:
    """Errors that need the model's head dim (ValueError naming the field)."""
    for f in ("rank_prefill", "rank_chunk"):
      r = getattr(self, f)
      if r > head_dim:
        raise ValueError(f"{where}.{f} ({r}) must not exceed the model's head_dim "
                         f"({head_dim})")
    if head_dim > 256 and self.sparsity > 0:
      raise ValueError(f"{where}.sparsity > 0 needs head_dim <= 256 (uint8 channel "
                       f"indices), got {head_dim}")
    if self.backbone == "kivi" and head_dim % self.group_size:
      raise ValueError(f"{where}.group_size ({self.group_size}) must divide the model's "
                       f"head_dim ({head_dim}): values are quantized per token in groups "
                       "of group_size channels")
    ppb = 8 if self.bits == 3 else 8 // self.bits
    if head_dim % ppb:
      raise ValueError(f"{where}.bits={self.bits}: the model's head_dim ({head_dim}) must "
                       f"be a multiple of {ppb} to pack {self.bits}-bit codes")
