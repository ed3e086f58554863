"""Palu fused latent decode attention in Pallas Mosaic GPU (Hopper: TMA, wgmma, warp roles).

Why a second backend next to `triton_palu`: the Triton kernel keeps a group's
reconstruction operands (128 KiB at Palu's 50% setting) in shared memory, so two
stages of latent tiles no longer fit beside them and each tile's loads and MMAs run
back to back (BENCHMARKS.md). Here a producer warpgroup streams the tiles with TMA
into rings while the compute warpgroups work.

Grid (B * Gr * g / HPP, num_splits); a CTA holds HPP KV heads of one group (their B_k
column slices resident in shared memory) and runs HPP + 1 warpgroups:
  * warpgroup HPP (producer): TMA copies of the key latent tile [T, rk] and the tile
    start's rotation row into a `stages`-slot ring, and of the value latent tile [T, rv]
    into a `v_stages`-slot ring, each slot reloaded as soon as every compute warpgroup
    released it; once, the in-tile cos/sin table;
  * warpgroup w < HPP (KV head j = part * HPP + w), per 64-token tile starting at t0:
      q~ = R(t0)^T q  -> shared memory (the B operand of the scores)      (f32 -> f16)
      k = L @ B_k[:, jH : (j+1)H]                                          (wgmma, bf16)
      r = R(i) k, i = the in-tile offset (resident table)                   (f32 -> f16)
      s [T, NP] = r @ q~^T                              (wgmma, A in registers, f16)
      online softmax over tokens (the tile's axis 0), p^T [NP, T] -> shared memory
      o^T [rv, NP] += V^T [rv, T] @ p                  (wgmma, bf16, f32 accumulator)
    using q . R(t0 + i) k = (R(t0)^T q) . (R(i) k): no per-token cos/sin stream. Tokens
    are the MMA M of the key products and the K of the value product, so no operand is
    padded to 64 rows: the NP = 8 or 16 query columns of a KV head (its QPK <= 16 heads,
    zero-padded) are the N of the two small products.
  * layout="pairs" (default): B_k's columns are interleaved so RoPE pair (d, d + H/2) is
    one register (two adjacent accumulator columns): one N = H key product, one K = H
    score product, the rotation written against the registers (`mosaic_fragments`).
    layout="halves": two N = H/2 products and two K = H/2 score products (ablation).
Split-K partials o^T [rv, NP] and lse [NP] per (KV head, split) go to global memory;
the wrapper drops the padding and merges them with `splitk.combine_partials`. One CTA fits
per SM, so the split count balances waves (`splitk.wave_balanced_splits`).

Measured (H200, interleaved A/B rounds, BENCHMARKS.md "eighth session"): 1.00-1.16x the
cuDNN dense kernel at 16K/B=8 and 64K/B=32 (Llama-3 16K/B=8: 143.3 us, cuDNN 144.4 us), and
0-8.6% faster than the sixth session's schedule (values="per-head", overlap="none"). The
kernel's own profiler trace (`profile_dir`, `experiments/mosaic_trace.py`) shows a compute
warpgroup busy ~3,700-4,000 cycles per tile: about half in its wgmmas (the N = NP products
run at 18-30% of the matmul rate, `experiments/bench_wgmma_shapes.py`), half in RoPE,
softmax and the query rotation, with little time waiting for data. FA3-style ping-pong
was measured slower (removed after commit dae91b8).
Defaults: values="shared" where it applies (the CTA's KV heads share one [T, hpp * NP]
value product, each warpgroup taking rv / hpp rows: half the narrow wgmmas) and
overlap="all" (the query rotation runs under the key product; the value product stays in
flight until the next tile's key product retires it).

Choices (written down, as they differ from the Triton kernel where noted):
  * queries are pre-scaled by sm_scale * log2(e), rotated per tile in f32 and rounded to
    fp16; rotated keys are rounded to fp16 (the Triton GQA path does the same); p is rounded
    to bf16 for the value product (as in Triton); everything else accumulates in f32;
  * angles: fl(t0 * w) (f32 cos/sin per tile start) and fl(i * w) for i < 64 (fp16 cos/sin,
    <= 2**-12 absolute error); t0 * w + i * w differs from the reference's fl(t * w) by the
    f32 rounding of the angle, the same size as the reference's own rounding;
    rope_math="f32-regs" (default) keeps the in-tile table in registers, "f32" re-reads it
    from shared memory, "f16" (halves only) rotates in packed half precision;
  * slots in [length, capacity) are read by the tile loads and masked to -inf before
    the softmax, so they must hold finite values (caches are zero-initialised);
  * bf16 latents only (packed latents stay on the Triton kernel), rk and rv multiples
    of 64, H = 128, QPK <= 16, no key bias, cache capacity a multiple of 8.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..common import splitk
from . import mosaic_fragments as frag
from .mosaic_plan import (  # noqa: F401  (re-exported: the kernel's public planning API)
    AUTO_STAGES, RED_PER_COL, SMEM_LIMIT, T, _smem_bytes, check_inputs, plan, query_columns,
    query_operand, rope_tables, unpad_partials)


def _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref, len_ref, o_ref,
            lse_ref, smem, bars):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rv, gr, g, ns = p["hpp"], p["hh"], p["rv"], p["gr"], p["g"], p["num_splits"]
  stages, v_stages, skip, np_ = p["stages"], p["v_stages"], p["skip"], p["np"]
  rope_math, pairs = p["rope_math"], p["layout"] == "pairs"
  early_q = p["overlap"] in ("queries", "all")  # query rotation under the key product
  async_v = p["overlap"] == "all"  # value product in flight until the next key product
  shared = p["values"] == "shared"
  rvw = rv // hpp if shared else rv    # value-latent rows of this warpgroup's accumulator
  ncol = hpp * np_ if shared else np_  # its columns (shared: every head of the CTA)
  npart = g // hpp
  bk_s, q0_s, q_s, cos_s, sin_s, l_s, base_s, v_s, p_s, red_s = smem
  x_s = sin_s  # values="shared" (layout "pairs", no sin table): the column exchange
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
    """RoPE of interleaved key columns (layout='pairs'): `frag.rotate_pairs`."""
    @plgpu.inline_mgpu(arg_types=(wgmma_layout, wgmma_layout),
                       return_type=plgpu.ShapeDtypeStruct(k.shape, jnp.float16,
                                                          layout=wgmma_layout))
    def f(_, kv, csv):
      return frag.rotate_pairs(kv, csv)
    return f(k, cs)

  def compute(w):
    plgpu.set_max_registers(232, action="increase")
    j = part * hpp + w                   # KV head within the group
    kv = (b * gr + grp) * g + j          # global KV head (q / output row)
    for half in range(1 if pairs else 2):
      width = 2 * hh if pairs else hh
      plgpu.copy_gmem_to_smem(bk_ref.at[grp, :, pl.ds(j * 2 * hh + half * hh, width)],
                              bk_s.at[w] if pairs else bk_s.at[w, half], bk_bar.at[w * 2 + half])
    plgpu.copy_gmem_to_smem(q_ref.at[kv], q0_s.at[w], q_bar.at[w])
    for half in range(1 if pairs else 2):
      plgpu.barrier_wait(bk_bar.at[w * 2 + half])
    plgpu.barrier_wait(q_bar.at[w])
    plgpu.barrier_wait(rope_bar.at[0])
    if not pairs:
      plgpu.barrier_wait(rope_bar.at[1])
    # q^T halves [H/2, NP] (f32, pre-scaled): rotated per tile by the tile start's angles.
    q1 = plgpu.load(q0_s.at[w, 0], (), layout=wgmma_layout)
    q2 = plgpu.load(q0_s.at[w, 1], (), layout=wgmma_layout)
    col_layout = wgmma_layout.reduce(0)
    m_i = plgpu.layout_cast(jnp.full((np_,), -jnp.inf, jnp.float32), col_layout)
    l_t = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
    acc0 = plgpu.layout_cast(jnp.zeros((rvw, ncol), jnp.float32), wgmma_layout)
    rows = plgpu.broadcasted_iota(jnp.int32, (T, np_), 0, layout=wgmma_layout)
    rope_regs = None
    if rope_math == "f32-regs" and pairs:
      rope_regs = plgpu.load(cos_s, (), layout=wgmma_layout)
    elif rope_math == "f32-regs":
      rope_regs = (plgpu.load(cos_s, (), layout=wgmma_layout).astype(jnp.float32),
                   plgpu.load(sin_s, (), layout=wgmma_layout).astype(jnp.float32))

    def rotate_queries(slot):
      """q . R(t0 + i) k = (R(t0)^T q) . (R(i) k): the queries take the tile start's
      rotation (a row of the key ring's slot), the keys the in-tile offset's."""
      plgpu.barrier_wait(base_bar.at[slot])
      row = wgmma_layout.reduce(1)
      cb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 0], (), layout=row), (hh, np_), [0])
      sb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 1], (), layout=row), (hh, np_), [0])
      qr1 = (q1 * cb + q2 * sb).astype(jnp.float16)
      qr2 = (q2 * cb - q1 * sb).astype(jnp.float16)
      if pairs:  # query column d of each half -> K index 2d (first half), 2d + 1 (second)
        frag.store_transposed(qr1, q_s.at[w], 2, 0)
        frag.store_transposed(qr2, q_s.at[w], 2, 1)
      else:
        frag.store_transposed(qr1, q_s.at[w, 0])
        frag.store_transposed(qr2, q_s.at[w, 1])
      plgpu.commit_smem()

    def scores_pairs(kf):
      with jax.named_scope("key_rope"):
        r = rotate(kf, rope_regs if rope_math == "f32-regs" else cos_s[...])

      def scores_p(s_ref):
        plgpu.wgmma(s_ref, r, plgpu.transpose_ref(q_s.at[w], (1, 0)))
        return s_ref[...]
      with jax.named_scope("score_mma"):
        return pl.run_scoped(scores_p, plgpu.ACC((T, np_), jnp.float32))

    def softmax(sc, t0, m_i, l_t):
      """Online softmax over the tile's tokens: (m_new, l_t, p, alpha = the rescale)."""
      sc = jnp.where(rows + t0 < end, sc, -jnp.inf)
      m_new = jnp.maximum(m_i, frag.col_reduce("max", sc, red_s.at[w]))
      alpha = jnp.exp2(m_i - m_new)
      pr = jnp.exp2(sc - lax.broadcast_in_dim(m_new, (T, np_), [1]))
      l_t = l_t * lax.broadcast_in_dim(alpha, (T, np_), [1]) + pr
      return m_new, l_t, pr, alpha

    def retire_values(vslot):
      """The value product reading ring slot vslot (and p^T) has retired: release both."""
      if skip == 1:
        return
      plgpu.barrier_arrive(v_free.at[vslot])
      if shared:
        plgpu.barrier_arrive(p_free)

    def value_mma(acc_ref, vslot, v_tile, p_tile):
      """o^T += V^T @ p into the accumulator ref. overlap="all": left in flight (retired by
      the next tile's key product, as wgmma groups retire in order); else waited for here."""
      with jax.named_scope("value_mma"):
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_tile, (1, 0)),
                    plgpu.transpose_ref(p_tile, (1, 0)))
        if not async_v:
          plgpu.wgmma_wait(0)
      if not async_v:
        retire_values(vslot)

    def own_values(i, acc_ref, pr, alpha):
      """values="per-head": o^T [rv, NP] += V^T [rv, T] @ p [T, NP] for this KV head."""
      acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alpha, (rv, np_), [1])
      if skip == 1:  # ablation (timing only), no value path
        return
      with jax.named_scope("p_store"):
        frag.store_transposed(pr.astype(jnp.bfloat16), p_s.at[w])
        plgpu.commit_smem()
      vslot = lax.rem(i, v_stages)
      with jax.named_scope("wait_value"):
        plgpu.barrier_wait(v_bar.at[vslot])
      value_mma(acc_ref, vslot, v_s.at[vslot], p_s.at[w])

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

    def shared_values(i, acc_ref, pr, alpha):
      """values="shared": the CTA's KV heads share the value latent, so their probabilities
      form one [T, hpp * NP] operand and warpgroup w computes rows [w rv / hpp, (w + 1) rv /
      hpp) of o^T for all of them: hpp times fewer N = NP wgmmas per warpgroup (an N = 16
      product costs about what an N = 8 one does, `bench_wgmma_shapes.py`)."""
      with jax.named_scope("wait_p_free"):
        @pl.when(i > 0)
        def _():
          plgpu.barrier_wait(p_free)  # every warpgroup's value product of tile i - 1 retired
      with jax.named_scope("p_store"):
        frag.store_transposed(pr.astype(jnp.bfloat16), p_s.at[pl.ds(w * np_, np_)])
      with jax.named_scope("exchange"):
        alphas = exchange(alpha, i)  # also publishes the p^T rows (commit + barrier)
      acc_ref[...] = acc_ref[...] * lax.broadcast_in_dim(alphas, (rvw, ncol), [1])
      vslot = lax.rem(i, v_stages)
      with jax.named_scope("wait_value"):
        plgpu.barrier_wait(v_bar.at[vslot])
      value_mma(acc_ref, vslot, v_s.at[vslot, :, pl.ds(w * rvw, rvw)], p_s)

    def key_product(slot, in_flight):
      """The tile's key reconstruction (wgmma); in_flight() runs while it is in the tensor
      pipe. Waiting for it also retires an earlier value product (groups retire in order)."""
      def keys_p(k_ref):
        plgpu.wgmma(k_ref, l_s.at[slot], bk_s.at[w])
        in_flight()
        return k_ref[...]

      def keys(k1_ref, k2_ref):
        plgpu.wgmma(k1_ref, l_s.at[slot], bk_s.at[w, 0])
        plgpu.wgmma(k2_ref, l_s.at[slot], bk_s.at[w, 1])
        in_flight()
        return k1_ref[...], k2_ref[...]
      if pairs:
        return pl.run_scoped(keys_p, plgpu.ACC((T, 2 * hh), jnp.float32))
      return pl.run_scoped(keys, plgpu.ACC((T, hh), jnp.float32), plgpu.ACC((T, hh), jnp.float32))

    def scores_halves(k1, k2):
      with jax.named_scope("key_rope"):
        if rope_math == "f16":
          k1, k2 = k1.astype(jnp.float16), k2.astype(jnp.float16)
          c, sn = (cos_s[...], sin_s[...])
        elif rope_math == "f32-regs":
          c, sn = rope_regs
        else:
          c, sn = cos_s[...].astype(jnp.float32), sin_s[...].astype(jnp.float32)
        r1 = (k1 * c - k2 * sn).astype(jnp.float16)
        r2 = (k2 * c + k1 * sn).astype(jnp.float16)

      def scores(s_ref):
        plgpu.wgmma(s_ref, r1, plgpu.transpose_ref(q_s.at[w, 0], (1, 0)))
        plgpu.wgmma(s_ref, r2, plgpu.transpose_ref(q_s.at[w, 1], (1, 0)))
        return s_ref[...]
      with jax.named_scope("score_mma"):
        return pl.run_scoped(scores, plgpu.ACC((T, np_), jnp.float32))

    def step(i, carry, acc_ref):
      m_i, l_t = carry
      slot = lax.rem(i, stages)
      t0 = start + i * T
      if skip == 2:  # ablation (timing only), no key path
        plgpu.wgmma_wait(0)
        sc = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
      else:
        if not early_q:
          with jax.named_scope("q_rotate"):
            rotate_queries(slot)
        with jax.named_scope("wait_latent"):
          plgpu.barrier_wait(l_bar.at[slot])
        with jax.named_scope("key_mma"):
          kf = key_product(slot, functools.partial(rotate_queries, slot) if early_q
                           else lambda: None)
        plgpu.barrier_arrive(k_free.at[slot])
        sc = scores_pairs(kf) if pairs else scores_halves(*kf)
      if async_v:  # tile i - 1's value product retired with the key product (or the wait)
        pl.when(i > 0)(functools.partial(retire_values, lax.rem(i + v_stages - 1, v_stages)))
      with jax.named_scope("softmax"):
        m_new, l_t, pr, alpha = softmax(sc, t0, m_i, l_t)
      (shared_values if shared else own_values)(i, acc_ref, pr, alpha)
      return m_new, l_t

    def run(acc_ref):
      acc_ref[...] = acc0
      m, l = lax.fori_loop(0, n_tiles, functools.partial(step, acc_ref=acc_ref), (m_i, l_t))
      return acc_ref[...], m, l
    acc, m_i, l_t = pl.run_scoped(run, plgpu.ACC((rvw, ncol), jnp.float32))
    l_i = frag.col_reduce("add", l_t, red_s.at[w])
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    lse = jnp.where(has, (m_i + jnp.log2(l_safe)) * math.log(2.0), -jnp.inf)
    if shared:  # o [P, splits, rv, hpp * NP]: this warpgroup's rows, every head's columns
      l_all = exchange(l_safe, n_tiles)
      o_ref.at[pid, sid, pl.ds(w * rvw, rvw)][...] = acc / lax.broadcast_in_dim(
          l_all, (rvw, ncol), [1])
      lse_ref.at[pid, sid, pl.ds(w * np_, np_)][...] = lse
    else:
      o_ref.at[kv, sid][...] = acc / lax.broadcast_in_dim(l_safe, (rv, np_), [1])
      lse_ref.at[kv, sid][...] = lse

  for w in range(hpp):
    pl.when(wg == w)(functools.partial(compute, w))

  @pl.when(wg == hpp)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(cos_ref, cos_s, rope_bar.at[0])
    if not pairs:
      plgpu.copy_gmem_to_smem(sin_ref, sin_s, rope_bar.at[1])

    def load_keys(i, slot):
      t0 = start + i * T
      plgpu.copy_gmem_to_smem(hk_ref.at[b, pl.ds(t0, T), grp], l_s.at[slot], l_bar.at[slot])
      plgpu.copy_gmem_to_smem(base_ref.at[t0 // T], base_s.at[slot], base_bar.at[slot])

    def load_values(i, slot):
      plgpu.copy_gmem_to_smem(hv_ref.at[b, pl.ds(start + i * T, T), grp], v_s.at[slot],
                              v_bar.at[slot])

    for i in range(stages):
      if skip != 2:
        pl.when(i < n_tiles)(functools.partial(load_keys, i, i))
    for i in range(v_stages):
      if skip != 1:
        pl.when(i < n_tiles)(functools.partial(load_values, i, i))

    @pl.loop(0, n_tiles)
    def _(i):
      slot = lax.rem(i, stages)

      if skip != 2:
        @pl.when(i + stages < n_tiles)
        def _():
          with jax.named_scope("wait_key_slot"):
            plgpu.barrier_wait(k_free.at[slot])
          load_keys(i + stages, slot)

      if skip != 1:
        vslot = lax.rem(i, v_stages)

        @pl.when(i + v_stages < n_tiles)
        def _():
          with jax.named_scope("wait_value_slot"):
            plgpu.barrier_wait(v_free.at[vslot])
          load_values(i + v_stages, vslot)


def _call(p, qt, hk, hv, bk, cos, sin, base, lengths):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rk, rv, stages = p["hpp"], p["hh"], p["rk"], p["rv"], p["stages"]
  v_stages, np_ = p["v_stages"], p["np"]
  kvh = p["b"] * p["gr"] * p["g"]
  shared = p["values"] == "shared"
  ns = p["num_splits"]
  # Pallas Mosaic GPU's profiler: per warpgroup, the clock at entry/exit of every named scope
  # of the kernel (`jax.named_scope`), written as a Chrome trace to profile_dir per call.
  profile = (dict(profile_space=p["profile_space"], profile_dir=p["profile_dir"])
             if p["profile_dir"] else {})

  def sw(dt_bytes, minor_elems):
    swz = minor_elems * dt_bytes
    return (plgpu.TilingTransform((8, minor_elems)), plgpu.SwizzleTransform(swz))

  k_tf = sw(2, hh)   # B_k slices, key latent tiles, cos/sin: (8, H/2), 128-byte swizzle
  pv_tf = sw(2, 64)  # value tile, p^T and rotated queries: (8, 64), 128-byte swizzle

  def entry(q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref, len_ref, o_ref,
            lse_ref):
    pairs = p["layout"] == "pairs"
    # pairs: B_k [rk, H], queries [NP, H] and the cos/sin pair table [T, H] (the sin slot
    # unused, one byte); halves: each as two [.., H/2] halves.
    scratch = [
        plgpu.SMEM((hpp, rk, 2 * hh) if pairs else (hpp, 2, rk, hh), jnp.bfloat16,
                   transforms=pv_tf if pairs else k_tf),
        plgpu.SMEM((hpp, 2, hh, np_), jnp.float32),
        plgpu.SMEM((hpp, np_, 2 * hh) if pairs else (hpp, 2, np_, hh), jnp.float16,
                   transforms=pv_tf),
        plgpu.SMEM((T, 2 * hh) if pairs else (T, hh), jnp.float16,
                   transforms=pv_tf if pairs else k_tf),
        # the sin table (halves), the values="shared" column exchange (pairs), else unused
        (plgpu.SMEM((T, hh), jnp.float16, transforms=k_tf) if not pairs
         else plgpu.SMEM((2, hpp * np_), jnp.float32) if shared
         else plgpu.SMEM((1,), jnp.float16)),
        plgpu.SMEM((stages, T, rk), jnp.bfloat16, transforms=k_tf),
        plgpu.SMEM((stages, 2, hh), jnp.float32),
        plgpu.SMEM((v_stages, T, rv), jnp.bfloat16, transforms=pv_tf),
        plgpu.SMEM((hpp * np_, T) if shared else (hpp, np_, T), jnp.bfloat16,
                   transforms=pv_tf),
        # FragmentedArray.reduce stores 128 threads x vec_len (2) f32 per 8 columns.
        plgpu.SMEM((hpp, RED_PER_COL * np_), jnp.float32),
    ]
    bars = (
        plgpu.Barrier(num_barriers=2 * hpp),
        plgpu.Barrier(num_barriers=hpp),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=v_stages),
        plgpu.Barrier(num_arrivals=hpp, num_barriers=stages),
        plgpu.Barrier(num_arrivals=hpp, num_barriers=v_stages),
        plgpu.Barrier(num_arrivals=hpp) if shared else None,  # column exchange
        plgpu.Barrier(num_arrivals=hpp) if shared else None,  # p^T consumed
    )
    pl.run_scoped(
        lambda *refs: _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref,
                              len_ref, o_ref, lse_ref, refs[:10], refs[10:]),
        *scratch, *bars, collective_axes="wg")

  if shared:  # per CTA: [splits, rv, heads x NP]
    out_types = (jax.ShapeDtypeStruct((kvh // hpp, ns, rv, hpp * np_), jnp.float32),
                 jax.ShapeDtypeStruct((kvh // hpp, ns, hpp * np_), jnp.float32))
  else:
    out_types = (jax.ShapeDtypeStruct((kvh, ns, rv, np_), jnp.float32),
                 jax.ShapeDtypeStruct((kvh, ns, np_), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_types, grid=p["grid"], grid_names=("p", "s"),
      num_threads=hpp + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, **profile),
  )(qt, hk, hv, bk, cos, sin, base, lengths)


def palu_attention_mosaic(q, hk, hv, b_k, lengths, inv_freq, *, k_bias=None, scale=None,
                            out_dtype=None, heads_per_program=2, stages=None, v_stages=None,
                            num_splits=None, target_programs=None, return_partials=False,
                            rope=None, rope_math="f32-regs", layout="pairs", values=None,
                            overlap="all", skip=0, profile_dir=None, profile_space=2048):
  """Fused Palu decode attention (Mosaic GPU); same contract as the reference.

  Args (beyond the reference's): inv_freq [H/2] float32; heads_per_program (KV heads per
    CTA, one compute warpgroup each), stages (key-latent ring depth), v_stages (value
    ring depth; both None: the deepest that fit), num_splits, target_programs: launch
    knobs; rope: optional precomputed `rope_tables(inv_freq, S)`; rope_math, layout, values
    ("per-head" or "shared"), overlap: see `plan`; skip: timing ablation (1: no value path, 2: no
    key path; wrong output); profile_dir: if given, every call writes a per-warpgroup trace
    of the kernel's named phases there (Pallas Mosaic GPU profiler, `profile_space` ranges
    per warpgroup, kept in shared memory: the rings may get shallower; summarised by
    `experiments/mosaic_trace.py`).
  """
  check_inputs(hk, hv, k_bias)
  h = q.shape[-1]
  scale = h ** -0.5 if scale is None else float(scale)
  p = plan(q.shape, hk.shape, hv.shape, b_k.shape, heads_per_program=heads_per_program,
           stages=stages, v_stages=v_stages, num_splits=num_splits,
           target_programs=target_programs, rope_math=rope_math, layout=layout,
           values=values, overlap=overlap, skip=skip,
           profile_space=profile_space if profile_dir else 0)
  p["profile_dir"] = profile_dir
  cos, sin, base = rope_tables(inv_freq, p["s"]) if rope is None else rope
  b_k = b_k.astype(jnp.bfloat16)
  if layout == "pairs":  # column d of each RoPE half -> 2d (first half), 2d + 1 (second)
    gr, rk, gh = b_k.shape
    b_k = b_k.reshape(gr, rk, gh // h, 2, h // 2).swapaxes(-1, -2).reshape(gr, rk, gh)
    cos, sin = jnp.stack([cos, sin], -1).reshape(T, h), jnp.zeros((1,), jnp.float16)
  o_t, lse_t = _call(p, query_operand(q, p, scale), hk.astype(jnp.bfloat16),
                     hv.astype(jnp.bfloat16), b_k, cos, sin, base, lengths.astype(jnp.int32))
  o, lse = unpad_partials(o_t, lse_t, p)
  return splitk.combine_result(o, lse, out_dtype or q.dtype, return_partials)
