"""GEAR-L decode attention on the Mosaic GPU warp KIVI kernel (`kivi.mosaic_kivi_warp`).

The backbone D^ is KIVI-2bit in the warp kernel's layout (`kivi.mosaic_layout`, read as the
KIVI kernel reads it); this module adds GEAR's low-rank residual L = A B^T (`operands`) as
an extension of that kernel (`mosaic_kivi_warp.launch`'s `ext`), never forming L:

  keys    s[t, h] += a_k[t] . (q_h B(t))   per warp and 16-token sub-tile, one m16n8k16
          with A = the tokens' a_k rows (rank padded to 16) and B = q B as a B fragment:
          q B_p (the prefill factor) is computed once per call in the wrapper (rounded to
          fp16) and read once per CTA; a warp whose 32 tokens lie in a streaming chunk c
          computes q B_c itself (8 m16n8k16 over the channels, `movmatrix` to a B fragment).
  values  o[h] += B(t) (sum_t p_t a_v[t]): u = a_v^T p, two m16n8k16 per warp and block with
          p's B fragments (those of the value products). Prefill tokens accumulate u_p
          across the loop, rescaled with the online softmax like o; the merge adds B_v,p u_p
          to each output row (thread tau: channel tau). A warp in a streaming chunk applies
          its chunk's B_v,c at once: 8 more m16n8k16 into o^T.
Operands: a_k / a_v [B, K, S, RA] fp16 (4 rows of a 128-token block = RA/2 rows of 256), read
through the ring with each block; b_k / b_v [B, K, C, H, r_g] of the block's chunks, copied
by the producer only for blocks that hold streaming tokens (else it arrives on their
barriers); q B_p [B K, NP, 8] and B_v,p [B K, 128, 8] (rank zero-padded to 8) once per CTA.
Token t (of a block starting at t0) uses the prefill factor iff t < n_pchunks * chunk; a warp
holds 32 tokens of one chunk (chunk a multiple of 32), so the choice is per warp (`scf.if`).
Choices: the MMAs run in fp16 (GEAR's factors are fp16; the backbone's scales must be fp16
too); q B is rounded to fp16 (as the Triton kernel rounds q to the key dtype); a's columns
beyond a segment's rank meet zero rows of B (the contract's zeros are not relied on: the
B operands are zero-padded and the lanes past the rank masked).
Restrictions (`fit`): the warp layout's (2-bit, groups of 32, H = 128, QPK <= 16), fp16
scales, RA and r_g in {2, 4, 8}, r_p <= 8, chunks of 32, 64 or 128 tokens; no outliers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from ..kivi import mosaic_kivi_warp as mkw
from ..kivi import mosaic_ring as ring
from ..kivi import mosaic_warp_step as ws
from ..kivi import store as kstore
from ..kivi.mosaic_dequant import extract
from ..kivi.mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic, check_mosaic
from ..kivi.mosaic_ptx import const_i32
from ..kivi import mosaic_ptx as ptx
from .operands import GearLowRank

NAME = "mosaic GEAR-L (warp)"
LR = 8          # rank columns of the per-CTA operands (q B_p, B_v,p), zero-padded
CHUNKS = (32, 64, 128)
RANKS = (2, 4, 8)
DTYPE = "float16"


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
  """Static sizes of the low-rank terms: left-factor columns RA, ranks r_p / r_g, chunk."""

  ra: int
  rp: int
  rg: int
  chunk: int

  @property
  def chunks_per_block(self) -> int:
    return max(1, BLOCK // self.chunk)

  @property
  def b_rows(self) -> int:
    """Rows of 256 of one chunk's right factor [H, r_g]."""
    return HEAD_DIM * self.rg // 256


