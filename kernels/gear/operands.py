"""GEAR's residual operands on top of a KIVI planar store (the storage contract).

GEAR (Kang et al. 2024) stores K~ = D^ + S + L per layer: D^ the KIVI planar codes
(`kivi.planar`, with the exact window), and per layer:
  GearLowRank      L = A B^T per segment: left factors per token, right factors per chunk
                   (`a_k`/`a_v` [B, K, S, RA], `b_k`/`b_v` [B, K, C, H, RG] for the
                   streaming chunks of NB = S / C tokens, `bp_k`/`bp_v` [B, K, H, RP] for the
                   prefill segment, `n_pchunks` [B]: the leading chunks the prefill factor
                   covers). Token t of chunk c = t // NB uses a[t, :RP] @ bp^T if
                   c < n_pchunks, else a[t, :RG] @ b[c]^T (a's other columns are ignored).
  GearSparseKeys   key outliers per (chunk, channel): `idx` uint8 [B, K, C, NK, H] (the
                   token's slot in its chunk), `val` float16 [B, K, C, NK, H]; key t gets
                   + val[c, j, ch] at channel ch where idx[c, j, ch] == t - c * NB.
  GearSparseValues value outliers per token: `idx` uint8 [B, K, S, NV] (channel), `val`
                   float16 [B, K, S, NV]; value t gets + val[t, j] at channel idx[t, j].
A vector's slots are distinct (a key channel's tokens in its chunk, a value token's channels:
the kernel selects, it does not add, where slots meet); a slot of value 0 adds nothing.
GEAR = all three, GEAR-L = low rank only, outlier-only = the sparse groups only.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GearLowRank:
  """Low-rank residual factors (see module docstring)."""

  a_k: jax.Array
  a_v: jax.Array
  b_k: jax.Array
  b_v: jax.Array
  bp_k: jax.Array
  bp_v: jax.Array
  n_pchunks: jax.Array

  @property
  def prefill_rank(self) -> int:
    """RP."""
    return self.bp_k.shape[-1]

  @property
  def chunk_rank(self) -> int:
    """RG."""
    return self.b_k.shape[-1]

  @property
  def n_chunks(self) -> int:
    """C."""
    return self.b_k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GearSparseKeys:
  """Key outliers per (chunk, channel) (see module docstring)."""

  idx: jax.Array
  val: jax.Array

  @property
  def slots(self) -> int:
    """NK."""
    return self.idx.shape[3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GearSparseValues:
  """Value outliers per token (see module docstring)."""

  idx: jax.Array
  val: jax.Array

  @property
  def slots(self) -> int:
    """NV."""
    return self.idx.shape[3]


def chunk_tokens(s: int, lowrank, sparse_k) -> int | None:
  """NB = S / C from whichever chunked operand is present (None if neither is)."""
  if lowrank is not None:
    return s // max(lowrank.n_chunks, 1)
  if sparse_k is not None:
    return s // max(sparse_k.idx.shape[2], 1)
  return None


def check_operands(b: int, kh: int, s: int, h: int, lowrank, sparse_k, sparse_v) -> None:
  """ValueError naming the bad field (shapes and dtypes of the contract)."""
  nb = chunk_tokens(s, lowrank, sparse_k)
  if nb is not None:
    c = s // nb
    if c < 1 or c * nb != s:
      raise ValueError(f"gear: the cache capacity ({s}) must be a whole number of chunks "
                       f"(lowrank.b_k / sparse_k.idx have {c} chunks)")
  if lowrank is not None:
    lr = lowrank
    rp, rg = lr.prefill_rank, lr.chunk_rank
    ra = lr.a_k.shape[-1]
    if rp < 1 or rg < 1:
      raise ValueError(f"gear: lowrank ranks must be >= 1, got RP={rp}, RG={rg}")
    if ra != max(rp, rg):
      raise ValueError(f"gear: lowrank.a_k has {ra} columns, expected max(RP={rp}, RG={rg})")
    want = dict(a_k=(b, kh, s, ra), a_v=(b, kh, s, ra), b_k=(b, kh, c, h, rg),
                b_v=(b, kh, c, h, rg), bp_k=(b, kh, h, rp), bp_v=(b, kh, h, rp), n_pchunks=(b,))
    for name, shape in want.items():
      got = getattr(lr, name).shape
      if tuple(got) != shape:
        raise ValueError(f"gear: lowrank.{name} must be {shape}, got {tuple(got)}")
    if ra > 16:
      raise ValueError(f"gear: lowrank ranks must be <= 16, got {ra}")
  if sparse_k is not None:
    nk = sparse_k.idx.shape[3] if sparse_k.idx.ndim == 5 else -1
    shape = (b, kh, c, nk, h)
    for name in ("idx", "val"):
      if tuple(getattr(sparse_k, name).shape) != shape:
        raise ValueError(f"gear: sparse_k.{name} must be [B, K, C, NK, H] = {shape}, got "
                         f"{tuple(getattr(sparse_k, name).shape)}")
  if sparse_v is not None:
    nv = sparse_v.idx.shape[3] if sparse_v.idx.ndim == 4 else -1
    shape = (b, kh, s, nv)
    for name in ("idx", "val"):
      if tuple(getattr(sparse_v, name).shape) != shape:
        raise ValueError(f"gear: sparse_v.{name} must be [B, K, S, NV] = {shape}, got "
                         f"{tuple(getattr(sparse_v, name).shape)}")
  for what, grp in (("sparse_k", sparse_k), ("sparse_v", sparse_v)):
    if grp is not None and str(grp.idx.dtype) not in ("uint8", "int32"):
      raise ValueError(f"gear: {what}.idx must be uint8 (or int32), got {grp.idx.dtype}")
