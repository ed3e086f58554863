"""The per-thread bodies of `mosaic_kivi_warp` (run inside `plgpu.inline_mgpu`).

State crosses the Pallas loop as WGMMA-layout arrays used as plain register files (a
[64, C] f32/i32 array is C / 2 scalars per thread, in the order `scalars` lists them):
  qb  [64, 64 NT] i32: q's B fragments, (n-tile, k-step kk, b0/b1), then the same times the
                       key slots' `magic_factor` (`query_fragments`)
  acc [64, 64 NT] f32: o^T's D fragments, (n-tile, channel tile t, c0..c3)
  ml  [64, 8 NT]  f32: (n-tile, [max e0, max e1, sum e0, sum e1]) of the thread's two
                       query columns 8 nt + 2 (lane % 4) + e (log2 units; the sum is the
                       thread's share, reduced across the warp at the end)
  zacc [64, 8 NT] f32: (n-tile, c0..c3) D fragments of [S; Z] [16, 8], the running sums
                       of p s (rows r < 8) and p z (rows 8 + r) of value channel group
                       r % 4 (`_value_products`)
Dequantization: the key scales multiply q's B fragments (a warp's 32 tokens are one key
group) and the value scales p's (per channel group). The value codes enter the products as
exact small integers (`mosaic_dequant.word_codes`: a lop3 and one packed FMA per pair); the
key codes as the lop3's MAGIC + c / f alone (`word_magic`), with q's fragments pre-scaled
by f and MAGIC's share subtracted by one more product per k-step (`_key_scores`; why not
the values too: their sums run over the whole context, and f32 accumulation of a MAGIC-sized
term loses the codes' bits there, as Palu's 4-bit kernel found). The zero points are added
through one m16n8k16 product per k-step whose A operand is the scale/zero chunk as loaded.
Rounding: q f * s and p * s once each (p twice in all); the zero points are summed exactly
in f32.
Fragment coordinates (PTX m16n8k16; r = lane // 4, q = lane % 4): A rows r (+ 8), columns
2 q (+ 8); B rows 2 q (+ 8), column r; C/D rows r (+ 8), columns 2 q + {0, 1}.
"""

from __future__ import annotations

import math

import numpy as np

from . import mosaic_ptx as ptx
from .mosaic_dequant import (MAGIC, const_i32, extract, key_pairs, key_scale_rows, load16,
                             magic_factor, pair_const, thread_coords, word_codes)


def _mlir():
  # pylint: disable=import-outside-toplevel
  import jax.experimental.mosaic.gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector
  # pylint: enable=import-outside-toplevel
  return mgpu, fa, mgpu_utils, ir, arith, vector


def f32c(v: float):
  _, _, _, ir, arith, _ = _mlir()
  return arith.constant(ir.F32Type.get(), v)


def scalars(arr):
  """A WGMMA-layout FragmentedArray's per-thread scalars, in register order."""
  return [extract(reg, e) for reg in arr.registers.flat for e in range(2)]


def as_array(vals, elem, signed):
  """The inverse of `scalars`: a [64, 2 len(vals)] WGMMA-layout FragmentedArray."""
  mgpu, fa, _, ir, _, vector = _mlir()
  layout = fa.WGMMA_LAYOUT
  regs = np.empty(layout.registers_shape((64, 2 * len(vals))), dtype=object)
  v2 = ir.VectorType.get([2], elem)
  for i in range(regs.size):
    regs.flat[i] = vector.from_elements(v2, [vals[2 * i], vals[2 * i + 1]])
  return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=signed)


def _fmax(a, b):
  _, _, _, _, arith, _ = _mlir()
  return arith.maxnumf(a, b)


def _is_neg_inf(x):
  _, _, _, _, arith, _ = _mlir()
  return arith.cmpf(arith.CmpFPredicate.OEQ, x, f32c(-math.inf))


def lane_parts():
  _, _, _, _, arith, _ = _mlir()
  tid, warp, lane = thread_coords()
  return tid, warp, arith.divui(lane, const_i32(4)), arith.remui(lane, const_i32(4))


