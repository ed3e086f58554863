"""Static, hashable model specification: the typed boundary between configs and jitted code.

Dimension alphabet used across kvlowrank (einsum strings, variable suffixes):
  B batch, T query tokens, S cache slots, N query heads, K kv heads, G = N // K,
  H head dim, R rank, D model width, F ffn width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style RoPE frequency scaling (HF `rope_type="llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Architecture of a Llama-family decoder (Llama-2/3, Mistral, Qwen2, SmolLM2, llama2.c).

  Parameters are stored in the *half-rotation* (HF) RoPE layout unless
  `rope_layout == "interleaved"` (adjacent pairs, llama2.c / GGUF native).
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  rope_layout: str = "half"  # "half" (HF rotate_half) | "interleaved" | "none"
  tie_embeddings: bool = False
  qkv_bias: bool = False
  sliding_window: Optional[int] = None
  max_seq_len: int = 2048
  bos_id: Optional[int] = None
  eos_ids: tuple[int, ...] = ()
  arch: str = "llama"

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "ffn_dim"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelSpec.{name} must be positive, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelSpec.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
          f"({self.n_kv_heads})")
    if self.rope_layout not in ("half", "interleaved", "none"):
      raise ValueError(f"ModelSpec.rope_layout must be half|interleaved|none, got "
                       f"{self.rope_layout!r}")
    if self.rope_layout != "none" and self.head_dim % 2:
      raise ValueError(f"ModelSpec.head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def group_size(self) -> int:
    """Query heads per KV head (G)."""
    return self.n_heads // self.n_kv_heads

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  def replace(self, **kw) -> "ModelSpec":
    return dataclasses.replace(self, **kw)
