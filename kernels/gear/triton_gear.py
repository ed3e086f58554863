"""GEAR decode attention in Triton: the KIVI planar kernel (`kivi.triton_kivi`, one source)
with its GEAR flags on.

`triton_kivi._quant_part` adds, per loop step of one chunk, the low-rank terms in factored
form (scores^T += a_k @ (B^T q^T), acc += B_v @ (a_v^T p^T), ranks padded to one MMA dim of
16) and the outliers, per plane, as a second A operand (selects); see its docstring.
With the flags off the same source compiles to the KIVI kernel's code. Absent groups get
1-element dummy pointers (never read). qk_ptr (HAS_LR): q already in the key MMA dtype, read
for the key planes instead of q_ptr (see `triton_kivi._quant_part`: with an in-kernel
bf16 -> fp16 cast Triton keeps the q planes in registers across the loop).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import splitk, triton_backend
from ..kivi import triton_kivi
from ..kivi.planar import KiviKeys, KiviValues
from .operands import GearLowRank, GearSparseKeys, GearSparseValues
from .triton_plan import plan

# GEAR-L's register cap. Uncapped, ptxas takes all 255 registers once the low-rank terms are
# in the loop (4 programs of 2 warps per SM); capped at 160 the loop spills a little and runs
# faster. Caps of 176-232 ran slower, and GEAR with outliers runs slower under a cap (H200
# A/B: results/gear_kernel.md, "Register cap and q in the key dtype").
LOWRANK_REGISTERS = 160


@triton.jit
def gear_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr,
                wlen_ptr, ak_ptr, av_ptr, bk_ptr, bv_ptr, bpk_ptr, bpv_ptr, npc_ptr, ski_ptr,
                skv_ptr, svi_ptr, svv_ptr, qk_ptr, S, W, NSPLIT, sm_scale, o_init, lse_init,
                o_ptr, lse_ptr, KH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr,
                H: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KCW: tl.constexpr,
                VCW: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, VB: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, KF16: tl.constexpr,
                VF16: tl.constexpr, FAST: tl.constexpr, HAS_LR: tl.constexpr,
                HAS_SK: tl.constexpr, HAS_SV: tl.constexpr, NB: tl.constexpr, RP: tl.constexpr,
                RG: tl.constexpr, RA: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                MAXNREG: tl.constexpr):  # pylint: disable=unused-argument
  triton_kivi._kivi_body(  # pylint: disable=protected-access
      q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kw_ptr, vw_ptr, qlen_ptr, wlen_ptr,
      S, W, NSPLIT, sm_scale, o_ptr, lse_ptr, KH, QPK, QP, H, KBITS, VBITS, KCW, VCW, G, GV, VB,
      BLOCK_S, BLOCK_W, KF16, VF16, FAST,
      (ak_ptr, av_ptr, bk_ptr, bv_ptr, bpk_ptr, bpv_ptr, npc_ptr, ski_ptr, skv_ptr, svi_ptr,
       svv_ptr, qk_ptr),
      (HAS_LR, HAS_SK, HAS_SV, NB, RP, RG, RA, NK, NV))


def _dummy(dtype):
  return jnp.zeros((1,), dtype)


def gear_attention_triton(q, keys: KiviKeys, values: KiviValues, k_win, v_win, q_len, w_len, *,
                          lowrank: GearLowRank | None = None,
                          sparse_k: GearSparseKeys | None = None,
                          sparse_v: GearSparseValues | None = None, scale=None, out_dtype=None,
                          block_s=None, block_w=32, num_splits=None, target_programs=None,
                          num_warps=2, num_stages=4, poison=False, return_partials=False,
                          fast=None, min_rows=1, max_registers=None):
  """Fused GEAR decode attention; same contract as `reference.gear_attention_reference`.

  Knobs as `triton_kivi.kivi_attention_triton` (block_s must divide the chunk; default 64);
  max_registers: `triton_backend.launch`'s register cap (0: none; None: `LOWRANK_REGISTERS` for
  GEAR-L, low rank without outliers, else none).
  """
  if max_registers is None:
    max_registers = (LOWRANK_REGISTERS if lowrank is not None and sparse_k is None
                     and sparse_v is None else 0)
  h = q.shape[-1]
  scale = np.float32(h ** -0.5 if scale is None else scale)
  # The KIVI wrapper's scale-dtype handling (16-bit raw, else bf16).
  ks = triton_kivi._scale_dtype(keys.scale, "keys.scale")  # pylint: disable=protected-access
  vs = triton_kivi._scale_dtype(values.scale, "values.scale")  # pylint: disable=protected-access
  keys = KiviKeys(codes=keys.codes, scale=ks, zero=keys.zero.astype(ks.dtype), bits=keys.bits,
                  group=keys.group)
  values = KiviValues(codes=values.codes, scale=vs, zero=values.zero.astype(vs.dtype),
                      bits=values.bits, group=values.group)
  p = plan(q.shape, keys, values, k_win.shape[1], lowrank, sparse_k, sparse_v, block_s=block_s,
           block_w=block_w, num_splits=num_splits,
           target_programs=target_programs or 3 * splitk.TARGET_PROGRAMS, fast=fast,
           min_rows=min_rows)
  f16, u8 = jnp.float16, jnp.uint8
  if lowrank is not None:
    lr = [x.astype(f16) for x in (lowrank.a_k, lowrank.a_v, lowrank.b_k, lowrank.b_v,
                                  lowrank.bp_k, lowrank.bp_v)] + [
                                      lowrank.n_pchunks.astype(jnp.int32)]
  else:
    lr = [_dummy(f16)] * 6 + [_dummy(jnp.int32)]
  # q in the key MMA dtype for the key planes (the same values the kernel's RNE cast gives).
  qk = q.astype(ks.dtype) if lowrank is not None else _dummy(ks.dtype)
  sk = ([sparse_k.idx.astype(u8), sparse_k.val.astype(f16)] if sparse_k is not None
        else [_dummy(u8), _dummy(f16)])
  sv = ([sparse_v.idx.astype(u8), sparse_v.val.astype(f16)] if sparse_v is not None
        else [_dummy(u8), _dummy(f16)])
  return triton_backend.launch_split_k(
      gear_kernel,
      q, keys.codes, keys.scale, keys.zero, values.codes,
      triton_kivi._value_words(values.scale),  # pylint: disable=protected-access
      triton_kivi._value_words(values.zero),  # pylint: disable=protected-access
      k_win.astype(jnp.bfloat16), v_win.astype(jnp.bfloat16), q_len.astype(jnp.int32),
      w_len.astype(jnp.int32), *lr, *sk, *sv, qk, int(keys.codes.shape[2]), int(k_win.shape[1]),
      p["num_splits"], scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, out_dtype=out_dtype or q.dtype, return_partials=return_partials,
      max_registers=max_registers, **p["constexprs"])
