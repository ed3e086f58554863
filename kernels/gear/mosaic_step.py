"""GEAR-L's terms inside the Mosaic warp KIVI kernel's step (`mosaic_gear`), register level.

Run inside `plgpu.inline_mgpu` bodies; m16n8k16 fragment coordinates as in
`kivi.mosaic_warp_step`. `StepHook` is that module's `block_step` extension: the low-rank
score product per 16-token sub-tile (the key chains' start), u = a_v^T p per block (plain
steps accumulate it; a warp in a streaming chunk applies its B_v,c at once), and a
streaming warp's q B_c. The helpers load fp16 pairs and halves from [rows, 256] shared
memory refs and build `scf.if`.
"""

from __future__ import annotations

from ..kivi import mosaic_ptx as ptx
from ..kivi import mosaic_warp_step as ws
from ..kivi.mosaic_dequant import extract
from ..kivi.mosaic_layout import BLOCK, HEAD_DIM
from ..kivi.mosaic_ptx import const_i32
from .mosaic_plan import DTYPE, LowRankPlan


def mlir_modules():
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref, scf, vector
  # pylint: enable=import-outside-toplevel
  return ir, arith, memref, scf, vector


def as_index(v):
  ir, arith, _, _, _ = mlir_modules()
  return arith.index_cast(ir.IndexType.get(), v)


def load_half(ref, flat):
  """The fp16 at a flat element index of a [rows, 256] shared-memory ref."""
  _, arith, memref, _, _ = mlir_modules()
  return memref.load(ref, [as_index(arith.divui(flat, const_i32(256))),
                           as_index(arith.remui(flat, const_i32(256)))])


def pack_pair(lo, hi):
  """Two fp16 values -> one i32 (lo in the low half)."""
  ir, _, _, _, vector = mlir_modules()
  v = vector.from_elements(ir.VectorType.get([2], ir.F16Type.get()), [lo, hi])
  return extract(vector.bitcast(ir.VectorType.get([1], ir.IntegerType.get_signless(32)), v), 0)


def load_word(ref, flat):
  """The i32 holding fp16 elements flat, flat + 1 (flat even) of a [rows, 256] ref."""
  ir, arith, _, _, vector = mlir_modules()
  v = vector.load(ir.VectorType.get([2], ir.F16Type.get()), ref,
                  [as_index(arith.divui(flat, const_i32(256))),
                   as_index(arith.remui(flat, const_i32(256)))])
  return extract(vector.bitcast(ir.VectorType.get([1], ir.IntegerType.get_signless(32)), v), 0)


def if_else(cond, then_fn, else_fn, types):
  """scf.if yielding the lists then_fn() / else_fn() (values of `types`)."""
  ir, _, _, scf, _ = mlir_modules()
  op = scf.IfOp(cond, list(types), has_else=True)
  with ir.InsertionPoint(op.then_block):
    scf.yield_(list(then_fn()))
  with ir.InsertionPoint(op.else_block):
    scf.yield_(list(else_fn()))
  return list(op.results)


class StepHook:
  """GEAR's terms inside one online-softmax step (`mosaic_warp_step.block_step`'s ext)."""

  def __init__(self, lp: LowRankPlan, refs, u, qbp, pre, nt, general):
    ir, arith, _, _, _ = mlir_modules()
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
    _, arith, _, _, _ = mlir_modules()
    return arith.select(ok, val, self.zero)

  def _rank_lane(self, rank):
    """(row index clamped below `rank`, lane row r < rank)."""
    _, arith, _, _, _ = mlir_modules()
    ok = arith.cmpi(arith.CmpIPredicate.ult, self.r, const_i32(rank))
    return arith.minui(self.r, const_i32(rank - 1)), ok

  def _a_k(self, ak, m):
    """A fragment of a_k rows (tokens tok + 16 m + r (+ 8), rank columns 2 q, 2 q + 1)."""
    _, arith, _, _, _ = mlir_modules()
    ra = self.lp.ra
    col = arith.remui(arith.muli(self.q, const_i32(2)), const_i32(ra))  # lanes past RA:
    out = []                                  # any finite column (B's rows there are 0)
    for rh in range(2):
      t = arith.addi(self.tok, arith.addi(self.r, const_i32(16 * m + 8 * rh)))
      out.append(load_word(ak, arith.addi(arith.muli(t, const_i32(ra)), col)))
    return [out[0], out[1], self.zero, self.zero]

  def _q_bc(self, bk, qb):
    """q B_c of the warp's streaming chunk: per n, b0 of the B fragment (rank rows 2 q + e,
    head column r), from 8 m16n8k16 with A = B_c^T (rank rows r < r_g, channel columns)."""
    _, arith, _, _, _ = mlir_modules()
    rg = self.lp.rg
    rr, ok = self._rank_lane(rg)
    base = arith.addi(arith.muli(self.lc, const_i32(HEAD_DIM * rg)), rr)
    frags = []
    for kk in range(8):
      regs = []
      for jh in range(2):
        ch = arith.addi(arith.muli(self.q, const_i32(2)), const_i32(16 * kk + 8 * jh))
        at = lambda c: load_half(bk, arith.addi(base, arith.muli(c, const_i32(rg))))
        regs.append(self._masked(ok, pack_pair(at(ch), at(arith.addi(ch, const_i32(1))))))
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
    qsel = self.qbp if self.stream is None else if_else(
        self.stream[j], lambda: self._q_bc(bk, qb), lambda: self.qbp, [self.i32] * self.nt)
    out = {}
    for m in range(2):
      a = self._a_k(ak, m)
      for n in range(self.nt):
        out[m, n] = ptx.mma_16816(a, [qsel[n], self.zero], [ws.f32c(0.0)] * 4, DTYPE)
    return out

  def rescale(self, alphas):
    _, arith, _, _, _ = mlir_modules()
    self.u = [arith.mulf(v, alphas[i // 4, i % 2]) for i, v in enumerate(self.u)]

  def _a_v(self, av, kk):
    """A fragment of a_v^T (rank rows r < RA, token columns tok + 16 kk + 2 q (+ 8) + e)."""
    _, arith, _, _, _ = mlir_modules()
    ra = self.lp.ra
    rr, ok = self._rank_lane(ra)
    regs = []
    for jh in range(2):
      t = arith.addi(self.tok, arith.addi(arith.muli(self.q, const_i32(2)),
                                          const_i32(16 * kk + 8 * jh)))
      at = lambda tt: load_half(av, arith.addi(arith.muli(tt, const_i32(ra)), rr))
      regs.append(self._masked(ok, pack_pair(at(t), at(arith.addi(t, const_i32(1))))))
    return [regs[0], self.zero, regs[1], self.zero]

  def _apply_bv(self, bv, d, acc):
    """acc (o^T D fragments) + B_v,c u for the warp's streaming chunk (u: D per n)."""
    _, arith, _, _, _ = mlir_modules()
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
        a.append(self._masked(ok, load_word(bv, arith.addi(base, arith.muli(ch, const_i32(rg))))))
      frag = [a[0], a[1], self.zero, self.zero]
      for n in range(self.nt):
        i = 32 * n + 4 * t
        acc[i:i + 4] = ptx.mma_16816(frag, [ub[n], self.zero], acc[i:i + 4], DTYPE)
    return acc

  def values(self, j, pb, acc):
    _, arith, _, _, _ = mlir_modules()
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
    return if_else(st, lambda: self._apply_bv(bv, d, acc), lambda: acc, [self.f32] * len(acc))

  def state(self):
    return (ws.as_array(self.u, self.f32, None),)
