"""Palu fused latent decode attention in Pallas Mosaic GPU (Hopper: TMA, wgmma, warp roles).

Why a second backend next to `triton_palu`: the Triton kernel keeps a group's
reconstruction operands (128 KiB at Palu's 50% setting) in shared memory, so two
stages of latent tiles no longer fit beside them and each tile's loads and MMAs run
back to back. Here a producer warpgroup streams the tiles with TMA into rings while the
compute warpgroups work. Measurements (against the dense kernels, and of the schedule
choices below): BENCHMARKS.md.

Grid (B * Gr * g / HPP, num_splits); a CTA holds HPP KV heads of one group (their B_k
column slices resident in shared memory) and runs HPP + 1 warpgroups:
  * warpgroup HPP (producer): TMA copies of the key latent tile [T, rk] and the tile
    start's rotation row into a `stages`-slot ring, and of the value latent tile [T, rv]
    into a `v_stages`-slot ring, each slot reloaded as soon as every compute warpgroup
    released it; once, the in-tile cos/sin table;
  * warpgroup w < HPP (KV head j = part * HPP + w), per 64-token tile starting at t0:
      k = L @ B_k[:, jH : (j+1)H]                                          (wgmma, bf16)
      q~ = R(t0)^T q -> shared memory, while k is in the tensor pipe        (f32 -> f16)
      r = R(i) k, i = the in-tile offset (table held in registers)         (f32 -> f16)
      s [T, NP] = r @ q~^T                              (wgmma, A in registers, f16)
      online softmax over tokens (the tile's axis 0), p^T [NP, T] -> shared memory
      o^T [rv, NP] += V^T [rv, T] @ p                  (wgmma, bf16, f32 accumulator)
    using q . R(t0 + i) k = (R(t0)^T q) . (R(i) k): no per-token cos/sin stream. Tokens
    are the MMA M of the key products and the K of the value product, so no operand is
    padded to 64 rows: the NP = 8 or 16 query columns of a KV head (its QPK <= 16 heads,
    zero-padded) are the N of the two small products.
  * B_k's columns are interleaved so RoPE pair (d, d + H/2) is one register (two adjacent
    accumulator columns): one N = H key product, one K = H score product, the rotation
    written against the registers (`mosaic_fragments.rotate_pairs`).
  * the value product of a tile stays in flight and retires with the next tile's key
    product (wgmma groups retire in order); its ring slot is released then.
  * values (`mosaic_plan.plan`): "shared" where rv is a multiple of 64 * HPP and HPP >= 2
    (the CTA's KV heads share one [T, HPP * NP] value product, each warpgroup taking
    rv / HPP rows: HPP times fewer narrow wgmmas), else "per-head".
Split-K partials o^T [rv, NP] and lse [NP] per (KV head, split) go to global memory;
the wrapper drops the padding and merges them with `splitk.combine_partials`. One CTA fits
per SM, so the split count balances waves (`splitk.wave_balanced_splits`).

Choices (written down, as they differ from the Triton kernel where noted):
  * queries are pre-scaled by sm_scale * log2(e), rotated per tile in f32 and rounded to
    fp16; rotated keys are rounded to fp16 (the Triton GQA path does the same); p is rounded
    to bf16 for the value product (as in Triton); everything else accumulates in f32;
  * angles: fl(t0 * w) (f32 cos/sin per tile start) and fl(i * w) for i < 64 (fp16 cos/sin,
    <= 2**-12 absolute error); t0 * w + i * w differs from the reference's fl(t * w) by the
    f32 rounding of the angle, the same size as the reference's own rounding;
  * slots in [length, capacity) are read by the tile loads and masked to -inf before
    the softmax, so they must hold finite values (caches are zero-initialised);
  * bf16 latents, or both latents packed at 2 or 4 bits with fp16 scale/zero per (token,
    group) (`packed.PackedLatent`, rows without padding, <= 256 bytes); rk and rv multiples
    of 64, H = 128, QPK <= 16, no key bias, cache capacity a multiple of 8.

Packed latents (Palu's low-bit latents, read as the cache stores them): the producer
warpgroup becomes a converter (`_convert`). TMA streams each tile's codes and scale/zero
rows, the keys' into a `c_stages`-slot code ring, the values' into one slot that aliases the
cos/sin table; the warpgroup rewrites them into the key and value rings and arrives on the
ring slot's barrier where TMA arrived before (B_k and p in fp16: `latent_dtype`).
Neither tile is dequantized: the converter writes its codes centred and scaled by
powers of two, m_j (code - 2^(bits-1)) in fp16, exact (`mosaic_fragments.code_rows`: an
and-or and a subtraction per pair), and copies the tile's scales s and centred zeros z' = z
+ 2^(bits-1) s into float32 rings beside them. Keys: the key product runs on the centred
codes with B_k's rows divided by m_j, and the compute warpgroups form K = s ⊙ K' + z' 1^T
B_k on the float32 product before the rotation (`mosaic_plan.fold_key_operands`). Values:
the compute warpgroups multiply the tile by p^ = fp16(s ⊙ p) and keep the column sums
Σ z' ⊙ p (rescaled like l), so that V^T p = C'^T (s ⊙ p) + 1 (z'^T p) is recovered per
split partial by `mosaic_plan.fold_value_partials`. (Leaving the codes in the magic-number
form 1024 + m_j code saves the subtraction, but the product then carries 1024 Σ p^ through
the tensor cores' float32 accumulation, whose error scales with what it holds: the error
grew with the context; uncentred codes m_j code, whose mean cancels against Σ z p only
after the product, erred less but still more than the dequantizing converter. Measured:
results/decode_ablations.md, "the folded value product".)
Why: the converter warpgroup set the kernel's pace, limited by its instructions per code
(results/decode_ablations.md, "Palu 4-bit: where the converter's time goes").
A converted tile's columns come in `code_order`: B_k's rows are permuted to match and the
output's latent channels put back. Choices: the keys are rebuilt in float32 from exact
codes and fp16 B_k / m_j (the reference dequantizes in float32 and multiplies by B_k; the
bf16 path reads bf16 latents); s ⊙ p is rounded to fp16 for the value product (p to bf16
on the bf16 path).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

import numpy as np

from ..common import splitk
from . import mosaic_fragments as frag
from .mosaic_plan import (  # noqa: F401  (re-exported: the kernel's public planning API)
    AUTO_STAGES, AUTO_STAGES_PACKED, RED_PER_COL, SMEM_LIMIT, T, _smem_bytes, check_inputs,
    code_multipliers, code_order, fold_key_operands, fold_value_partials, latent_dtype,
    packed_bits, plan, query_columns, query_operand, rope_tables, shares_values,
    unpad_partials)

# Registers per thread of the compute and producer warpgroups (setmaxnreg). With HPP = 2
# compute warpgroups the launch gives each of the 3 warpgroups 168 (65536 / 384, rounded
# down to 8) and setmaxnreg.inc waits until the decreases free what it asks for, so a split
# over 3 x 168 = 504 would never start. With packed latents the producer converts codes and
# takes more (results/decode_ablations.md, "Palu 4-bit on the Mosaic kernel").
COMPUTE_REGISTERS = 232
PRODUCER_REGISTERS = 40
PACKED_REGISTERS = (216, 72)   # (compute, producer) with packed latents
assert 2 * COMPUTE_REGISTERS + PRODUCER_REGISTERS <= 504
assert 2 * PACKED_REGISTERS[0] + PACKED_REGISTERS[1] <= 504


def _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, base_ref, len_ref, o_ref, lse_ref, smem,
            bars, sz_refs=(), packed=(), sums_refs=()):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rv, gr, g, ns = p["hpp"], p["hh"], p["rv"], p["gr"], p["g"], p["num_splits"]
  stages, v_stages, np_ = p["stages"], p["v_stages"], p["np"]
  ldt = latent_dtype(p["bits"])
  shared = p["values"] == "shared"
  rvw = rv // hpp if shared else rv    # value-latent rows of this warpgroup's accumulator
  ncol = hpp * np_ if shared else np_  # its columns (shared: every head of the CTA)
  npart = g // hpp
  bk_s, q0_s, q_s, cos_s, x_s, l_s, base_s, v_s, p_s, red_s = smem
  (bk_bar, q_bar, rope_bar, l_bar, base_bar, v_bar, k_free, v_free, x_bar, p_free) = bars
  wgmma_layout = plgpu.Layout.WGMMA
  pid = lax.axis_index("p")
  sid = lax.axis_index("s")
  wg = lax.axis_index("wg")
  b = pid // (gr * npart)
  grp = (pid // npart) % gr
  part = pid % npart
  start, end, n_tiles = splitk.split_bounds(len_ref[b], ns, sid, T)

  def store_vector(x, dst, offset):
    """dst[offset + c] = x[c] for a [NP] column vector (WGMMA reduce(0) layout)."""
    @plgpu.inline_mgpu(arg_types=(wgmma_layout.reduce(0), plgpu.RefType()))
    def f(_, xv, ref):
      frag.store_vector(xv, ref, offset=offset)
    f(x, dst)

  def rotate(k, cs):
    """RoPE of interleaved key columns: `frag.rotate_pairs`."""
    @plgpu.inline_mgpu(arg_types=(wgmma_layout, wgmma_layout),
                       return_type=plgpu.ShapeDtypeStruct(k.shape, jnp.float16,
                                                          layout=wgmma_layout))
    def f(_, kv, csv):
      return frag.rotate_pairs(kv, csv)
    return f(k, cs)

  def compute(w):
    plgpu.set_max_registers(PACKED_REGISTERS[0] if packed else COMPUTE_REGISTERS,
                            action="increase")
    j = part * hpp + w                   # KV head within the group
    kv = (b * gr + grp) * g + j          # global KV head (q / output row)
    # (`+ 0 * hh` and barrier w * 2 of 2 * hpp: as the removed two-halves layout lowered
    # them, so that the lowered module of this layout did not change.)
    plgpu.copy_gmem_to_smem(bk_ref.at[grp, :, pl.ds(j * 2 * hh + 0 * hh, 2 * hh)],
                            bk_s.at[w], bk_bar.at[w * 2])
    plgpu.copy_gmem_to_smem(q_ref.at[kv], q0_s.at[w], q_bar.at[w])
    if packed:  # 1^T B_k of this head's columns (the key tiles' zeros: `_convert`)
      plgpu.copy_gmem_to_smem(sz_refs[4].at[grp, pl.ds(j * 2 * hh, 2 * hh)], packed[6].at[w],
                              bk_bar.at[w * 2 + 1])
    plgpu.barrier_wait(bk_bar.at[w * 2])
    plgpu.barrier_wait(q_bar.at[w])
    plgpu.barrier_wait(rope_bar.at[0])
    # q^T halves [H/2, NP] (f32, pre-scaled): rotated per tile by the tile start's angles.
    q1 = plgpu.load(q0_s.at[w, 0], (), layout=wgmma_layout)
    q2 = plgpu.load(q0_s.at[w, 1], (), layout=wgmma_layout)
    col_layout = wgmma_layout.reduce(0)
    if packed:
      plgpu.barrier_wait(bk_bar.at[w * 2 + 1])
    m_i = plgpu.layout_cast(jnp.full((np_,), -jnp.inf, jnp.float32), col_layout)
    l_t = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
    acc0 = plgpu.layout_cast(jnp.zeros((rvw, ncol), jnp.float32), wgmma_layout)
    rows = plgpu.broadcasted_iota(jnp.int32, (T, np_), 0, layout=wgmma_layout)
    rope_regs = plgpu.load(cos_s, (), layout=wgmma_layout)  # in-tile cos/sin pairs
    if packed:  # cos_free: the table's memory takes the value codes from now on (`_convert`)
      plgpu.barrier_arrive(packed[-1])

    def rotate_queries(slot):
      """q . R(t0 + i) k = (R(t0)^T q) . (R(i) k): the queries take the tile start's
      rotation (a row of the key ring's slot), the keys the in-tile offset's."""
      plgpu.barrier_wait(base_bar.at[slot])
      row = wgmma_layout.reduce(1)
      cb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 0], (), layout=row), (hh, np_), [0])
      sb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 1], (), layout=row), (hh, np_), [0])
      qr1 = (q1 * cb + q2 * sb).astype(jnp.float16)
      qr2 = (q2 * cb - q1 * sb).astype(jnp.float16)
      # query column d of each half -> K index 2d (first half), 2d + 1 (second)
      frag.store_transposed(qr1, q_s.at[w], 2, 0)
      frag.store_transposed(qr2, q_s.at[w], 2, 1)
      plgpu.commit_smem()

    def scores(kf):
      r = rotate(kf, rope_regs)

      def scores_p(s_ref):
        plgpu.wgmma(s_ref, r, plgpu.transpose_ref(q_s.at[w], (1, 0)))
        return s_ref[...]
      return pl.run_scoped(scores_p, plgpu.ACC((T, np_), jnp.float32))

    def softmax(sc, t0, m_i, l_t):
      """Online softmax over the tile's tokens: (m_new, l_t, p, alpha = the rescale)."""
      sc = jnp.where(rows + t0 < end, sc, -jnp.inf)
      m_new = jnp.maximum(m_i, frag.col_reduce("max", sc, red_s.at[w]))
      alpha = jnp.exp2(m_i - m_new)
      pr = jnp.exp2(sc - lax.broadcast_in_dim(m_new, (T, np_), [1]))
      l_t = l_t * lax.broadcast_in_dim(alpha, (T, np_), [1]) + pr
      return m_new, l_t, pr, alpha

    def value_probabilities(i, pr, alpha, sums):
      """The value product's B operand rows: p (bf16 / fp16); with packed latents, whose
      value tile arrives as centred, scaled codes (`_convert`), p^ = fp16(s ⊙ p) with the
      tile's scales s, after waiting for the tile, and the running column sums Σ z' ⊙ p of
      its centred zeros z', rescaled like l (`mosaic_plan.fold_value_partials`)."""
      if not packed:
        return pr.astype(ldt), sums
      vslot = lax.rem(i, v_stages)
      plgpu.barrier_wait(v_bar.at[vslot])
      row = wgmma_layout.reduce(1)
      sc, zc = (lax.broadcast_in_dim(plgpu.load(packed[4].at[vslot, a], (), layout=row),
                                     (T, np_), [0]) for a in (0, 1))
      ph = (pr * sc).astype(ldt)
      a_b = lax.broadcast_in_dim(alpha, (T, np_), [1])
      (s2,) = sums
      return ph, (s2 * a_b + pr * zc,)

    def retire_values(vslot):
      """The value product reading ring slot vslot (and p^T) has retired: release both."""
      plgpu.barrier_arrive(v_free.at[vslot])
      if shared:
        plgpu.barrier_arrive(p_free)

    def value_mma(acc_ref, v_tile, p_tile):
      """o^T += V^T @ p into the accumulator ref, left in flight: the next tile's key
      product retires it (wgmma groups retire in order)."""
      plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_tile, (1, 0)),
                  plgpu.transpose_ref(p_tile, (1, 0)))

    def own_values(i, acc_ref, pr, alpha, sums):
      """values="per-head": o^T [rv, NP] += V^T [rv, T] @ p [T, NP] for this KV head."""
      acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (rv, np_), [1])
      ph, sums = value_probabilities(i, pr, alpha, sums)
      frag.store_transposed(ph, p_s.at[w])
      plgpu.commit_smem()
      vslot = lax.rem(i, v_stages)
      if not packed:
        plgpu.barrier_wait(v_bar.at[vslot])
      value_mma(acc_ref, v_s.at[vslot], p_s.at[w])
      return sums

    def exchange(vec, k):
      """Every warpgroup's [NP] column vector -> all heads' [hpp * NP] (shared values), the
      k-th exchange: x_s has two slots, so slot k % 2 is rewritten only after every warpgroup
      passed exchange k + 1, i.e. read exchange k."""
      slot = x_s.at[lax.rem(k, 2)]
      store_vector(vec, slot, w * np_)
      plgpu.commit_smem()
      plgpu.barrier_arrive(x_bar)
      plgpu.barrier_wait(x_bar)
      return plgpu.load(slot, (), layout=col_layout)

    def shared_values(i, acc_ref, pr, alpha, sums):
      """values="shared": the CTA's KV heads share the value latent, so their probabilities
      form one [T, hpp * NP] operand and warpgroup w computes rows [w rv / hpp, (w + 1) rv /
      hpp) of o^T for all of them: hpp times fewer N = NP wgmmas per warpgroup."""
      @pl.when(i > 0)
      def _():
        plgpu.barrier_wait(p_free)  # every warpgroup's value product of tile i - 1 retired
      ph, sums = value_probabilities(i, pr, alpha, sums)
      frag.store_transposed(ph, p_s.at[pl.ds(w * np_, np_)])
      alphas = exchange(alpha, i)  # also publishes the p^T rows (commit + barrier)
      acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alphas, (rvw, ncol), [1])
      vslot = lax.rem(i, v_stages)
      if not packed:
        plgpu.barrier_wait(v_bar.at[vslot])
      value_mma(acc_ref, v_s.at[vslot, :, pl.ds(w * rvw, rvw)], p_s)
      return sums

    def key_product(slot):
      """The tile's key reconstruction (wgmma); the query rotation runs while it is in the
      tensor pipe. Waiting for it also retires the previous tile's value product."""
      def keys_p(k_ref):
        plgpu.wgmma(k_ref, l_s.at[slot], bk_s.at[w])
        rotate_queries(slot)
        return k_ref[...]
      return pl.run_scoped(keys_p, plgpu.ACC((T, 2 * hh), jnp.float32))

    def step(i, carry, acc_ref):
      m_i, l_t, sums = carry
      slot = lax.rem(i, stages)
      t0 = start + i * T
      plgpu.barrier_wait(l_bar.at[slot])
      kf = key_product(slot)
      if packed:  # K = s ⊙ K' + z' 1^T B_k for the tile of centred key codes (`_convert`)
        row = wgmma_layout.reduce(1)
        sk, zk = (lax.broadcast_in_dim(plgpu.load(packed[5].at[slot, a], (), layout=row),
                                       (T, 2 * hh), [0]) for a in (0, 1))
        # 1^T B_k read from shared memory per tile, not held across the loop (64 registers)
        b_sum = lax.broadcast_in_dim(plgpu.load(packed[6].at[w], (), layout=col_layout),
                                     (T, 2 * hh), [1])
        kf = kf * sk + zk * b_sum
      plgpu.barrier_arrive(k_free.at[slot])
      sc = scores(kf)
      # tile i - 1's value product retired with the key product
      pl.when(i > 0)(functools.partial(retire_values, lax.rem(i + v_stages - 1, v_stages)))
      m_new, l_t, pr, alpha = softmax(sc, t0, m_i, l_t)
      sums = (shared_values if shared else own_values)(i, acc_ref, pr, alpha, sums)
      return m_new, l_t, sums

    sums0 = (l_t,) if packed else ()   # zeros [T, NP]: Σ z' ⊙ p (packed latents)

    def run(acc_ref):
      acc_ref[...] = acc0
      m, l, sums = lax.fori_loop(0, n_tiles, functools.partial(step, acc_ref=acc_ref),
                                 (m_i, l_t, sums0))
      return acc_ref[...], m, l, sums
    acc, m_i, l_t, sums = pl.run_scoped(run, plgpu.ACC((rvw, ncol), jnp.float32))
    l_i = frag.col_reduce("add", l_t, red_s.at[w])
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    lse = jnp.where(has, (m_i + jnp.log2(l_safe)) * math.log(2.0), -jnp.inf)
    # packed latents: c2 = Σ z' ⊙ p / l per column, beside lse
    cols = [frag.col_reduce("add", x, red_s.at[w]) / l_safe for x in sums]
    if shared:  # o [P, splits, rv, hpp * NP]: this warpgroup's rows, every head's columns
      l_all = exchange(l_safe, n_tiles)
      o_ref.at[pid, sid, pl.ds(w * rvw, rvw)][...] = acc / lax.broadcast_in_dim(
          l_all, (rvw, ncol), [1])
      lse_ref.at[pid, sid, pl.ds(w * np_, np_)][...] = lse
      for ref, x in zip(sums_refs, cols):
        ref.at[pid, sid, pl.ds(w * np_, np_)][...] = x
    else:
      o_ref.at[kv, sid][...] = acc / lax.broadcast_in_dim(l_safe, (rv, np_), [1])
      lse_ref.at[kv, sid][...] = lse
      for ref, x in zip(sums_refs, cols):
        ref.at[kv, sid][...] = x

  for w in range(hpp):
    pl.when(wg == w)(functools.partial(compute, w))

  @pl.when(wg == hpp)
  def _producer():
    plgpu.set_max_registers(PACKED_REGISTERS[1] if packed else PRODUCER_REGISTERS,
                            action="decrease")
    plgpu.copy_gmem_to_smem(cos_ref, cos_s, rope_bar.at[0])
    if packed:
      _convert(p, b, grp, start, n_tiles, hk_ref, hv_ref, sz_refs, base_ref, packed,
               (l_s, base_s, v_s), (base_bar, l_bar, v_bar, k_free, v_free))
      return

    def load_keys(i, slot):
      t0 = start + i * T
      plgpu.copy_gmem_to_smem(hk_ref.at[b, pl.ds(t0, T), grp], l_s.at[slot], l_bar.at[slot])
      plgpu.copy_gmem_to_smem(base_ref.at[t0 // T], base_s.at[slot], base_bar.at[slot])

    def load_values(i, slot):
      plgpu.copy_gmem_to_smem(hv_ref.at[b, pl.ds(start + i * T, T), grp], v_s.at[slot],
                              v_bar.at[slot])

    for i in range(stages):
      pl.when(i < n_tiles)(functools.partial(load_keys, i, i))
    for i in range(v_stages):
      pl.when(i < n_tiles)(functools.partial(load_values, i, i))

    @pl.loop(0, n_tiles)
    def _(i):
      slot = lax.rem(i, stages)

      @pl.when(i + stages < n_tiles)
      def _():
        plgpu.barrier_wait(k_free.at[slot])
        load_keys(i + stages, slot)

      vslot = lax.rem(i, v_stages)

      @pl.when(i + v_stages < n_tiles)
      def _():
        plgpu.barrier_wait(v_free.at[vslot])
        load_values(i + v_stages, vslot)


def _convert(p, b, grp, start, n_tiles, hk_ref, hv_ref, sz_refs, base_ref, packed, rings,
             bars):
  """The producer warpgroup's body with packed latents: it streams codes and writes the key
  and value tiles as centred, scaled codes (`mosaic_fragments.code_rows`, their scale/zero
  rows beside them) into the key and value rings that the compute warpgroups read,
  arriving on a ring slot's barrier once its tile is written and made visible to wgmma
  (where a TMA copy arrived before).

  Code rings: the key codes and scale/zero rows in `c_stages` slots, TMA'd `c_stages` tiles
  ahead; the value codes and rows in one slot that aliases the in-tile cos/sin table (dead
  once both compute warpgroups hold it in registers: `cos_free`), reloaded as soon as a
  tile is converted. Per iteration i: the values of tile i, then the keys of tile i + 1
  (the keys of tile 0 before the loop), so that both run a tile ahead of the compute
  warpgroups whenever the rings have a second slot."""
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  kc_s, ksz_s, vc_s, vsz_s, vsr_s, ksr_s, _, ck_bar, cv_bar, cos_free = packed
  l_s, base_s, v_s = rings
  base_bar, l_bar, v_bar, k_free, v_free = bars
  stages, v_stages, cs, gr, bits = p["stages"], p["v_stages"], p["c_stages"], p["gr"], p["bits"]
  rows = T * gr // 8
  tokens = lambda i: pl.ds(start + i * T, T)
  tile_rows = lambda i: pl.ds((start // T + i) * rows, rows)
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(swizzled)))
  def centred_codes(_, codes, dst):
    frag.code_rows(codes, dst, bits=bits)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
  def scale_rows(_, sz, dst, g):
    frag.copy_scale_rows(sz, dst, g.registers.item(), groups=gr, bits=bits)

  def load_codes(i, codes_ref, scale_refs, codes_dst, sz_dst, bar):
    """Tile i's codes and its scale and zero rows (into sz_dst(0), sz_dst(1)), three TMA
    copies on one barrier."""
    plgpu.copy_gmem_to_smem(codes_ref.at[b, tokens(i), grp], codes_dst, bar)
    for a in range(2):
      plgpu.copy_gmem_to_smem(scale_refs[a].at[b, tile_rows(i)], sz_dst(a), bar)

  def load_keys(i):
    slot = lax.rem(i, cs)
    load_codes(i, hk_ref, sz_refs[:2], kc_s.at[slot], lambda a: ksz_s.at[slot, a],
               ck_bar.at[slot])

  def load_values(i):
    load_codes(i, hv_ref, sz_refs[2:], vc_s, lambda a: vsz_s.at[a], cv_bar)

  def keys(i):
    cslot, slot = lax.rem(i, cs), lax.rem(i, stages)
    plgpu.barrier_wait(ck_bar.at[cslot])
    pl.when(i >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
    plgpu.copy_gmem_to_smem(base_ref.at[start // T + i], base_s.at[slot], base_bar.at[slot])
    scale_rows(ksz_s.at[cslot], ksr_s.at[slot], grp)
    centred_codes(kc_s.at[cslot], l_s.at[slot])   # ends with the warpgroup's barrier
    plgpu.commit_smem()
    plgpu.barrier_arrive(l_bar.at[slot])
    pl.when(i + cs < n_tiles)(lambda: load_keys(i + cs))

  def values(i):
    vslot = lax.rem(i, v_stages)
    plgpu.barrier_wait(cv_bar)
    pl.when(i >= v_stages)(lambda: plgpu.barrier_wait(v_free.at[vslot]))
    scale_rows(vsz_s, vsr_s.at[vslot], grp)   # read by the compute warpgroups (generic loads)
    centred_codes(vc_s, v_s.at[vslot])           # ends with the warpgroup's barrier
    plgpu.commit_smem()
    plgpu.barrier_arrive(v_bar.at[vslot])
    pl.when(i + 1 < n_tiles)(lambda: load_values(i + 1))

  for i in range(cs):
    pl.when(i < n_tiles)(functools.partial(load_keys, i))

  @pl.when(n_tiles > 0)
  def _():
    keys(0)
    plgpu.barrier_wait(cos_free)
    load_values(0)

  @pl.loop(0, n_tiles)
  def _(i):
    values(i)
    pl.when(i + 1 < n_tiles)(lambda: keys(i + 1))


def _call(p, qt, hk, hv, bk, cs, sin, base, lengths, sz=()):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rk, rv, stages = p["hpp"], p["hh"], p["rk"], p["rv"], p["stages"]
  v_stages, np_, bits, c_stages = p["v_stages"], p["np"], p["bits"], p["c_stages"]
  ldt = latent_dtype(bits)
  kvh = p["b"] * p["gr"] * p["g"]
  shared = p["values"] == "shared"
  ns = p["num_splits"]

  def sw(dt_bytes, minor_elems):
    swz = minor_elems * dt_bytes
    return (plgpu.TilingTransform((8, minor_elems)), plgpu.SwizzleTransform(swz))

  k_tf = sw(2, hh)   # key latent tiles: (8, H/2), 128-byte swizzle
  pv_tf = sw(2, 64)  # B_k, cos/sin pairs, value tile, p^T, rotated queries: (8, 64), 128 B

  def entry(q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref, len_ref, *rest):
    n_out = 3 if bits is not None else 2   # o, lse (and the folded values' c2)
    sz_refs, (o_ref, lse_ref, *sums_refs) = rest[:-n_out], rest[-n_out:]
    del sin_ref  # an unused 1-element placeholder (kept: see `palu_attention_mosaic`)
    scratch = [
        plgpu.SMEM((hpp, rk, 2 * hh), ldt, transforms=pv_tf),            # B_k [rk, H]
        plgpu.SMEM((hpp, 2, hh, np_), jnp.float32),                      # queries^T
        plgpu.SMEM((hpp, np_, 2 * hh), jnp.float16, transforms=pv_tf),   # rotated queries
        plgpu.SMEM((T, 2 * hh), jnp.float16, transforms=pv_tf),          # cos/sin pairs
        # the values="shared" column exchange, else an unused 1-element placeholder
        (plgpu.SMEM((2, hpp * np_), jnp.float32) if shared
         else plgpu.SMEM((1,), jnp.float16)),
        plgpu.SMEM((stages, T, rk), ldt, transforms=k_tf),
        plgpu.SMEM((stages, 2, hh), jnp.float32),
        plgpu.SMEM((v_stages, T, rv), ldt, transforms=pv_tf),
        plgpu.SMEM((hpp * np_, T) if shared else (hpp, np_, T), ldt,
                   transforms=pv_tf),
        # FragmentedArray.reduce stores 128 threads x vec_len (2) f32 per 8 columns.
        plgpu.SMEM((hpp, RED_PER_COL * np_), jnp.float32),
    ]
    bars = [
        plgpu.Barrier(num_barriers=2 * hpp),  # B_k slices (2 w), packed: 1^T B_k (2 w + 1)
        plgpu.Barrier(num_barriers=hpp),
        plgpu.Barrier(num_barriers=2),        # cos/sin table (the first is used)
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=v_stages),
        plgpu.Barrier(num_arrivals=hpp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=hpp, num_barriers=v_stages),
        plgpu.Barrier(num_arrivals=hpp) if shared else None,  # column exchange
        plgpu.Barrier(num_arrivals=hpp) if shared else None,  # p^T consumed
    ]
    packed = []
    if bits is not None:
      # The value code slot aliases the cos/sin table (`_convert`); the key code ring, its
      # barriers (3 copies each), and the barrier of the table's last read.
      rows = T * p["gr"] // 8
      sdt = sz[0].dtype
      scratch[3] = plgpu.RefUnion(scratch[3], (plgpu.SMEM((T, rv * bits // 8), jnp.uint8),
                                               plgpu.SMEM((2, rows, 8), sdt)))
      packed = [plgpu.SMEM((c_stages, T, rk * bits // 8), jnp.uint8),
                plgpu.SMEM((c_stages, 2, rows, 8), sdt),
                plgpu.SMEM((v_stages, 2, T), jnp.float32),   # value tiles' scale/zero rows
                plgpu.SMEM((stages, 2, T), jnp.float32),     # key tiles' scale/zero rows
                plgpu.SMEM((hpp, 2 * hh), jnp.float32),      # 1^T B_k per head
                plgpu.Barrier(num_arrivals=3, num_barriers=c_stages),
                plgpu.Barrier(num_arrivals=3),
                plgpu.Barrier(num_arrivals=hpp)]

    def body(*refs):
      smem, bar_refs, extra = list(refs[:10]), refs[10:20], refs[20:]
      if extra:  # the union: (cos/sin table, (value codes, value scale rows))
        smem[3], (vc_s, vsz_s) = smem[3]
        extra = (extra[0], extra[1], vc_s, vsz_s, *extra[2:])
      _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, base_ref, len_ref, o_ref, lse_ref,
              smem, bar_refs, sz_refs=sz_refs, packed=extra, sums_refs=sums_refs)
    pl.run_scoped(body, *scratch, *bars, *packed, collective_axes="wg")

  if shared:  # per CTA: [splits, rv, heads x NP]
    out_types = (jax.ShapeDtypeStruct((kvh // hpp, ns, rv, hpp * np_), jnp.float32),
                 jax.ShapeDtypeStruct((kvh // hpp, ns, hpp * np_), jnp.float32))
  else:
    out_types = (jax.ShapeDtypeStruct((kvh, ns, rv, np_), jnp.float32),
                 jax.ShapeDtypeStruct((kvh, ns, np_), jnp.float32))
  if bits is not None:  # c2 of the folded value product, shaped like lse
    out_types += (out_types[1],)
  return plgpu.kernel(
      entry, out_type=out_types, grid=p["grid"], grid_names=("p", "s"),
      num_threads=hpp + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(qt, hk, hv, bk, cs, sin, base, lengths, *sz)


def palu_attention_mosaic(q, hk, hv, b_k, lengths, inv_freq, *, k_bias=None, scale=None,
                          out_dtype=None, heads_per_program=2, stages=None, v_stages=None,
                          num_splits=None, target_programs=None, return_partials=False,
                          rope=None, c_stages=None):
  """Fused Palu decode attention (Mosaic GPU); same contract as the reference.

  Args (beyond the reference's): inv_freq [H/2] float32; heads_per_program (KV heads per
    CTA, one compute warpgroup each), stages (key-latent ring depth), v_stages (value
    ring depth; both None: the deepest that fit), num_splits, target_programs: launch
    knobs (see `plan`); return_partials: also return the split-K partials; rope: optional
    precomputed `rope_tables(inv_freq, S)` (a model builds them once); c_stages: the key
    code ring's depth with packed latents (see `plan`).
    hk, hv: bf16 latents, or both `PackedLatent` of 2 or 4 bits with fp16 scales
    (`check_inputs`), read as codes by the kernel (module docstring).
  """
  check_inputs(hk, hv, k_bias)
  h = q.shape[-1]
  scale = h ** -0.5 if scale is None else float(scale)
  bits = packed_bits(hk)
  p = plan(q.shape, hk.shape, hv.shape, b_k.shape, heads_per_program=heads_per_program,
           stages=stages, v_stages=v_stages, num_splits=num_splits,
           target_programs=target_programs, bits=bits, c_stages=c_stages)
  cos, sin, base = rope_tables(inv_freq, p["s"]) if rope is None else rope
  # Column d of each RoPE half -> 2d (first half), 2d + 1 (second): B_k's columns and the
  # cos/sin table interleaved, so that a rotation pair is one register.
  gr, rk, gh = b_k.shape
  b_k = b_k.astype(latent_dtype(bits))
  b_k = b_k.reshape(gr, rk, gh // h, 2, h // 2).swapaxes(-1, -2).reshape(gr, rk, gh)
  if bits is not None:  # B_k for the key tiles of centred codes, and 1^T B_k
    b_k, b_sum = fold_key_operands(b_k, bits)
  # (The 1-element `sin` operand, the unused second cos/sin barrier and the per-head
  # placeholder scratch slot are leftovers of the removed two-halves layout, kept so that
  # the lowered module did not change when it went; they cost a few bytes.)
  cs, sin = jnp.stack([cos, sin], -1).reshape(T, h), jnp.zeros((1,), jnp.float16)
  if bits is None:
    lat, sz = (hk.astype(jnp.bfloat16), hv.astype(jnp.bfloat16)), ()
  else:
    # The cache's own arrays: codes as stored, each scale/zero [B, S, Gr] read as rows of
    # 8 (a free reshape), so that a tile's rows of every group are one TMA box.
    b, s = hk.shape[:2]
    rows = lambda a: a.reshape(b, s * gr // 8, 8)
    lat = (hk.codes, hv.codes)
    sz = tuple(rows(a) for a in (hk.scale, hk.zero, hv.scale, hv.zero)) + (b_sum,)
  o_t, lse_t, *sums = _call(p, query_operand(q, p, scale), *lat, b_k, cs, sin, base,
                            lengths.astype(jnp.int32), sz)
  if bits is not None:  # the value tile's scale and zero, left out of the kernel's product
    o_t = fold_value_partials(o_t, *sums, p)
  o, lse = unpad_partials(o_t, lse_t, p)
  if bits is not None:  # output row c of the converted value tile is latent channel order[c]
    o = o[..., np.argsort(code_order(p["rv"], bits))]
  return splitk.combine_result(o, lse, out_dtype or q.dtype, return_partials)
