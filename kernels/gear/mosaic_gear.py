"""GEAR-L decode attention on the Mosaic GPU warp KIVI kernel (`kivi.mosaic_kivi_warp`).

The backbone D^ is KIVI-2bit in the warp kernel's layout (`kivi.mosaic_layout`, read as the
KIVI kernel reads it); this module adds GEAR's low-rank residual L = A B^T (`operands`) as
an extension of that kernel (`mosaic_kivi_warp.launch`'s `ext`), never forming L:

  keys    s[t, h] += a_k[t] . (q_h B(t))   per warp and 16-token sub-tile, one m16n8k16
          with A = the tokens' a_k rows (rank padded to 16) and B = q B as a B fragment:
          q B_p (the prefill factor) is computed once per call in the wrapper (rounded to
          fp16) and read once per item; a warp whose 32 tokens lie in a streaming chunk c
          computes q B_c itself (8 m16n8k16 over the channels, `movmatrix` to a B fragment).
  values  o[h] += B(t) (sum_t p_t a_v[t]): u = a_v^T p, two m16n8k16 per warp and block with
          p's B fragments (those of the value products). Prefill tokens accumulate u_p
          across the loop, rescaled with the online softmax like o; the merge adds B_v,p u_p
          to each output row (thread tau: channel tau). A warp in a streaming chunk applies
          its chunk's B_v,c at once: 8 more m16n8k16 into o^T.
Operands: a_k / a_v [B, K, S, RA] fp16 (4 rows of a 128-token block = RA/2 rows of 256), read
through the ring with each block; b_k / b_v [B, K, C, H, r_g] of the block's chunks, copied
by the producer only for blocks that hold streaming tokens (else it arrives on their
barriers); q B_p [B K, NP, 8] and B_v,p [B K, 128, 8] (rank zero-padded to 8) once per item,
with its q (persistent CTAs: into the item's q slot).
Token t (of a block starting at t0) uses the prefill factor iff t < n_pchunks * chunk; a warp
holds 32 tokens of one chunk (chunk a multiple of 32), so the choice is per warp (`scf.if`).
Choices: the MMAs run in fp16 (GEAR's factors are fp16; the backbone's scales must be fp16
too); q B is rounded to fp16 (as the Triton kernel rounds q to the key dtype); a's columns
beyond a segment's rank meet zero rows of B (the contract's zeros are not relied on: the
B operands are zero-padded and the lanes past the rank masked).
Restrictions (`mosaic_plan.fit`): the warp layout's (2-bit, groups of 32 or 64, H = 128, QPK <= 16),
fp16 scales, RA and r_g in {2, 4, 8}, r_p <= 8, chunks of 32, 64 or 128 tokens; no outliers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ..kivi import mosaic_kivi_warp as mkw
from ..kivi import mosaic_ring as ring
from ..kivi import mosaic_warp_step as ws
from ..kivi.mosaic_dequant import extract
from ..kivi.mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic
from ..kivi.mosaic_ptx import const_i32
from .mosaic_plan import DTYPE, LR, NAME, LowRankPlan, fit, plan
from .mosaic_step import StepHook, as_index, load_word, mlir_modules
from .operands import GearLowRank


class _Bound:
  """The extension bound to one item (a split of KV head `head` of sequence `b`; pair `pid`)
  that `mosaic_kivi_warp._kernel` calls (its `launch` docstring); the item's constants q B_p
  and B_v,p live in constant slot `cslot` (its q slot)."""

  refs_per_block, n_state, n_const = 4, 1, 1

  def __init__(self, lp, p, dtype, *, b, head, pid, cslot, inputs, smem, bars, slot_bar):
    del dtype
    self.lp, self.p, self.b, self.head, self.pid = lp, p, b, head, pid
    (self.qbp_g, self.bpv_g, self.pfx_g, self.ak_g, self.av_g, self.bk_g, self.bv_g) = inputs
    (qbp_s, bpv_s, self.ak_s, self.av_s, self.bk_s, self.bv_s, self.wu_s) = smem
    self.qbp_s, self.bpv_s = qbp_s.at[cslot], bpv_s.at[cslot]
    self.const_bar = bars[0].at[cslot]
    # the block's factors arrive on its ring slot's barrier (`_Ext.ring_arrivals`)
    self.slot_bar = slot_bar
    self.pfx = self.pfx_g[b]

  # producer
  def copy_const(self):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    plgpu.copy_gmem_to_smem(self.qbp_g.at[self.pid], self.qbp_s, self.const_bar)
    plgpu.copy_gmem_to_smem(self.bpv_g.at[self.pid], self.bpv_s, self.const_bar)

  def copy_block(self, blk, slot):
    import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    b, head, lp = self.b, self.head, self.lp
    for src, dst in ((self.ak_g, self.ak_s), (self.av_g, self.av_s)):
      plgpu.copy_gmem_to_smem(src.at[b, head, blk], dst.at[slot], self.slot_bar.at[slot])
    rows = lp.chunks_per_block * lp.b_rows
    row0 = lax.div(blk * BLOCK, lp.chunk) * lp.b_rows  # no `//` in a warp's context
    streams = (blk + 1) * BLOCK > self.pfx

    @pl.when(streams)
    def _():
      for src, dst in ((self.bk_g, self.bk_s), (self.bv_g, self.bv_s)):
        plgpu.copy_gmem_to_smem(src.at[b, head, pl.ds(row0, rows)], dst.at[slot],
                                self.slot_bar.at[slot])

    @pl.when((blk + 1) * BLOCK <= self.pfx)  # not `streams`: no `not` in a warp's context
    def _():  # one arrival for each of the two copies skipped
      plgpu.barrier_arrive(self.slot_bar.at[slot])
      plgpu.barrier_arrive(self.slot_bar.at[slot])

  # compute warpgroups
  def load_const(self):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    plgpu.barrier_wait(self.const_bar)
    nt = self.p["np"] // 8
    ne = -(-nt // 4) * 4  # a WGMMA-layout array holds a multiple of 4 scalars per thread
    out_t = plgpu.ShapeDtypeStruct((64, 2 * ne), jnp.int32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out_t)
    def load(_, ref):
      ir, arith, _, _, _ = mlir_modules()
      _, _, r, q = ws.lane_parts()
      col = arith.muli(q, const_i32(2))
      vals = [load_word(ref, arith.addi(arith.muli(arith.addi(r, const_i32(8 * n)),
                                               const_i32(LR)), col)) for n in range(nt)]
      vals += [const_i32(0)] * (ne - nt)
      return ws.as_array(vals, ir.IntegerType.get_signless(32), True)
    return (load(self.qbp_s),)

  def init_state(self):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    nt = self.p["np"] // 8
    out_t = plgpu.ShapeDtypeStruct((64, 8 * nt), jnp.float32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(return_type=out_t)
    def init(_):
      ir, _, _, _, _ = mlir_modules()
      return ws.as_array([ws.f32c(0.0)] * (4 * nt), ir.F32Type.get(), None)
    return (init(),)

  def state_types(self, sds):
    return (sds(8 * (self.p["np"] // 8), jnp.float32),)

  def arrived(self, slot):
    return (self.ak_s.at[slot], self.av_s.at[slot], self.bk_s.at[slot], self.bv_s.at[slot])

  def plain_blocks(self, start, n_blocks):
    """The split's leading blocks whose tokens all lie under the prefill factor."""
    return jnp.clip((self.pfx - start) // BLOCK, 0, n_blocks)

  def block_value(self, tok0, layout):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    return plgpu.layout_cast(jnp.full((64, 8), self.pfx - tok0, jnp.int32), layout)

  def step_hook(self, refs, state, const, extras, *, nt, general):
    return StepHook(self.lp, refs, state[0], const[0], extras, nt, general)

  def publish(self, state):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    nt = self.p["np"] // 8

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def pub(_, u_arr, wu):
      # pylint: disable-next=import-outside-toplevel
      from jax.experimental.mosaic.gpu import utils as mgpu_utils
      ir, arith, _, _, vector = mlir_modules()
      f32 = ir.F32Type.get()
      _, _, r, q = ws.lane_parts()
      gw = as_index(arith.divui(mgpu_utils.thread_idx(), const_i32(32)))
      u = ws.scalars(u_arr)
      for n in range(nt):
        col = as_index(arith.addi(arith.muli(q, const_i32(2)), const_i32(8 * n)))
        vector.store(vector.from_elements(ir.VectorType.get([2], f32), u[4 * n:4 * n + 2]),
                     wu, [gw, as_index(r), col])
    pub(state[0], self.wu_s)

  def merge_refs(self):
    return (self.wu_s, self.bpv_s)

  def merge_hook(self, refs, n_warps, np_):
    wu, bpv = refs
    rp = self.lp.rp

    def extra(weights):
      ir, arith, _, _, vector = mlir_modules()
      f32 = ir.F32Type.get()
      tid, _, _, _ = ws.lane_parts()
      row = as_index(tid)
      ci = lambda v: arith.constant(ir.IndexType.get(), v)
      bp = vector.load(ir.VectorType.get([LR], ir.F16Type.get()), bpv, [row, ci(0)])
      coef = [arith.extf(f32, extract(bp, i)) for i in range(rp)]
      add = [ws.f32c(0.0)] * np_
      vec = ir.VectorType.get([np_], f32)
      for j in range(n_warps):
        s = [ws.f32c(0.0)] * np_
        for i in range(rp):
          v = vector.load(vec, wu, [ci(j), ci(i), ci(0)])
          s = [arith.addf(x, arith.mulf(coef[i], extract(v, h))) for h, x in enumerate(s)]
        add = [arith.addf(a, arith.mulf(w, x)) for a, w, x in zip(add, weights[j], s)]
      return add
    return extra


@dataclasses.dataclass(frozen=True)
class _Ext:
  """GEAR-L's extension of the warp kernel (`mosaic_kivi_warp.launch`'s `ext`)."""

  lp: LowRankPlan

  def scratch(self, p, dtype):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    del dtype
    st, np_, lp = p["stages"], p["np"], self.lp
    f16 = jnp.float16
    qs = p["q_slots"]  # an item's constants ride in its q slot
    return [plgpu.SMEM((qs, np_, LR), f16), plgpu.SMEM((qs, HEAD_DIM, LR), f16),
            plgpu.SMEM((st, lp.ra // 2, 256), f16), plgpu.SMEM((st, lp.ra // 2, 256), f16),
            plgpu.SMEM((st, lp.chunks_per_block * lp.b_rows, 256), f16),
            plgpu.SMEM((st, lp.chunks_per_block * lp.b_rows, 256), f16),
            plgpu.SMEM((4 * p["w"], 8, np_), jnp.float32)]

  ring_arrivals = 4   # a block's a_k, a_v, b_k, b_v copies (or arrivals) on its slot's barrier

  def barriers(self, p):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    return (plgpu.Barrier(num_arrivals=2, num_barriers=p["q_slots"]),)

  def bind(self, p, dtype, **kw):
    return _Bound(self.lp, p, dtype, **kw)


def gear_attention_mosaic(q, cache: KiviMosaic, k_win, v_win, q_len, w_len,
                          lowrank: GearLowRank, *, chunk: int, scale=None, out_dtype=None,
                          warpgroups=2, stages=None, num_splits=None, persistent=True,
                          ctas=None, window_implementation=None, return_partials=False):
  """GEAR-L decode attention: the KIVI-2bit warp-layout backbone plus the low-rank residual.

  Args:
    q: [B, N, H] decode query (RoPE applied), H = 128.
    cache: D^ in the warp layout (`kivi.mosaic_layout.KiviMosaic`), capacity S.
    k_win, v_win: [B, W, K, H] the exact window; q_len, w_len: [B] compressed / window tokens.
    lowrank: `operands.GearLowRank` (fp16), chunks of `chunk` tokens.
    scale, out_dtype, warpgroups, stages, num_splits, persistent, ctas,
    window_implementation, return_partials: as
    `kivi.mosaic_kivi_warp.kivi_attention_mosaic_warp`.
  Returns:
    (out [B, N, H], lse [B, N] float32), plus the partials if asked.
  """
  why = fit(q.shape, cache, lowrank, chunk)
  if why is not None:
    raise ValueError(f"{NAME}: {why}")
  lr = lowrank
  lp = LowRankPlan(lr.a_k.shape[-1], lr.prefill_rank, lr.chunk_rank, chunk)
  p = plan(q.shape, cache, lp, warpgroups=warpgroups, stages=stages, num_splits=num_splits,
           persistent=persistent, ctas=ctas)
  b, n, h = q.shape
  kh, qpk, np_ = p["kh"], p["qpk"], p["np"]
  sm_scale = h ** -0.5 if scale is None else float(scale)
  qt = ring.query_operand(q, p, DTYPE)
  f32 = jnp.float32
  hi = lax.Precision.HIGHEST
  qbp = jnp.einsum("bkgh,bkhr->bkgr", q.reshape(b, kh, qpk, h).astype(f32),
                   lr.bp_k.astype(f32), precision=hi)
  qbp = jnp.pad(qbp, ((0, 0), (0, 0), (0, np_ - qpk), (0, LR - lp.rp)))
  qbp = qbp.reshape(b * kh, np_, LR).astype(jnp.float16)
  bpv = jnp.pad(lr.bp_v, ((0, 0), (0, 0), (0, 0), (0, LR - lp.rp))).reshape(b * kh, h, LR)
  pfx = (lr.n_pchunks * chunk).astype(jnp.int32)
  nb = cache.kc.shape[2]
  ak = lr.a_k.reshape(b, kh, nb, lp.ra // 2, 256)
  av = lr.a_v.reshape(b, kh, nb, lp.ra // 2, 256)
  c = lr.b_k.shape[2]
  bk = lr.b_k.reshape(b, kh, c * lp.b_rows, 256)
  bv = lr.b_v.reshape(b, kh, c * lp.b_rows, 256)
  o_t, lse_t = mkw.launch(p, DTYPE, sm_scale, qt, cache, q_len.astype(jnp.int32),
                          ext=_Ext(lp), ext_inputs=(qbp, bpv, pfx, ak, av, bk, bv))
  return ring.merge_with_window(q, qt, o_t, lse_t, p["num_splits"], p, k_win, v_win, w_len,
                                scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)
