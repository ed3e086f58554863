"""Palu fused latent decode attention in Pallas Mosaic GPU (Hopper: TMA, wgmma, warp roles).

Why a second backend next to `triton_latent`: the Triton kernel keeps a group's
reconstruction operands (128 KiB at Palu's 50% setting) in shared memory, so two
stages of latent tiles no longer fit beside them and each tile's loads and MMAs run
back to back (BENCHMARKS.md). Here a producer warpgroup streams the tiles with TMA
into a multi-stage ring while the compute warpgroups work, so the latent stream
overlaps the reconstruction.

Grid (B * Gr * g / HPP, num_splits); a CTA holds HPP KV heads of one group (their B_k
column slices resident in shared memory) and runs HPP + 1 warpgroups:
  * warpgroup HPP (producer): TMA copies of the key latent tile [T, rk] and the
    cos/sin tiles [T, H/2] into a `stages`-slot ring, and of the value latent tile
    [T, rv] into a `v_stages`-slot ring, each slot reloaded as soon as every compute
    warpgroup released it;
  * warpgroup w < HPP (KV head j = part * HPP + w), per 64-token tile:
      k1, k2 = L @ B_k[:, jH : jH + H/2], L @ B_k[:, jH + H/2 : (j+1)H]  (wgmma, bf16)
      r1, r2 = k1 cos - k2 sin, k2 cos + k1 sin                          (f32, RoPE)
      s [T, NP] = r1 @ q1^T + r2 @ q2^T                (wgmma, A in registers, f16)
      online softmax over tokens (the tile's axis 0), p^T [NP, T] -> shared memory
      o^T [rv, NP] += V^T [rv, T] @ p                  (wgmma, bf16, f32 accumulator)
    tokens are the MMA M of the key products and the K of the value product, so no
    operand is padded to 64 rows: the NP = 16 query columns of a KV head (its QPK <= 16
    heads, zero-padded) are the N of the two small products.
Split-K partials o^T [rv, NP] and lse [NP] per (KV head, split) go to global memory;
the wrapper drops the padding and merges them with `splitk.combine_partials`.

Measured (H200, 16K context, batch 8, two calls; BENCHMARKS.md): Llama-3 230-350 µs
against Triton's 292-313 µs, Llama-2 777-1037 µs against 787-951 µs; the key and value
paths overlap but each is slow alone (two value stages next to two heads' operands fit
only with one key stage). Not the default.

Choices (written down, as they differ from the Triton kernel where noted):
  * queries are pre-scaled by sm_scale * log2(e) and rounded to fp16, rotated keys
    rounded to fp16 (the Triton GQA path does the same); p is rounded to bf16 for
    the value product (as in Triton); everything else accumulates in f32;
  * RoPE angles come from [S, H/2] fp16 cos and sin tables of fl(t w) (the reference's
    angles, rounded to fp16: <= 2**-12 absolute error, like the Triton kernel's
    `rope_dtype=float16`), TMA-loaded per tile (L2 resident, shared by every CTA);
  * slots in [length, capacity) are read by the tile loads and masked to -inf before
    the softmax, so they must hold finite values (caches are zero-initialised);
  * bf16 latents only (packed latents stay on the Triton kernel), rk and rv multiples
    of 64, H in {64, 128}, QPK <= 16, no key bias, cache capacity a multiple of 8.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..decode_attention import splitk
from .packing import PackedLatent

T = 64          # tokens per tile (M of the key products)
RED_PER_COL = 32  # f32 cross-warp reduction scratch per compute warpgroup and score column
SMEM_LIMIT = 227 * 1024


def query_columns(qpk: int) -> int:
  """NP: score columns per KV head (its QPK query heads, zero-padded to 8 or 16)."""
  return 8 if qpk <= 8 else 16


def _smem_bytes(hpp, rk, rv, hh, np_, stages, v_stages):
  return (hpp * 2 * rk * hh * 2            # B_k column slices
          + hpp * 2 * hh * np_ * 4         # queries^T (f32, as loaded)
          + hpp * 2 * np_ * hh * 2         # rotated queries (fp16, rewritten per tile)
          + 2 * T * hh * 2                 # in-tile cos / sin (fp16, resident)
          + stages * (T * rk * 2 + 2 * hh * 4)  # key latent ring + tile rotation rows
          + v_stages * T * rv * 2          # value latent ring
          + hpp * np_ * T * 2              # probabilities (transposed)
          + hpp * RED_PER_COL * np_ * 4    # reduction scratch
          + 1024)                          # barriers


def plan(q_shape, hk_shape, hv_shape, bk_shape, *, heads_per_program=2, stages=2, v_stages=1,
         num_splits=None, target_programs=None, rope_math="f32", skip=0):
  """Validates the shapes and returns the launch geometry (dict).

  rope_math: "f32" (the in-tile key rotation in f32, cos/sin read from shared memory each
    tile), "f32-regs" (the same with cos/sin held in registers across tiles) or "f16"
    (packed half-precision math on the fp16-rounded keys: two more roundings, half the
    instructions).
  skip: 0, or an ablation for timing only (1: no value path, 2: no key path; wrong output).
  """
  b, n, h = q_shape
  _, s, gr, rk = hk_shape
  rv = hv_shape[3]
  g = bk_shape[2] // h
  qpk = n // (gr * g)
  hh = h // 2
  if h != 128:
    raise ValueError(f"mosaic latent attention: head dim must be 128, got {h} (the per-tile "
                     "query rotation is a 64-row wgmma-layout array; use the triton "
                     "implementation)")
  for name, val in (("rk", rk), ("rv", rv)):
    if val % 64:
      raise ValueError(f"mosaic latent attention: {name} must be a multiple of 64, got {val}")
  if s % 8:
    raise ValueError(f"mosaic latent attention: the cache capacity (hk.shape[1] = {s}) must be "
                     "a multiple of 8 (TMA tiles of the latent rows)")
  if qpk > 16:
    raise ValueError(f"mosaic latent attention: at most 16 query heads per KV head, got {qpk}")
  np_ = query_columns(qpk)
  hpp = int(heads_per_program)
  if hpp < 1 or g % hpp:
    raise ValueError(f"mosaic latent attention: heads_per_program ({hpp}) must divide the "
                     f"group's KV heads ({g})")
  if rope_math not in ("f32", "f32-regs", "f16"):
    raise ValueError(f"mosaic latent attention: rope_math must be 'f32', 'f32-regs' or 'f16', "
                     f"got {rope_math!r}")
  if skip not in (0, 1, 2):
    raise ValueError(f"mosaic latent attention: skip must be 0, 1 or 2, got {skip}")
  if stages < 1:
    raise ValueError(f"mosaic latent attention: stages must be >= 1, got {stages}")
  if v_stages < 1:
    raise ValueError(f"mosaic latent attention: v_stages must be >= 1, got {v_stages}")
  need = _smem_bytes(hpp, rk, rv, hh, np_, stages, v_stages)
  if need > SMEM_LIMIT:
    raise ValueError(f"mosaic latent attention: heads_per_program={hpp}, stages={stages}, "
                     f"v_stages={v_stages} need "
                     f"{need} B of shared memory (rk={rk}, rv={rv}, H={h}); a block may use "
                     f"{SMEM_LIMIT}. Lower stages or heads_per_program.")
  parallel = b * gr * (g // hpp)
  if num_splits is None and target_programs is None:
    # One CTA per SM (the rings and operands take most of the shared memory): balance waves.
    ns = splitk.wave_balanced_splits(parallel, s, T, _num_sms())
  else:
    ns = splitk.choose_num_splits(parallel, s, T, requested=num_splits,
                                  target=target_programs or 2 * 132)
  return dict(b=b, n=n, h=h, hh=hh, s=s, gr=gr, g=g, qpk=qpk, np=np_, rk=rk, rv=rv, hpp=hpp,
              stages=stages, v_stages=v_stages, rope_math=rope_math, skip=int(skip), num_splits=ns,
              grid=(parallel, ns))


def _num_sms() -> int:
  """SMs of the first GPU (132 on H100/H200; also the value used where there is none, e.g.
  when lowering on a CPU machine)."""
  gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
  return int(getattr(gpus[0], "core_count", 132)) if gpus else 132


def rope_tables(inv_freq, capacity: int):
  """RoPE of token t0 + i (t0 a multiple of T) as R(t0) R(i), R(a) the rotation by a * w:
  returns cos, sin [T, H/2] float16 of fl(i * w) for the in-tile offsets i < T (resident
  in every CTA) and base [ceil(S / T), 2, H/2] float32: cos and sin of fl(t0 * w) per
  tile start (the reference's angle formula; fp16 cos/sin err <= 2**-12 absolute, below the
  bf16 rounding of the latents)."""
  inv = jnp.asarray(inv_freq, jnp.float32)
  ang = jnp.arange(T, dtype=jnp.int32).astype(jnp.float32)[:, None] * inv[None, :]
  starts = jnp.arange(0, capacity, T, dtype=jnp.int32).astype(jnp.float32)
  base = starts[:, None] * inv[None, :]
  return (jnp.cos(ang).astype(jnp.float16), jnp.sin(ang).astype(jnp.float16),
          jnp.stack([jnp.cos(base), jnp.sin(base)], 1))


def _store_transposed_swizzled(x, ref):
  """Mosaic-level body of `store_transposed` (x: FragmentedArray [64, NP], WGMMA layout)."""
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir.dialects import arith, memref, vector  # pylint: disable=import-outside-toplevel
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  c = lambda v: arith.constant(i32, v)
  # The tiled memref [NP / 8, 64 / 64, 8, 64] (RefType with the tiling/swizzle transforms).
  assert ir.MemRefType(ref.type).shape == [x.shape[1] // 8, 1, 8, 64], ref.type
  for reg, (r, col) in zip(x.registers.flat, x.layout.thread_idxs(x.shape)):
    t = arith.index_cast(i32, r)
    col = arith.index_cast(i32, col)
    [vec_len] = ir.VectorType(reg.type).shape
    for k in range(vec_len):
      val = vector.extract(reg, dynamic_position=[],
                           static_position=ir.DenseI64ArrayAttr.get([k]))
      h = arith.addi(col, c(k))
      rr = arith.remui(h, c(8))
      # 128-byte swizzle: the 16-byte chunk (8 bf16) index of a row is XORed with row % 8.
      tc = arith.addi(arith.muli(arith.xori(arith.divui(t, c(8)), rr), c(8)),
                      arith.remui(t, c(8)))
      ids = [arith.divui(h, c(8)), c(0), rr, tc]
      memref.store(val, ref, [arith.index_cast(index, v) for v in ids])


def _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref, len_ref, o_ref,
            lse_ref, smem, bars):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rv, gr, g, ns = p["hpp"], p["hh"], p["rv"], p["gr"], p["g"], p["num_splits"]
  stages, v_stages, skip, np_ = p["stages"], p["v_stages"], p["skip"], p["np"]
  rope_math = p["rope_math"]
  npart = g // hpp
  bk_s, q0_s, q_s, cos_s, sin_s, l_s, base_s, v_s, p_s, red_s = smem
  (bk_bar, q_bar, rope_bar, l_bar, base_bar, v_bar, k_free, v_free) = bars
  wgmma_layout = plgpu.Layout.WGMMA
  pid = lax.axis_index("p")
  sid = lax.axis_index("s")
  wg = lax.axis_index("wg")
  b = pid // (gr * npart)
  grp = (pid // npart) % gr
  part = pid % npart
  length = len_ref[b]
  chunk = ((length + ns - 1) // ns + T - 1) // T * T
  start = sid * chunk
  end = jnp.minimum(start + chunk, length)
  n_tiles = jnp.maximum(end - start + T - 1, 0) // T

  def col_reduce(op, x, scratch):
    """Column reduction of a WGMMA-layout [rows, NP] array across the warpgroup's warps, with
    this warpgroup's own scratch (Pallas's built-in cross-warp reduction shares one scratch
    buffer between warpgroups, which races when two compute warpgroups reduce at once)."""
    @plgpu.inline_mgpu(arg_types=(wgmma_layout, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct(
                           (x.shape[1],), x.dtype, layout=wgmma_layout.reduce(0)))
    def f(_, xv, sc_ref):
      return xv.reduce(op, 0, scratch=sc_ref)
    return f(x, scratch)

  def store_transposed(x, dst):
    """dst[h, t] = x[t, h] for a WGMMA-layout x [64, NP] (16-bit) and dst [NP, 64] in shared
    memory tiled (8, 64) with the 128-byte swizzle: the K-major B operand of a wgmma (p^T for
    the value product, the rotated queries for the scores). Pallas has no transposing store
    for WGMMA-layout arrays, and the untransposed [T, NP] layout would need a 32-byte
    swizzle, whose value tile then travels as 24 TMA boxes of 32-byte rows (measured: the
    value stage alone ran at 0.7 TB/s)."""
    @plgpu.inline_mgpu(arg_types=(wgmma_layout, plgpu.RefType(
        (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))))
    def f(_, xv, ref):
      _store_transposed_swizzled(xv, ref)
    f(x, dst)

  def compute(w):
    plgpu.set_max_registers(232, action="increase")
    j = part * hpp + w                   # KV head within the group
    kv = (b * gr + grp) * g + j          # global KV head (q / output row)
    for half in range(2):
      plgpu.copy_gmem_to_smem(bk_ref.at[grp, :, pl.ds(j * 2 * hh + half * hh, hh)],
                              bk_s.at[w, half], bk_bar.at[w * 2 + half])
    plgpu.copy_gmem_to_smem(q_ref.at[kv], q0_s.at[w], q_bar.at[w])
    plgpu.barrier_wait(bk_bar.at[w * 2])
    plgpu.barrier_wait(bk_bar.at[w * 2 + 1])
    plgpu.barrier_wait(q_bar.at[w])
    plgpu.barrier_wait(rope_bar.at[0])
    plgpu.barrier_wait(rope_bar.at[1])
    # q^T halves [H/2, NP] (f32, pre-scaled): rotated per tile by the tile start's angles.
    q1 = plgpu.load(q0_s.at[w, 0], (), layout=wgmma_layout)
    q2 = plgpu.load(q0_s.at[w, 1], (), layout=wgmma_layout)
    col_layout = wgmma_layout.reduce(0)
    m_i = plgpu.layout_cast(jnp.full((np_,), -jnp.inf, jnp.float32), col_layout)
    l_t = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
    acc = plgpu.layout_cast(jnp.zeros((rv, np_), jnp.float32), wgmma_layout)
    rows = plgpu.broadcasted_iota(jnp.int32, (T, np_), 0, layout=wgmma_layout)
    rope_regs = None
    if rope_math == "f32-regs":
      rope_regs = (plgpu.load(cos_s, (), layout=wgmma_layout).astype(jnp.float32),
                   plgpu.load(sin_s, (), layout=wgmma_layout).astype(jnp.float32))

    def step(i, carry):
      acc, m_i, l_t = carry
      slot = lax.rem(i, stages)
      t0 = start + i * T
      if skip == 2:  # ablation (timing only): no key path
        sc = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
      else:
        # q . R(t0 + i) k = (R(t0)^T q) . (R(i) k): the queries take the tile start's
        # rotation, the keys the in-tile offset's (a resident table).
        plgpu.barrier_wait(base_bar.at[slot])
        row = wgmma_layout.reduce(1)
        cb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 0], (), layout=row), (hh, np_), [0])
        sb = lax.broadcast_in_dim(plgpu.load(base_s.at[slot, 1], (), layout=row), (hh, np_), [0])
        store_transposed((q1 * cb + q2 * sb).astype(jnp.float16), q_s.at[w, 0])
        store_transposed((q2 * cb - q1 * sb).astype(jnp.float16), q_s.at[w, 1])
        plgpu.commit_smem()
        plgpu.barrier_wait(l_bar.at[slot])

        def keys(k1_ref, k2_ref):
          plgpu.wgmma(k1_ref, l_s.at[slot], bk_s.at[w, 0])
          plgpu.wgmma(k2_ref, l_s.at[slot], bk_s.at[w, 1])
          return k1_ref[...], k2_ref[...]
        k1, k2 = pl.run_scoped(keys, plgpu.ACC((T, hh), jnp.float32),
                               plgpu.ACC((T, hh), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
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
        sc = pl.run_scoped(scores, plgpu.ACC((T, np_), jnp.float32))
      sc = jnp.where(rows + t0 < end, sc, -jnp.inf)
      m_new = jnp.maximum(m_i, col_reduce("max", sc, red_s.at[w]))
      alpha = jnp.exp2(m_i - m_new)
      pr = jnp.exp2(sc - lax.broadcast_in_dim(m_new, (T, np_), [1]))
      l_t = l_t * lax.broadcast_in_dim(alpha, (T, np_), [1]) + pr
      acc = acc * lax.broadcast_in_dim(alpha, (rv, np_), [1])
      if skip != 1:  # skip == 1: ablation (timing only), no value path
        store_transposed(pr.astype(jnp.bfloat16), p_s.at[w])
        plgpu.commit_smem()
        vslot = lax.rem(i, v_stages)
        plgpu.barrier_wait(v_bar.at[vslot])

        def values(acc_ref):
          plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_s.at[vslot], (1, 0)),
                      plgpu.transpose_ref(p_s.at[w], (1, 0)))
        acc = pl.run_state(values)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[vslot])
      return acc, m_new, l_t

    acc, m_i, l_t = lax.fori_loop(0, n_tiles, step, (acc, m_i, l_t))
    l_i = col_reduce("add", l_t, red_s.at[w])
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    lse = jnp.where(has, (m_i + jnp.log2(l_safe)) * math.log(2.0), -jnp.inf)
    o_ref.at[kv, sid][...] = acc / lax.broadcast_in_dim(l_safe, (rv, np_), [1])
    lse_ref.at[kv, sid][...] = lse

  for w in range(hpp):
    pl.when(wg == w)(functools.partial(compute, w))

  @pl.when(wg == hpp)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    plgpu.copy_gmem_to_smem(cos_ref, cos_s, rope_bar.at[0])
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
          plgpu.barrier_wait(k_free.at[slot])
          load_keys(i + stages, slot)

      if skip != 1:
        vslot = lax.rem(i, v_stages)

        @pl.when(i + v_stages < n_tiles)
        def _():
          plgpu.barrier_wait(v_free.at[vslot])
          load_values(i + v_stages, vslot)


def _call(p, qt, hk, hv, bk, cos, sin, base, lengths):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  hpp, hh, rk, rv, stages = p["hpp"], p["hh"], p["rk"], p["rv"], p["stages"]
  v_stages, np_ = p["v_stages"], p["np"]
  kvh = p["b"] * p["gr"] * p["g"]
  ns = p["num_splits"]

  def sw(dt_bytes, minor_elems):
    swz = minor_elems * dt_bytes
    return (plgpu.TilingTransform((8, minor_elems)), plgpu.SwizzleTransform(swz))

  k_tf = sw(2, hh)   # B_k slices, key latent tiles, cos/sin: (8, H/2), 128-byte swizzle
  pv_tf = sw(2, 64)  # value tile, p^T and rotated queries: (8, 64), 128-byte swizzle

  def entry(q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref, len_ref, o_ref,
            lse_ref):
    scratch = [
        plgpu.SMEM((hpp, 2, rk, hh), jnp.bfloat16, transforms=k_tf),
        plgpu.SMEM((hpp, 2, hh, np_), jnp.float32),
        plgpu.SMEM((hpp, 2, np_, hh), jnp.float16, transforms=pv_tf),
        plgpu.SMEM((T, hh), jnp.float16, transforms=k_tf),
        plgpu.SMEM((T, hh), jnp.float16, transforms=k_tf),
        plgpu.SMEM((stages, T, rk), jnp.bfloat16, transforms=k_tf),
        plgpu.SMEM((stages, 2, hh), jnp.float32),
        plgpu.SMEM((v_stages, T, rv), jnp.bfloat16, transforms=pv_tf),
        plgpu.SMEM((hpp, np_, T), jnp.bfloat16, transforms=pv_tf),
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
    )
    pl.run_scoped(
        lambda *refs: _kernel(p, q_ref, hk_ref, hv_ref, bk_ref, cos_ref, sin_ref, base_ref,
                              len_ref, o_ref, lse_ref, refs[:10], refs[10:]),
        *scratch, *bars, collective_axes="wg")

  out_types = (jax.ShapeDtypeStruct((kvh, ns, rv, np_), jnp.float32),
               jax.ShapeDtypeStruct((kvh, ns, np_), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_types, grid=p["grid"], grid_names=("p", "s"),
      num_threads=hpp + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(qt, hk, hv, bk, cos, sin, base, lengths)


def query_operand(q, p, scale):
  """[B * Gr * g, 2, H/2, NP] float32: each KV head's queries, transposed (scaled by
  scale * log2 e, RoPE halves split, zero columns past QPK)."""
  b, n, h = q.shape
  kvh, qpk, hh, np_ = p["gr"] * p["g"], p["qpk"], p["hh"], p["np"]
  qf = q.astype(jnp.float32) * (scale * 1.4426950408889634)
  qf = qf.reshape(b * kvh, qpk, 2, hh).transpose(0, 2, 3, 1)
  return jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, np_ - qpk)))


def unpad_partials(o_t, lse_t, p):
  """Kernel partials [KVH, P, rv, NP], [KVH, P, NP] -> [B, N, P, rv], [B, N, P]."""
  b, n, qpk, rv, ns = p["b"], p["n"], p["qpk"], p["rv"], p["num_splits"]
  kvh = p["gr"] * p["g"]
  o = o_t[..., :qpk].reshape(b, kvh, ns, rv, qpk).transpose(0, 1, 4, 2, 3)
  lse = lse_t[..., :qpk].reshape(b, kvh, ns, qpk).transpose(0, 1, 3, 2)
  return o.reshape(b, n, ns, rv), lse.reshape(b, n, ns)


def latent_attention_mosaic(q, hk, hv, b_k, lengths, inv_freq, *, k_bias=None, scale=None,
                            out_dtype=None, heads_per_program=2, stages=2, v_stages=1,
                            num_splits=None, target_programs=None, return_partials=False,
                            rope=None, rope_math="f32", skip=0):
  """Fused Palu decode attention (Mosaic GPU); same contract as the reference.

  Args (beyond the reference's): inv_freq [H/2] float32; heads_per_program (KV heads per
    CTA, one compute warpgroup each), stages (key-latent ring depth), v_stages (value
    ring depth), num_splits, target_programs: launch knobs; rope: optional precomputed `rope_tables(inv_freq, S)`;
    skip: timing ablation (1: no value path, 2: no key path); the output is then wrong.
  """
  if k_bias is not None:
    raise ValueError("mosaic latent attention: k_bias is not supported; use the triton "
                     "implementation")
  for name, x in (("hk", hk), ("hv", hv)):
    if isinstance(x, PackedLatent):
      raise ValueError(f"mosaic latent attention: {name} must be a bf16 array (packed latents "
                       "run on the triton implementation)")
  h = q.shape[-1]
  scale = h ** -0.5 if scale is None else float(scale)
  p = plan(q.shape, hk.shape, hv.shape, b_k.shape, heads_per_program=heads_per_program,
           stages=stages, v_stages=v_stages, num_splits=num_splits,
           target_programs=target_programs, rope_math=rope_math, skip=skip)
  cos, sin, base = rope_tables(inv_freq, p["s"]) if rope is None else rope
  o_t, lse_t = _call(p, query_operand(q, p, scale), hk.astype(jnp.bfloat16),
                     hv.astype(jnp.bfloat16), b_k.astype(jnp.bfloat16), cos, sin, base,
                     lengths.astype(jnp.int32))
  o, lse = unpad_partials(o_t, lse_t, p)
  out, total = splitk.combine_partials(o, lse, out_dtype or q.dtype)
  if return_partials:
    return out, total, (o, lse)
  return out, total
