"""KIVI-2bit decode attention in Pallas Mosaic GPU (Hopper: TMA rings, wgmma, warp roles).

Why a second backend next to `triton_kivi`: that kernel is bound by instructions, not bytes
(493 SASS instructions per warp per 32-token tile, BENCHMARKS.md): its codes are unpacked
into Triton's MMA layout with byte shuffles and every 32-token tile repeats address
arithmetic. Here the cache is stored in the A-fragment order of the wgmma operands
(`mosaic_layout`, a lossless relayout of the planar cache), so a thread turns its 16 bytes
of codes into 64 fp16/bf16 elements with one mask-and-or and two packed FMAs per pair
(`mosaic_dequant`) and no shuffles.

Grid (B * K, num_splits); a CTA streams one (batch, KV head)'s chunk of 128-token blocks:
  * warpgroup W (producer): TMA copies of each block's key codes, key scales, value codes
    and value scales into a `stages`-slot ring (one barrier per array and slot); a slot is
    reloaded once its consumer released it;
  * warpgroup w < W takes blocks w, w + W, ... (so stages % W == 0 keeps a slot's consumer
    fixed) with its own online-softmax state:
      s [64, NP] = dequant(K codes of tokens 64 m ..) @ q^T     m = 0, 1 (A in registers)
      p = exp2(s * scale log2 e - m), p^T -> shared memory (the B operand)
      o^T [64, NP] += dequant(V^T codes of channels 64 m ..) @ p  m = 0, 1
    The slot is released as soon as the value operands are in registers; the value products
    are waited for at the block's end (async_values=True leaves them in flight into the
    next block, which makes ptxas serialise the wgmmas). Each warpgroup writes its own
    split-K partial (o, lse); the wrapper merges them with the exact window's partial
    (bf16, `window_implementation`: XLA by default) in one LSE combine.
NP = the KV head's query heads, zero-padded to 8 or 16 (the N of every product).

`mosaic_kivi_warp` (warp-level mma.sync, no warpgroup exchanges in the loop) is 1.14-1.24x
faster and the dispatcher's default; this kernel stays as kernel="wgmma" for comparison.
Measured (H200, interleaved rounds, BENCHMARKS.md "ninth session"): 1.8-2.5x the cuDNN
dense kernel and 1.0-1.3x the Triton KIVI kernel at 16K/64K, B = 8/32; warpgroups=3 (the
default) was 5-9% faster than 2 in 6 of 8 configurations. About a third of the call at
16K/B=8 is fixed cost (~27-35 us: launch, the window's XLA attention, the LSE combine).

Choices: q enters the score product unscaled (in the scales' 16-bit type) and the scores
are scaled in f32, as in the Triton kernel; p is rounded to the scales' type for the value
product; dequantized elements are rounded once (c * s + z in fp16/bf16, c exact);
tokens in [length, capacity) are read and masked to -inf (they must be finite: caches
are zero-initialised). Restrictions: `mosaic_layout` (2-bit, groups of 32, H = 128,
capacity a multiple of 128), QPK <= 16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..decode_attention import splitk
from ..latent_attention import mosaic_fragments as frag
from ..latent_attention.mosaic_plan import RED_PER_COL
from . import mosaic_dequant
from . import mosaic_ring as ring
from .mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic

T = 64  # rows of one m64 product (tokens of a key sub-operand, channels of a value one)
LOG2E = 1.4426950408889634


NAME = "mosaic KIVI"


def _smem_bytes(w, stages, np_):
  kib = lambda n: -(-n // 1024) * 1024
  return (stages * ring.SLOT_BYTES + kib(np_ * HEAD_DIM * 2) + kib(w * np_ * BLOCK * 2)
          + kib(w * RED_PER_COL * np_ * 4) + 512)


def plan(q_shape, cache_shape, *, warpgroups=3, stages=None, num_splits=None,
         async_values=False, skip=0):
  """Launch geometry (dict) with ValueErrors naming the bad argument (`ring.plan_ring`).
  async_values: leave the value products in flight into the next block (else waited for at
  the block's end). skip: timing ablation (wrong output): 1 no value path, 2 constant key
  operands, 3 constant value operands (the products run, the dequantization does not)."""
  return dict(ring.plan_ring(NAME, q_shape, cache_shape, warpgroups=warpgroups,
                             stages=stages, num_splits=num_splits, skip=skip,
                             smem_bytes=_smem_bytes),
              async_values=bool(async_values))


def _kernel(p, dtype, sm_scale, q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, o_ref,
            lse_ref, smem, bars):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  nw, stages, np_, ns, kh = p["w"], p["stages"], p["np"], p["num_splits"], p["kh"]
  skip = p["skip"]
  q_s, kc_s, ks_s, vc_s, vs_s, p_s, red_s = smem
  q_bar, kc_bar, ks_bar, vc_bar, vs_bar, free = bars
  wgmma_layout = plgpu.Layout.WGMMA
  col_layout = wgmma_layout.reduce(0)
  jdt = jnp.float16 if dtype == "float16" else jnp.bfloat16
  pid = lax.axis_index("p")
  sid = lax.axis_index("s")
  wg = lax.axis_index("wg")
  b, head = pid // kh, pid % kh
  start, end, n_blocks = splitk.split_bounds(len_ref[b], ns, sid, BLOCK)

  def dequant(codes, scales, m):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((T, HEAD_DIM), jdt,
                                                          layout=wgmma_layout))
    def f(_, c_ref, s_ref):
      return mosaic_dequant.dequant_operand(c_ref, s_ref, m, dtype)
    return f(codes, scales)

  def compute(w):
    plgpu.set_max_registers(p["regs"], action="increase")
    plgpu.barrier_wait(q_bar)
    mine = jnp.maximum(n_blocks - w + nw - 1, 0) // nw
    rows = plgpu.broadcasted_iota(jnp.int32, (T, np_), 0, layout=wgmma_layout)
    m0 = plgpu.layout_cast(jnp.full((np_,), -jnp.inf, jnp.float32), col_layout)
    l0 = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
    zero = plgpu.layout_cast(jnp.zeros((T, np_), jnp.float32), wgmma_layout)
    qt = q_s.transpose((1, 0))
    pt = p_s.at[w].transpose((1, 0))
    scale2 = sm_scale * LOG2E

    def step(ii, carry, acc0, acc1):
      m_i, l_t = carry
      i = w + ii * nw
      slot = lax.rem(i, stages)
      t0 = start + i * BLOCK
      plgpu.barrier_wait(kc_bar.at[slot])
      plgpu.barrier_wait(ks_bar.at[slot])

      # Both operands are built before either product is issued: registers defined while
      # a wgmma is in flight make ptxas serialise the wgmmas (C7513).
      if skip == 2:  # timing ablation: a constant key operand (no dequantization)
        a0 = a1 = plgpu.layout_cast(jnp.full((T, HEAD_DIM), 0.5, jdt), wgmma_layout)
      else:
        a0 = dequant(kc_s.at[slot], ks_s.at[slot], 0)
        a1 = dequant(kc_s.at[slot], ks_s.at[slot], 1)

      def keys(s0_ref, s1_ref):
        plgpu.wgmma(s0_ref, a0, qt)
        plgpu.wgmma(s1_ref, a1, qt)
        return s0_ref[...], s1_ref[...]
      s0, s1 = pl.run_scoped(keys, plgpu.ACC((T, np_), jnp.float32),
                             plgpu.ACC((T, np_), jnp.float32))
      s0 = jnp.where(rows + t0 < end, s0 * scale2, -jnp.inf)
      s1 = jnp.where(rows + (t0 + T) < end, s1 * scale2, -jnp.inf)
      m_new = jnp.maximum(m_i, frag.col_reduce("max", jnp.maximum(s0, s1), red_s.at[w]))
      alpha = jnp.exp2(m_i - m_new)
      mb = lax.broadcast_in_dim(m_new, (T, np_), [1])
      p0, p1 = jnp.exp2(s0 - mb), jnp.exp2(s1 - mb)
      ab = lax.broadcast_in_dim(alpha, (T, np_), [1])
      l_t = l_t * ab + p0 + p1
      frag.store_transposed(p0.astype(jdt), p_s.at[w], row_offset=0)
      frag.store_transposed(p1.astype(jdt), p_s.at[w], row_offset=T)
      plgpu.commit_smem()
      acc0[...] = acc0[...] * ab
      acc1[...] = acc1[...] * ab
      plgpu.barrier_wait(vc_bar.at[slot])
      plgpu.barrier_wait(vs_bar.at[slot])
      if skip == 1:  # timing ablation: no value path
        plgpu.barrier_arrive(free.at[slot])
        return m_new, l_t
      if skip == 3:  # timing ablation: a constant value operand (no dequantization)
        v0 = v1 = plgpu.layout_cast(jnp.full((T, BLOCK), 0.5, jdt), wgmma_layout)
      else:
        v0 = dequant(vc_s.at[slot], vs_s.at[slot], 0)
        v1 = dequant(vc_s.at[slot], vs_s.at[slot], 1)
      plgpu.barrier_arrive(free.at[slot])  # operands are in registers now
      plgpu.wgmma(acc0, v0, pt)
      plgpu.wgmma(acc1, v1, pt)
      if not p["async_values"]:
        plgpu.wgmma_wait(0)
      return m_new, l_t

    def run(acc0, acc1):
      acc0[...] = zero
      acc1[...] = zero
      m_i, l_t = lax.fori_loop(0, mine, functools.partial(step, acc0=acc0, acc1=acc1),
                               (m0, l0))
      return acc0[...], acc1[...], m_i, l_t
    o0, o1, m_i, l_t = pl.run_scoped(run, plgpu.ACC((T, np_), jnp.float32),
                                     plgpu.ACC((T, np_), jnp.float32))
    l_i = frag.col_reduce("add", l_t, red_s.at[w])
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    lb = lax.broadcast_in_dim(l_safe, (T, np_), [1])
    part = sid * nw + w
    o_ref.at[pid, part, pl.ds(0, T)][...] = o0 / lb
    o_ref.at[pid, part, pl.ds(T, T)][...] = o1 / lb
    lse_ref.at[pid, part][...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * math.log(2.0),
                                           -jnp.inf)

  for w in range(nw):
    pl.when(wg == w)(functools.partial(compute, w))

  pl.when(wg == nw)(functools.partial(
      ring.produce, q_ref.at[pid], q_s, q_bar,
      ((kc_ref, kc_s, kc_bar), (ks_ref, ks_s, ks_bar), (vc_ref, vc_s, vc_bar),
       (vs_ref, vs_s, vs_bar)), free, b=b, head=head, start=start, n_blocks=n_blocks,
      stages=stages))


def _call(p, dtype, sm_scale, qt, cache: KiviMosaic, lengths):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  nw, stages, np_, ns = p["w"], p["stages"], p["np"], p["num_splits"]
  jdt = jnp.dtype(dtype)
  swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def entry(q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, o_ref, lse_ref):
    scratch = [
        plgpu.SMEM((np_, HEAD_DIM), jdt, transforms=swz),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, 4, 256), jdt),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, 4, 256), jdt),
        plgpu.SMEM((nw, np_, BLOCK), jdt, transforms=swz),
        plgpu.SMEM((nw, RED_PER_COL * np_), jnp.float32),
    ]
    bars = (
        plgpu.Barrier(num_barriers=1),
        *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    )
    pl.run_scoped(
        lambda *refs: _kernel(p, dtype, sm_scale, q_ref, kc_ref, ks_ref, vc_ref, vs_ref,
                              len_ref, o_ref, lse_ref, refs[:7], refs[7:]),
        *scratch, *bars, collective_axes="wg")

  kvh = p["b"] * p["kh"]
  out_types = (jax.ShapeDtypeStruct((kvh, ns * nw, HEAD_DIM, np_), jnp.float32),
               jax.ShapeDtypeStruct((kvh, ns * nw, np_), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_types, grid=p["grid"], grid_names=("p", "s"),
      num_threads=nw + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(qt, cache.kc, cache.ks, cache.vc, cache.vs, lengths)


def kivi_attention_mosaic(q, cache: KiviMosaic, k_win, v_win, q_len, w_len, *, scale=None,
                          out_dtype=None, warpgroups=3, stages=None, num_splits=None,
                          async_values=False, window_implementation="xla",
                          return_partials=False, skip=0):
  """KIVI-2bit decode attention over a `KiviMosaic` cache plus the exact window.

  Args: as `reference.kivi_attention_reference`, with the quantized prefix given as one
    `KiviMosaic` (`mosaic_layout.to_mosaic`); warpgroups (compute warpgroups per CTA),
    stages (ring depth, a multiple of warpgroups; None: the deepest that fits, up to
    4 per warpgroup), num_splits, async_values: launch knobs (`plan`); skip: timing
    ablation (`plan`); window_implementation: the `decode_attention` implementation that
    attends the window.
  Returns:
    (out [B, N, H], lse [B, N]) (+ the raw partials if return_partials).
  """
  dtype = ring.scale_dtype(NAME, cache, "wgmma")
  p = plan(q.shape, cache.kc.shape, warpgroups=warpgroups, stages=stages,
           num_splits=num_splits, async_values=async_values, skip=skip)
  sm_scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  qt = ring.query_operand(q, p, dtype)
  o_t, lse_t = _call(p, dtype, sm_scale, qt, cache, q_len.astype(jnp.int32))
  return ring.merge_with_window(q, o_t, lse_t, p["num_splits"] * p["w"], p, k_win, v_win,
                                w_len, scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)