def config_fit(*, bits: int, group: int, head_dim: int, scale_dtype, sparse: bool,
               rank_prefill: int, rank_chunk: int, chunk: int) -> str | None:
  """None when a GEAR configuration's store and factors fit this kernel (the cache then
  keeps its backbone in the warp layout), else why not (one line)."""
  if sparse:
    return "outliers (the Mosaic GEAR kernel adds the low rank only)"
  why = kstore.warp_fit(k_bits=bits, v_bits=bits, group=group, head_dim=head_dim,
                        scale_dtype=scale_dtype)
  if why is not None:
    return why
  if jnp.dtype(scale_dtype) != jnp.float16:
    return (f"{jnp.dtype(scale_dtype).name} scales (the Mosaic GEAR kernel's MMAs are fp16, "
            "as GEAR's factors)")
  ra, rp, rg = max(rank_prefill, rank_chunk), rank_prefill, rank_chunk
  if ra not in RANKS or rg not in RANKS or not 1 <= rp <= LR:
    return (f"ranks RA={ra}, r_p={rp}, r_g={rg} (the Mosaic GEAR kernel takes RA = "
            f"max(r_p, r_g) and r_g in {RANKS}, 1 <= r_p <= {LR})")
  if chunk not in CHUNKS:
    return f"chunks of {chunk} tokens (the Mosaic GEAR kernel takes {CHUNKS})"
  return None


def fit(q_shape, cache, lowrank, chunk: int, sparse=False) -> str | None:
  """None when this kernel takes the problem, else why not (one line)."""
  if sparse:
    return "outliers (the Mosaic GEAR kernel adds the low rank only)"
  if not isinstance(cache, KiviMosaic):
    return "the store is not in the warp layout"
  if lowrank is None:
    return "no low-rank factors"
  try:
    dtype = check_mosaic(cache)
  except ValueError as e:
    return str(e)
  ra, rp, rg = lowrank.a_k.shape[-1], lowrank.prefill_rank, lowrank.chunk_rank
  why = config_fit(bits=2, group=32, head_dim=HEAD_DIM, scale_dtype=dtype, sparse=False,
                   rank_prefill=rp, rank_chunk=rg, chunk=chunk)
  if why is not None:
    return why
  if ra != max(rp, rg):
    return f"lowrank.a_k has {ra} columns, expected max(r_p={rp}, r_g={rg})"
  if lowrank.b_k.shape[2] * chunk != cache.capacity:
    return (f"lowrank.b_k has {lowrank.b_k.shape[2]} chunks of {chunk} tokens for a capacity "
            f"of {cache.capacity}")
  for name in ("a_k", "a_v", "b_k", "b_v", "bp_k", "bp_v"):
    if getattr(lowrank, name).dtype != jnp.float16:
      return f"lowrank.{name} is {getattr(lowrank, name).dtype} (the kernel reads fp16)"
  try:
    _plan(q_shape, cache, LowRankPlan(ra, rp, rg, chunk))
  except ValueError as e:
    return str(e)
  return None


