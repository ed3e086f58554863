"""Palu method specification (frozen, hashable) and the per-model layout it resolves to.

`PaluSpec` is the typed boundary between configs/palu.py and the library: the
ConfigDict section is converted with `config_lib.to_dataclass(section, PaluSpec)`.
It carries both the offline knobs (granularity, decomposition, rank search,
Hadamard fold) and the run-time cache knobs (latent bits, recent window).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvlowrank.spec import ModelSpec

GRANULARITIES = ("m", "g", "j")          # M-LRD (per head), G-LRD (groups), J-LRD (joint)
DECOMPOSITIONS = ("whiten", "svd")       # SVD-LLM truncation-aware SVD | plain SVD (ablation)
RANK_SEARCHES = ("uniform", "fisher")
FISHER_REDUCES = ("rms", "sum_sq")
SUPPORTED_BITS = (2, 3, 4, 8)
VALUE_FOLDS = ("auto", "always")


@dataclasses.dataclass(frozen=True)
class PaluSpec:
  """Palu configuration.

  Attributes:
    granularity: "m" (M-LRD, one group per KV head), "g" (G-LRD, groups of
      `group_size` KV heads) or "j" (J-LRD, one group of all KV heads).
    group_size: KV heads per group for G-LRD; 0 = the paper's default gs-4, i.e. the
      largest divisor of n_kv_heads that is <= 4. Must divide n_kv_heads.
    decomposition: "whiten" (SVD-LLM whitened SVD, Palu §4.1) or "svd" (plain SVD).
    rank_search: "uniform" (same keep ratio everywhere) or "fisher" (Palu §3.3).
    target_ratio: fraction of the KV hidden dimension removed (Palu-30% = 0.3).
      0.0 keeps full rank (the factorisation is then exact).
    rank_multiple: every group rank is a multiple of this (Palu code: 32; 8/16
      for small models). Ranks are capped at the group's full dimension.
    fisher_reduce: "rms" (official code: mean over weights of sqrt(mean grad^2)) or
      "sum_sq" (the paper's wording: sum of the empirical Fisher, sum of mean grad^2).
    hadamard: fold a per-group orthonormal Hadamard rotation into (A, B) (Palu §3.4).
    bits: latent quantization bits (2, 3, 4 or 8), None = keep latents at cache dtype.
    window: most recent tokens whose latents are also kept unquantized (0 = none;
      the paper's accuracy runs use none, the latency code a KIVI-style residual).
    damping: relative Cholesky damping used only when XᵀX is not positive definite.
    fisher_samples: calibration windows used for the Fisher scores (0 = all of them;
      the whitening Grams always use all). Fisher needs a backward pass per window.
    implementation: decode attention: None (the fastest that fits, `cache.dispatch`),
      "reference", "mosaic" or "triton".
    value_fold: where B_v goes. "always" is the paper's Eq. 6 and the official code: B_v is
      folded into W_o, an [N·r_v, D] matrix. "auto" (the default, a deliberate departure)
      folds only where r_v <= head_dim. Where r_v > head_dim (G-LRD and J-LRD), the folded
      matrix is r_v / head_dim times W_o's bytes (3× at Llama gs-4, r_v = 384). "auto" keeps
      W_o and applies B_v per head after attention instead: an r_v × H product per query
      head, whose weights are K·r_v·H. The outputs are equal up to rounding, and decode reads
      fewer weight bytes.
  """

  granularity: str = "g"
  group_size: int = 0
  decomposition: str = "whiten"
  rank_search: str = "fisher"
  target_ratio: float = 0.5
  rank_multiple: int = 32
  fisher_reduce: str = "rms"
  hadamard: bool = True
  bits: Optional[int] = None
  window: int = 0
  damping: float = 1e-6
  fisher_samples: int = 0
  implementation: Optional[str] = None
  value_fold: str = "auto"

  def __post_init__(self):
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"PaluSpec.granularity must be one of {GRANULARITIES}, got "
                       f"{self.granularity!r}")
    if self.decomposition not in DECOMPOSITIONS:
      raise ValueError(f"PaluSpec.decomposition must be one of {DECOMPOSITIONS}, got "
                       f"{self.decomposition!r}")
    if self.rank_search not in RANK_SEARCHES:
      raise ValueError(f"PaluSpec.rank_search must be one of {RANK_SEARCHES}, got "
                       f"{self.rank_search!r}")
    if self.fisher_reduce not in FISHER_REDUCES:
      raise ValueError(f"PaluSpec.fisher_reduce must be one of {FISHER_REDUCES}, got "
                       f"{self.fisher_reduce!r}")
    if not 0.0 <= self.target_ratio < 1.0:
      raise ValueError(f"PaluSpec.target_ratio must be in [0, 1), got {self.target_ratio}")
    if self.rank_multiple < 1:
      raise ValueError(f"PaluSpec.rank_multiple must be >= 1, got {self.rank_multiple}")
    if self.group_size < 0:
      raise ValueError(f"PaluSpec.group_size must be >= 0, got {self.group_size}")
    if self.bits is not None and self.bits not in SUPPORTED_BITS:
      raise ValueError(f"PaluSpec.bits must be one of {SUPPORTED_BITS} or None, got "
                       f"{self.bits!r}")
    if self.window < 0:
      raise ValueError(f"PaluSpec.window must be >= 0, got {self.window}")
    if self.fisher_samples < 0:
      raise ValueError(f"PaluSpec.fisher_samples must be >= 0, got {self.fisher_samples}")
    if not self.damping > 0:
      raise ValueError(f"PaluSpec.damping must be > 0, got {self.damping}")
    if self.implementation not in (None, "reference", "mosaic", "triton"):
      raise ValueError("PaluSpec.implementation must be None, 'reference', 'mosaic' or "
                       f"'triton', got {self.implementation!r}")
    if self.value_fold not in VALUE_FOLDS:
      raise ValueError(f"PaluSpec.value_fold must be one of {VALUE_FOLDS}, got "
                       f"{self.value_fold!r}")

  def replace(self, **kw) -> "PaluSpec":
    return dataclasses.replace(self, **kw)


def folds_value(pspec: PaluSpec, rank_v: int, spec: ModelSpec) -> bool:
  """Whether a layer of value rank `rank_v` has B_v folded into W_o (see `value_fold`)."""
  return pspec.value_fold == "always" or rank_v <= spec.head_dim


def default_group_size(n_kv_heads: int, limit: int = 4) -> int:
  """Largest divisor of n_kv_heads that is <= limit (the paper's gs-4 default)."""
  return max(d for d in range(1, min(limit, n_kv_heads) + 1) if n_kv_heads % d == 0)


def resolve_group_size(pspec: PaluSpec, spec: ModelSpec) -> int:
  """KV heads per decomposition group for this model.

  Raises:
    ValueError: when an explicit G-LRD group_size does not divide n_kv_heads.
  """
  k = spec.n_kv_heads
  if pspec.granularity == "m":
    return 1
  if pspec.granularity == "j":
    return k
  if pspec.group_size == 0:
    return default_group_size(k)
  if k % pspec.group_size:
    raise ValueError(f"PaluSpec.group_size ({pspec.group_size}) must divide the model's "
                     f"n_kv_heads ({k})")
  return pspec.group_size


@dataclasses.dataclass(frozen=True)
class PaluLayout:
  """What the compression produced: group size and per-layer group ranks.

  Every group of a layer has the same rank (the paper's default "equal rank per
  group", official `fisher_uniform`).
  """

  group_size: int
  n_groups: int
  group_dim: int                 # gs * head_dim: output width of one group's W
  ranks_k: tuple[int, ...]       # per layer
  ranks_v: tuple[int, ...]

  def latent_dims(self) -> int:
    """Latent channels cached per token, summed over layers and K/V."""
    return self.n_groups * (sum(self.ranks_k) + sum(self.ranks_v))

  def dense_dims(self) -> int:
    return 2 * len(self.ranks_k) * self.n_groups * self.group_dim

  def compression_ratio(self) -> float:
    """Fraction of the KV hidden dimension removed (exact, from the integer ranks)."""
    return 1.0 - self.latent_dims() / self.dense_dims()


def layout_from_params(params, spec: ModelSpec) -> PaluLayout:
  """Recovers the layout from compressed parameter shapes (cache factory)."""
  lp0 = params["layers"][0]
  if "palu_bk" not in lp0:
    raise ValueError("params are not Palu-compressed (no 'palu_bk'): run "
                     "kvlowrank.methods.palu.compress first")
  n_groups, _, group_dim = lp0["palu_bk"].shape
  rk = tuple(int(lp["palu_bk"].shape[1]) for lp in params["layers"])
  rv = tuple(int(lp["palu_bv"].shape[1]) for lp in params["layers"])
  return PaluLayout(group_size=spec.n_kv_heads // n_groups, n_groups=int(n_groups),
                    group_dim=int(group_dim), ranks_k=rk, ranks_v=rv)
