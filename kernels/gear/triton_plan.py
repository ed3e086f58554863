"""Launch plan of the Triton GEAR kernel (`triton_gear`): the KIVI kernel's plan plus GEAR's
checks and flags. Triton-free, so that `gear.triton_fit` answers on any machine."""

from __future__ import annotations

from ..kivi.planar import KiviKeys, KiviValues
from ..kivi.triton_plan import plan as kivi_plan
from .operands import chunk_tokens

MAX_RANK = 16  # the kernel pads the ranks to one MMA dim of 16


def plan(q_shape, keys: KiviKeys, values: KiviValues, w_cap: int, lowrank=None, sparse_k=None,
         sparse_v=None, *, block_s=None, **knobs):
  """`kivi.triton_plan.plan` plus constexprs HAS_LR, HAS_SK, HAS_SV, NB, RP, RG, RA, NK, NV.

  Args:
    q_shape, keys, values, w_cap, knobs: as `kivi.triton_plan.plan`.
    lowrank, sparse_k, sparse_v: the `operands` groups (None: absent).
    block_s: tokens per loop step; must divide the chunk NB (a step lies in one chunk);
      default 64 if it divides NB, else 32.
  Raises:
    ValueError (one line) when the kernel does not take these operands.
  """
  s = keys.codes.shape[2]
  nb = chunk_tokens(s, lowrank, sparse_k)
  if block_s is None:
    block_s = 64 if nb is None or nb % 64 == 0 else 32
  if nb is not None and (nb % block_s or s % nb):
    raise ValueError(f"triton gear attention: the chunk ({nb} tokens) must be a multiple of "
                     f"block_s ({block_s}) and divide the capacity ({s})")
  p = kivi_plan(q_shape, keys, values, w_cap, block_s=block_s, **knobs)
  rp = rg = ra = 1
  if lowrank is not None:
    rp, rg, ra = lowrank.prefill_rank, lowrank.chunk_rank, lowrank.a_k.shape[-1]
    if max(rp, rg) > MAX_RANK:
      raise ValueError(f"triton gear attention: ranks must be <= {MAX_RANK}, got RP={rp}, "
                       f"RG={rg}")
  p["constexprs"].update(
      HAS_LR=int(lowrank is not None), HAS_SK=int(sparse_k is not None),
      HAS_SV=int(sparse_v is not None), NB=nb or 1, RP=rp, RG=rg, RA=ra,
      NK=sparse_k.slots if sparse_k is not None else 1,
      NV=sparse_v.slots if sparse_v is not None else 1)
  return p