def query_fragments(q_ref, nt: int, dtype: str):
  """qb (module docstring) from q [NP, 128] (16-bit, shared memory, unswizzled), followed by
  the same fragments times `magic_factor` of their channel block's key slot (exact: powers
  of two, at most 2^-8; the key products' B before the scales)."""
  _, _, _, ir, arith, vector = _mlir()
  ft = ir.F16Type.get() if dtype == "float16" else ir.BF16Type.get()
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  _, _, r, q = lane_parts()
  vals = []
  for n in range(nt):
    row = arith.index_cast(index, arith.addi(r, const_i32(8 * n)))
    for kk in range(8):
      for half in range(2):
        col = arith.index_cast(index, arith.addi(arith.muli(q, const_i32(2)),
                                                 const_i32(16 * kk + 8 * half)))
        pair = vector.load(ir.VectorType.get([2], ft), q_ref, [row, col])
        vals.append(extract(vector.bitcast(ir.VectorType.get([1], i32), pair), 0))
  # register 16 n + 2 kk + half: channel block j = 2 kk + half, key slot j % 8
  scaled = [ptx.hmul2(v, pair_const(magic_factor((i % 16) % 8, dtype), dtype), dtype)
            for i, v in enumerate(vals)]
  return as_array(vals + scaled, i32, True)


def initial_state(nt: int):
  """(acc, ml, zacc) before the first block: zeros, maxima -inf, sums 0, zeros."""
  _, _, _, ir, _, _ = _mlir()
  f32 = ir.F32Type.get()
  acc = [f32c(0.0)] * (32 * nt)
  ml = [f32c(v) for _ in range(nt) for v in (-math.inf, -math.inf, 0.0, 0.0)]
  return as_array(acc, f32, None), as_array(ml, f32, None), as_array(acc[:4 * nt], f32, None)