def _extra_smem(lp: LowRankPlan):
  kib = lambda n: -(-n // 1024) * 1024

  def extra(w, stages, np_):
    per_slot = 2 * (lp.ra // 2) * 512 + 2 * lp.chunks_per_block * lp.b_rows * 512
    return (stages * per_slot + kib(np_ * LR * 2) + kib(HEAD_DIM * LR * 2)
            + kib(4 * w * 8 * np_ * 4) + 256)
  return extra


def _plan(q_shape, cache, lp, **knobs):
  return mkw.plan(q_shape, cache.kc.shape, extra_smem=_extra_smem(lp), **knobs)


# ------------------------------------------------------------------ register-level pieces
# (inside `plgpu.inline_mgpu` bodies; m16n8k16 fragment coordinates: `mosaic_warp_step`)

def _mlir():
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf, vector
  # pylint: enable=import-outside-toplevel
  return ir, arith, memref, scf, vector


def _idx(v):
  ir, arith, _, _, _ = _mlir()
  return arith.index_cast(ir.IndexType.get(), v)


def _half(ref, flat):
  """The fp16 at a flat element index of a [rows, 256] shared-memory ref."""
  _, arith, memref, _, _ = _mlir()
  return memref.load(ref, [_idx(arith.divui(flat, const_i32(256))),
                           _idx(arith.remui(flat, const_i32(256)))])


def _pair(lo, hi):
  """Two fp16 values -> one i32 (lo in the low half)."""
  ir, _, _, _, vector = _mlir()
  v = vector.from_elements(ir.VectorType.get([2], ir.F16Type.get()), [lo, hi])
  return extract(vector.bitcast(ir.VectorType.get([1], ir.IntegerType.get_signless(32)), v), 0)


def _word(ref, flat):
  """The i32 holding fp16 elements flat, flat + 1 (flat even) of a [rows, 256] ref."""
  ir, arith, _, _, vector = _mlir()
  v = vector.load(ir.VectorType.get([2], ir.F16Type.get()), ref,
                  [_idx(arith.divui(flat, const_i32(256))),
                   _idx(arith.remui(flat, const_i32(256)))])
  return extract(vector.bitcast(ir.VectorType.get([1], ir.IntegerType.get_signless(32)), v), 0)


def _if(cond, then_fn, else_fn, types):
  """scf.if yielding the lists then_fn() / else_fn() (values of `types`)."""
  ir, _, _, scf, _ = _mlir()
  op = scf.IfOp(cond, list(types), has_else=True)
  with ir.InsertionPoint(op.then_block):
    scf.yield_(list(then_fn()))
  with ir.InsertionPoint(op.else_block):
    scf.yield_(list(else_fn()))
  return list(op.results)


class _StepHook:
  """GEAR's terms inside one online-softmax step (`mosaic_warp_step.block_step`'s ext)."""

  def __init__(self, lp: LowRankPlan, refs, u, qbp, pre, nt, general):
    ir, arith, _, _, _ = _mlir()
    self.lp, self.refs, self.nt = lp, refs, nt
    self.u = list(ws.scalars(u))
    self.qbp = ws.scalars(qbp)[:nt]
    _, warp, self.r, self.q = ws.lane_parts()
    self.tok = arith.muli(warp, const_i32(32))        # the warp's first token in the block
    # a warp's 32 tokens lie in one chunk: streaming iff its first token is past the prefill;
    # a plain step (general False: every token under the prefill factor) has no branches
    self.stream = [arith.cmpi(arith.CmpIPredicate.sge, self.tok, ws.scalars(v)[0])
                   for v in pre] if general else None
    self.lc = arith.divui(self.tok, const_i32(min(lp.chunk, BLOCK)))  # chunk within the slot
    self.zero = const_i32(0)
    self.i32 = ir.IntegerType.get_signless(32)
    self.f32 = ir.F32Type.get()

  def _masked(self, ok, val):
    _, arith, _, _, _ = _mlir()
    return arith.select(ok, val, self.zero)

  def _rank_lane(self, rank):
    """(row index clamped below `rank`, lane row r < rank)."""
    _, arith, _, _, _ = _mlir()
    ok = arith.cmpi(arith.CmpIPredicate.ult, self.r, const_i32(rank))
    return arith.minui(self.r, const_i32(rank - 1)), ok

  def _a_k(self, ak, m):
    """A fragment of a_k rows (tokens tok + 16 m + r (+ 8), rank columns 2 q, 2 q + 1)."""
    _, arith, _, _, _ = _mlir()
    ra = self.lp.ra
    col = arith.remui(arith.muli(self.q, const_i32(2)), const_i32(ra))  # lanes past RA:
    out = []                                  # any finite column (B's rows there are 0)
    for rh in range(2):
      t = arith.addi(self.tok, arith.addi(self.r, const_i32(16 * m + 8 * rh)))
      out.append(_word(ak, arith.addi(arith.muli(t, const_i32(ra)), col)))
    return [out[0], out[1], self.zero, self.zero]

  def _q_bc(self, bk, qb):
    """q B_c of the warp's streaming chunk: per n, b0 of the B fragment (rank rows 2 q + e,
    head column r), from 8 m16n8k16 with A = B_c^T (rank rows r < r_g, channel columns)."""
    _, arith, _, _, _ = _mlir()
    rg = self.lp.rg
    rr, ok = self._rank_lane(rg)
    base = arith.addi(arith.muli(self.lc, const_i32(HEAD_DIM * rg)), rr)
    frags = []
    for kk in range(8):
      regs = []
      for jh in range(2):
        ch = arith.addi(arith.muli(self.q, const_i32(2)), const_i32(16 * kk + 8 * jh))
        at = lambda c: _half(bk, arith.addi(base, arith.muli(c, const_i32(rg))))
        regs.append(self._masked(ok, _pair(at(ch), at(arith.addi(ch, const_i32(1))))))
      frags.append([regs[0], self.zero, regs[1], self.zero])
    out = []
    for n in range(self.nt):
      d = [ws.f32c(0.0)] * 4
      for kk in range(8):
        d = ptx.mma_16816(frags[kk], qb[16 * n + 2 * kk:16 * n + 2 * kk + 2], d, DTYPE)
      out.append(ptx.movmatrix_t(ptx.pack2(d[0], d[1], DTYPE)))
    return out

  def scores(self, j, qb):
    ak, _, bk, _ = self.refs[j]
    qsel = self.qbp if self.stream is None else _if(
        self.stream[j], lambda: self._q_bc(bk, qb), lambda: self.qbp, [self.i32] * self.nt)
    out = {}
    for m in range(2):
      a = self._a_k(ak, m)
      for n in range(self.nt):
        out[m, n] = ptx.mma_16816(a, [qsel[n], self.zero], [ws.f32c(0.0)] * 4, DTYPE)
    return out

  def rescale(self, alphas):
    _, arith, _, _, _ = _mlir()
    self.u = [arith.mulf(v, alphas[i // 4, i % 2]) for i, v in enumerate(self.u)]

  def _a_v(self, av, kk):
    """A fragment of a_v^T (rank rows r < RA, token columns tok + 16 kk + 2 q (+ 8) + e)."""
    _, arith, _, _, _ = _mlir()
    ra = self.lp.ra
    rr, ok = self._rank_lane(ra)
    regs = []
    for jh in range(2):
      t = arith.addi(self.tok, arith.addi(arith.muli(self.q, const_i32(2)),
                                          const_i32(16 * kk + 8 * jh)))
      at = lambda tt: _half(av, arith.addi(arith.muli(tt, const_i32(ra)), rr))
      regs.append(self._masked(ok, _pair(at(t), at(arith.addi(t, const_i32(1))))))
    return [regs[0], self.zero, regs[1], self.zero]

  def _apply_bv(self, bv, d, acc):
    """acc (o^T D fragments) + B_v,c u for the warp's streaming chunk (u: D per n)."""
    _, arith, _, _, _ = _mlir()
    rg = self.lp.rg
    ok = arith.cmpi(arith.CmpIPredicate.ult, arith.muli(self.q, const_i32(2)), const_i32(rg))
    col = arith.remui(arith.muli(self.q, const_i32(2)), const_i32(rg))
    base = arith.addi(arith.muli(self.lc, const_i32(HEAD_DIM * rg)), col)
    ub = [ptx.movmatrix_t(ptx.pack2(d[n][0], d[n][1], DTYPE)) for n in range(self.nt)]
    acc = list(acc)
    for t in range(8):
      a = []
      for rh in range(2):
        ch = arith.addi(self.r, const_i32(16 * t + 8 * rh))
        a.append(self._masked(ok, _word(bv, arith.addi(base, arith.muli(ch, const_i32(rg))))))
      frag = [a[0], a[1], self.zero, self.zero]
      for n in range(self.nt):
        i = 32 * n + 4 * t
        acc[i:i + 4] = ptx.mma_16816(frag, [ub[n], self.zero], acc[i:i + 4], DTYPE)
    return acc

  def values(self, j, pb, acc):
    _, arith, _, _, _ = _mlir()
    _, av, _, bv = self.refs[j]
    fr = [self._a_v(av, kk) for kk in range(2)]
    if self.stream is None:  # plain: u += a_v^T p
      for n in range(self.nt):
        for kk in range(2):
          self.u[4 * n:4 * n + 4] = ptx.mma_16816(fr[kk], pb[kk, n], self.u[4 * n:4 * n + 4],
                                                  DTYPE)
      return acc
    st = self.stream[j]
    d = []
    for n in range(self.nt):
      c = [arith.select(st, ws.f32c(0.0), v) for v in self.u[4 * n:4 * n + 4]]
      for kk in range(2):
        c = ptx.mma_16816(fr[kk], pb[kk, n], c, DTYPE)
      d.append(c)
      self.u[4 * n:4 * n + 4] = [arith.select(st, old, new)
                                 for old, new in zip(self.u[4 * n:4 * n + 4], c)]
    return _if(st, lambda: self._apply_bv(bv, d, acc), lambda: acc, [self.f32] * len(acc))

  def state(self):
    return (ws.as_array(self.u, self.f32, None),)


class _Bound:
  """The per-CTA extension object `mosaic_kivi_warp._kernel` calls (its `launch` docstring)."""

  refs_per_block, n_state, n_const = 4, 1, 1

  def __init__(self, lp, p, dtype, *, b, head, pid, start, inputs, smem, bars, ring_bars):
    del dtype, start
    self.lp, self.p, self.b, self.head, self.pid = lp, p, b, head, pid
    (self.qbp_g, self.bpv_g, self.pfx_g, self.ak_g, self.av_g, self.bk_g, self.bv_g) = inputs
    (self.qbp_s, self.bpv_s, self.ak_s, self.av_s, self.bk_s, self.bv_s, self.wu_s) = smem
    (self.const_bar,) = bars
    # the block's factors arrive on its backbone barriers (`_Ext.ring_arrivals`)
    self.bk_bar, self.ak_bar, self.bv_bar, self.av_bar = ring_bars
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
    for src, dst, bar in ((self.ak_g, self.ak_s, self.ak_bar), (self.av_g, self.av_s,
                                                                 self.av_bar)):
      plgpu.copy_gmem_to_smem(src.at[b, head, blk], dst.at[slot], bar.at[slot])
    rows = lp.chunks_per_block * lp.b_rows
    row0 = (blk * BLOCK // lp.chunk) * lp.b_rows
    streams = (blk + 1) * BLOCK > self.pfx

    @pl.when(streams)
    def _():
      for src, dst, bar in ((self.bk_g, self.bk_s, self.bk_bar), (self.bv_g, self.bv_s,
                                                                   self.bv_bar)):
        plgpu.copy_gmem_to_smem(src.at[b, head, pl.ds(row0, rows)], dst.at[slot],
                                bar.at[slot])

    @pl.when(jnp.logical_not(streams))
    def _():
      plgpu.barrier_arrive(self.bk_bar.at[slot])
      plgpu.barrier_arrive(self.bv_bar.at[slot])

  # compute warpgroups
  def load_const(self):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    plgpu.barrier_wait(self.const_bar)
    nt = self.p["np"] // 8
    ne = -(-nt // 4) * 4  # a WGMMA-layout array holds a multiple of 4 scalars per thread
    out_t = plgpu.ShapeDtypeStruct((64, 2 * ne), jnp.int32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out_t)
    def load(_, ref):
      ir, arith, _, _, _ = _mlir()
      _, _, r, q = ws.lane_parts()
      col = arith.muli(q, const_i32(2))
      vals = [_word(ref, arith.addi(arith.muli(arith.addi(r, const_i32(8 * n)),
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
      ir, _, _, _, _ = _mlir()
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
    return _StepHook(self.lp, refs, state[0], const[0], extras, nt, general)

  def publish(self, state):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    nt = self.p["np"] // 8

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def pub(_, u_arr, wu):
      from jax.experimental.mosaic.gpu import utils as mgpu_utils  # pylint: disable=import-outside-toplevel
      ir, arith, _, _, vector = _mlir()
      f32 = ir.F32Type.get()
      _, _, r, q = ws.lane_parts()
      gw = _idx(arith.divui(mgpu_utils.thread_idx(), const_i32(32)))
      u = ws.scalars(u_arr)
      for n in range(nt):
        col = _idx(arith.addi(arith.muli(q, const_i32(2)), const_i32(8 * n)))
        vector.store(vector.from_elements(ir.VectorType.get([2], f32), u[4 * n:4 * n + 2]),
                     wu, [gw, _idx(r), col])
    pub(state[0], self.wu_s)

  def merge_refs(self):
    return (self.wu_s, self.bpv_s)

  def merge_hook(self, refs, n_warps, np_):
    wu, bpv = refs
    rp = self.lp.rp

    def extra(weights):
      ir, arith, _, _, vector = _mlir()
      f32 = ir.F32Type.get()
      tid, _, _, _ = ws.lane_parts()
      row = _idx(tid)
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
    return [plgpu.SMEM((np_, LR), f16), plgpu.SMEM((HEAD_DIM, LR), f16),
            plgpu.SMEM((st, lp.ra // 2, 256), f16), plgpu.SMEM((st, lp.ra // 2, 256), f16),
            plgpu.SMEM((st, lp.chunks_per_block * lp.b_rows, 256), f16),
            plgpu.SMEM((st, lp.chunks_per_block * lp.b_rows, 256), f16),
            plgpu.SMEM((4 * p["w"], 8, np_), jnp.float32)]

  ring_arrivals = (1, 1, 1, 1)   # b_k on kc's barrier, a_k on ks', b_v on vc's, a_v on vs'

  def barriers(self, p):
    import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
    del p
    return (plgpu.Barrier(num_arrivals=2, num_barriers=1),)

  def bind(self, p, dtype, **kw):
    return _Bound(self.lp, p, dtype, **kw)


def gear_attention_mosaic(q, cache: KiviMosaic, k_win, v_win, q_len, w_len,
                          lowrank: GearLowRank, *, chunk: int, scale=None, out_dtype=None,
                          warpgroups=2, stages=None, num_splits=None,
                          window_implementation=None, return_partials=False):
  """GEAR-L decode attention: the KIVI-2bit warp-layout backbone plus the low-rank residual.

  Args:
    q: [B, N, H] decode query (RoPE applied), H = 128.
    cache: D^ in the warp layout (`kivi.mosaic_layout.KiviMosaic`), capacity S.
    k_win, v_win: [B, W, K, H] the exact window; q_len, w_len: [B] compressed / window tokens.
    lowrank: `operands.GearLowRank` (fp16), chunks of `chunk` tokens.
    scale, out_dtype, warpgroups, stages, num_splits, window_implementation,
    return_partials: as `kivi.mosaic_kivi_warp.kivi_attention_mosaic_warp`.
  Returns:
    (out [B, N, H], lse [B, N] float32), plus the partials if asked.
  """
  why = fit(q.shape, cache, lowrank, chunk)
  if why is not None:
    raise ValueError(f"{NAME}: {why}")
  lr = lowrank
  lp = LowRankPlan(lr.a_k.shape[-1], lr.prefill_rank, lr.chunk_rank, chunk)
  p = _plan(q.shape, cache, lp, warpgroups=warpgroups, stages=stages, num_splits=num_splits)
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
  return ring.merge_with_window(q, o_t, lse_t, p["num_splits"], p, k_win, v_win, w_len,
                                scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)