def _key_scores(kc, ks, qb, qbm, *, nt, dtype, group=32, init=None):
  """{(m, n): 4 f32}: the scores of the warp's 32 tokens (D fragments of tokens
  32 warp + 16 m + r (+ 8)), unscaled. The key codes enter the products as the lop3's
  MAGIC + c / f (`mosaic_dequant.word_magic`, f = `magic_factor` of the channel's slot), so
  B = (q f) * s (qbm: q's fragments times f; one HMUL2 per B register), and MAGIC's share,
  MAGIC sum_j B_j per query column, is subtracted: one more m16n8k16 per k-step with an A of
  MAGIC everywhere and the same B (on the rounded B, so the two cancel up to the f32
  accumulation, ~2^-22 MAGIC sum |B|). The zero points enter as beta = z . q: one m16n8k16
  product per k-step whose A fragment is the thread's scale row as loaded, [s, z, s, z] (A
  rows r hold s, rows r + 8 hold z: no register copies), so D rows 8-15 are beta, in the
  scores' column layout. init: None, or {(m, n): 4 f32} added to the scores (an
  extension's term)."""
  _, _, _, _, arith, _ = _mlir()
  _, warp, _, _ = lane_parts()
  zero4 = [f32c(0.0)] * 4
  # the warp's token group (groups of 64: warps 2 i and 2 i + 1 share row i)
  srows = key_scale_rows(ks, warp if group == 32 else arith.divui(warp, const_i32(group // 32)),
                         dtype)
  bq = [ptx.hmul2(qbm[16 * n + 2 * kk + h], srows[kk][2 * h], dtype)
        for n in range(nt) for kk in range(8) for h in range(2)]
  magic_a = [pair_const(MAGIC, dtype)] * 4
  beta = {}
  for n in range(nt):
    chains = [zero4, zero4]
    offs = [zero4, zero4]
    for kk in range(8):
      chains[kk % 2] = ptx.mma_16816(srows[kk], qb[16 * n + 2 * kk:16 * n + 2 * kk + 2],
                                     chains[kk % 2], dtype)
      offs[kk % 2] = ptx.mma_16816(magic_a, bq[16 * n + 2 * kk:16 * n + 2 * kk + 2],
                                   offs[kk % 2], dtype)
    # beta (D rows r + 8) minus MAGIC's share (rows r), per column 2 q + e
    beta[n] = [arith.subf(arith.addf(chains[0][2 + e], chains[1][2 + e]),
                          arith.addf(offs[0][e], offs[1][e])) for e in range(2)]
  scores = {}
  for m in range(2):
    kp = key_pairs(kc, m, dtype)
    for n in range(nt):
      # two accumulation chains per product halve the dependent-MMA latency; init: a
      # caller's term (its own products, off this chain's critical path) starts one chain
      chains = [zero4 if init is None else init[m, n], zero4]
      for kk in range(8):
        a = [kp[(0, 2 * kk)], kp[(1, 2 * kk)], kp[(0, 2 * kk + 1)], kp[(1, 2 * kk + 1)]]
        b = bq[16 * n + 2 * kk: 16 * n + 2 * kk + 2]
        chains[kk % 2] = ptx.mma_16816(a, b, chains[kk % 2], dtype)
      sums = [arith.addf(x, y) for x, y in zip(*chains)]
      # beta added last: the products do not wait for it
      scores[m, n] = [arith.addf(x, beta[n][c % 2]) for c, x in enumerate(sums)]
  return scores


def _softmax(blocks, ml, *, nt, scale2):
  """Masks and scales the scores of each block (blocks: [(scores {(m, n): 4 f32}, valid)]),
  then one online-softmax step per query column (n, e) over the warp's 32 tokens of every
  block: returns (p [{(m, n): 4 f32}] per block, alphas {(n, e)}, new ml scalars)."""
  _, _, _, _, arith, _ = _mlir()
  _, warp, r, _ = lane_parts()
  row0 = arith.addi(arith.muli(warp, const_i32(32)), r)
  neg_inf, scale = f32c(-math.inf), f32c(scale2)
  for scores, valid in blocks:
    for (m, n), s in scores.items():
      for c in range(4):
        row = arith.addi(row0, const_i32(16 * m + 8 * (c // 2)))
        ok = arith.cmpi(arith.CmpIPredicate.slt, row, valid)
        s[c] = arith.select(ok, arith.mulf(s[c], scale), neg_inf)
  ml_out = [None] * (4 * nt)
  alphas = {}
  for n in range(nt):
    for e in range(2):
      vals = [sc[m, n][c] for sc, _ in blocks for m in range(2) for c in (e, 2 + e)]
      while len(vals) > 1:  # a balanced tree of maxima
        vals = [_fmax(x, y) for x, y in zip(vals[::2], vals[1::2])] + vals[len(vals) & ~1:]
      bmax = vals[0]
      for mask in (4, 8, 16):
        bmax = _fmax(bmax, ptx.shfl_xor(bmax, mask))
      m_old = ml[4 * n + e]
      m_new = _fmax(m_old, bmax)
      m_use = arith.select(_is_neg_inf(m_new), f32c(0.0), m_new)
      alphas[n, e] = ptx.ex2(arith.subf(m_old, m_use))
      tot = None
      for sc, _ in blocks:
        for m in range(2):
          for c in (e, 2 + e):
            sc[m, n][c] = ptx.ex2(arith.subf(sc[m, n][c], m_use))
            tot = sc[m, n][c] if tot is None else arith.addf(tot, sc[m, n][c])
      ml_out[4 * n + e] = m_new
      ml_out[4 * n + 2 + e] = arith.addf(arith.mulf(ml[4 * n + 2 + e], alphas[n, e]), tot)
  return [sc for sc, _ in blocks], alphas, ml_out


def p_fragments(p, dtype):
  """p {(m, n): 4 f32} (D fragments of the warp's tokens 16 m + r (+ 8), heads 8 n + 2 q +
  e) -> {(m, n): [b0, b1]}: the B fragments of the value products, rows (tokens 16 m +)
  2 q (+ 8), column (head) r, rounded to the 16-bit type."""
  pb = {}
  for (m, n), pv in p.items():
    pb[m, n] = [ptx.movmatrix_t(ptx.pack2(pv[0], pv[1], dtype)),
                ptx.movmatrix_t(ptx.pack2(pv[2], pv[3], dtype))]
  return pb


def _value_products(vc, vs, pb, acc, zacc, *, nt, dtype, group=32):
  """acc (o^T D fragments) += V^T @ p for the warp's tokens (pb: `p_fragments`); returns
  (acc, zacc). The value scales multiply p (B = p * s of the tile's channel group; 4
  groups, one HMUL2 per B register each) and the zero points go to zacc: per n the D
  fragment of [S; Z] [16, 8], rows r < 8 / r + 8 the sums over tokens of p s / p z of
  channel group r % 4, from one m16n8k16 per k-step whose A fragment is that group's scale
  chunk as loaded, [s, z, s, z] (no register copies); `publish_partial` adds Z."""
  _, _, _, ir, arith, _ = _mlir()
  ft = ir.F16Type.get() if dtype == "float16" else ir.BF16Type.get()
  tid, warp, r, q = lane_parts()
  ng = 128 // group   # value groups per token
  # 8 words (word u = 4 kk + channel quarter), 2 ng scale chunks (chunk ng kk + g: [jh][s, z])
  sbase = arith.muli(arith.addi(arith.muli(warp, const_i32(8 * ng)), q), const_i32(8))
  words = load16(vc, arith.muli(tid, const_i32(8))) + load16(
      vc, arith.addi(arith.muli(tid, const_i32(8)), const_i32(4)))
  chunks = [load16(vs, arith.addi(sbase, const_i32(32 * c)), ft) for c in range(2 * ng)]
  vp = word_codes(words, dtype)
  bv = {(g, kk, n): [ptx.hmul2(pb[kk, n][jh], chunks[ng * kk + g][2 * jh], dtype)
                     for jh in range(2)]
        for g in range(ng) for kk in range(2) for n in range(nt)}
  rg = arith.remui(r, const_i32(ng))
  for kk in range(2):
    chunk = load16(vs, arith.addi(sbase, arith.muli(arith.addi(rg, const_i32(ng * kk)),
                                                    const_i32(32))), ft)
    for n in range(nt):
      zacc[4 * n: 4 * n + 4] = ptx.mma_16816(chunk, pb[kk, n], zacc[4 * n: 4 * n + 4], dtype)
  for t in range(8):
    for kk in range(2):
      u = 4 * kk + t // 2
      a = [vp[(u, 4 * (t % 2) + reg)] for reg in range(4)]
      for n in range(nt):
        i = 32 * n + 4 * t
        acc[i:i + 4] = ptx.mma_16816(a, bv[t // (group // 16), kk, n], acc[i:i + 4], dtype)
  return acc, zacc


def block_step(slots, qb_arr, acc_arr, ml_arr, z_arr, valids, *, nt: int, dtype: str,
               scale2: float, ext=None, group: int = 32):
  """One step of this thread's warp over k 128-token blocks (its 32 tokens of each; k is the
  plan's group, 1 or 2): returns (acc, ml, zacc).

  slots: per block the ring slot's (kc, ks, vc, vs) [4, 256] codes and scales
  (`mosaic_layout`); valids: per block its number of valid tokens (every element);
  scale2: softmax scale * log2 e. Two blocks make one online-softmax step over their 64
  tokens: their key products, and then their value products, are independent chains that
  the scheduler interleaves (the loop is latency-bound).
  ext: None (KIVI), or a caller's extra terms with three hooks, all in place on this
  thread's scalars: `scores(j, qb)` returns its terms of block j's unscaled scores {(m, n):
  4 f32}, added before the mask and the softmax (qb: q's B fragments, as `qb` above),
  `rescale(alphas)` rescales its own running sums by the step's {(n, e): alpha}, and
  `values(j, pb, acc)` returns acc plus its terms of block j given p's B fragments
  (`p_fragments`) -- GEAR's low-rank residual (`kvlowrank_kernels.gear`).
  """
  _, _, _, ir, arith, _ = _mlir()
  f32 = ir.F32Type.get()
  qb, acc, ml, zacc = (scalars(a) for a in (qb_arr, acc_arr, ml_arr, z_arr))
  qb, qbm = qb[:16 * nt], qb[16 * nt:]  # `query_fragments`: q's fragments, then times f
  blocks = [(_key_scores(kc, ks, qb, qbm, nt=nt, dtype=dtype, group=group,
                         init=None if ext is None else ext.scores(j, qb)), scalars(valid)[0])
            for j, ((kc, ks, _, _), valid) in enumerate(zip(slots, valids))]
  ps, alphas, ml_out = _softmax(blocks, ml, nt=nt, scale2=scale2)
  acc = [arith.mulf(v, alphas[i // 32, i % 2]) for i, v in enumerate(acc)]
  zacc = [arith.mulf(v, alphas[i // 4, i % 2]) for i, v in enumerate(zacc)]
  if ext is not None:
    ext.rescale(alphas)
  for j, ((_, _, vc, vs), p) in enumerate(zip(slots, ps)):
    pb = p_fragments(p, dtype)
    acc, zacc = _value_products(vc, vs, pb, acc, zacc, nt=nt, dtype=dtype, group=group)
    if ext is not None:
      acc = ext.values(j, pb, acc)
  return as_array(acc, f32, None), as_array(ml_out, f32, None), as_array(zacc, f32, None)


def publish_partial(acc_arr, ml_arr, z_arr, wo, wml, nt: int, group: int = 32):
  """Writes the warp's unnormalised o^T (plus the zero-point sums Z of its channel group,
  `_value_products`) to wo [4 W, 128, NP] and its (max, sum) per query column to
  wml [4 W, 2, NP] (f32, shared memory; row: the warp's index in the CTA)."""
  _, _, mgpu_utils, ir, arith, vector = _mlir()
  f32 = ir.F32Type.get()
  index = ir.IndexType.get()
  _, _, r, q = lane_parts()
  gw = arith.index_cast(index, arith.divui(mgpu_utils.thread_idx(), const_i32(32)))
  idx = lambda v: arith.index_cast(index, v)
  acc, ml, zacc = scalars(acc_arr), scalars(ml_arr), scalars(z_arr)
  # Z [g, 2 q + e]: lane 4 g + q, D row 8 + g; o^T rows 16 t + .. are group t // (G / 16)
  for n in range(nt):
    zg = [[ptx.shfl_idx(zacc[4 * n + 2 + e], arith.addi(q, const_i32(4 * g)))
           for e in range(2)] for g in range(128 // group)]
    for i in range(32 * n, 32 * n + 32):
      acc[i] = arith.addf(acc[i], zg[(i % 32) // 4 // (group // 16)][i % 2])
  v2 = ir.VectorType.get([2], f32)
  for n in range(nt):
    col = idx(arith.addi(arith.muli(q, const_i32(2)), const_i32(8 * n)))
    m_pair = ml[4 * n: 4 * n + 2]
    l_pair = []
    for e in range(2):
      tot = ml[4 * n + 2 + e]
      for mask in (4, 8, 16):
        tot = arith.addf(tot, ptx.shfl_xor(tot, mask))
      l_pair.append(tot)
    for which, pair in ((0, m_pair), (1, l_pair)):
      vector.store(vector.from_elements(v2, pair), wml,
                   [gw, arith.constant(index, which), col])
    for t in range(8):
      for half in range(2):
        row = idx(arith.addi(r, const_i32(16 * t + 8 * half)))
        i = 32 * n + 4 * t + 2 * half
        vector.store(vector.from_elements(v2, acc[i:i + 2]), wo, [gw, row, col])


def merge_partials(wo, wml, o, lse, n_warps: int, np_: int, extra=None):
  """One warpgroup merges the n_warps partials: thread tau writes o [128, NP] row tau
  (normalised) and lse [NP] (natural log; -inf and o = 0 where no token was seen).
  extra: None, or a caller's hook `extra(weights)` -> NP f32 added to the row before the
  normalisation, given weights[j][h] (warp j's partial's weight in head h's merge; GEAR's
  value low-rank term, `kvlowrank_kernels.gear.mosaic_gear`)."""
  _, _, _, ir, arith, vector = _mlir()
  f32 = ir.F32Type.get()
  index = ir.IndexType.get()
  tid, _, _, _ = lane_parts()
  ci = lambda v: arith.constant(index, v)
  row = arith.index_cast(index, tid)
  vec = ir.VectorType.get([np_], f32)

  def load_vec(ref, idxs):
    v = vector.load(vec, ref, idxs)
    return [extract(v, h) for h in range(np_)]

  maxima = [load_vec(wml, [ci(j), ci(0), ci(0)]) for j in range(n_warps)]
  sums = [load_vec(wml, [ci(j), ci(1), ci(0)]) for j in range(n_warps)]
  big = list(maxima[0])
  for j in range(1, n_warps):
    big = [_fmax(x, y) for x, y in zip(big, maxima[j])]
  use = [arith.select(_is_neg_inf(x), f32c(0.0), x) for x in big]
  tot = [f32c(0.0)] * np_
  out = [f32c(0.0)] * np_
  weights = []
  for j in range(n_warps):
    vals = load_vec(wo, [ci(j), row, ci(0)])
    weights.append([])
    for h in range(np_):
      wgt = ptx.ex2(arith.subf(maxima[j][h], use[h]))
      weights[j].append(wgt)
      tot[h] = arith.addf(tot[h], arith.mulf(wgt, sums[j][h]))
      out[h] = arith.addf(out[h], arith.mulf(wgt, vals[h]))
  if extra is not None:
    out = [arith.addf(x, y) for x, y in zip(out, extra(weights))]
  has = [arith.cmpf(arith.CmpFPredicate.OGT, x, f32c(0.0)) for x in tot]
  safe = [arith.select(hh, x, f32c(1.0)) for hh, x in zip(has, tot)]
  o_row = [arith.divf(x, s) for x, s in zip(out, safe)]
  lse_row = [arith.select(hh, arith.mulf(arith.addf(u, ptx.lg2(s)), f32c(math.log(2.0))),
                          f32c(-math.inf)) for hh, u, s in zip(has, use, safe)]
  vector.store(vector.from_elements(vec, o_row), o, [row, ci(0)])
  vector.store(vector.from_elements(vec, lse_row), lse, [ci(0)])
