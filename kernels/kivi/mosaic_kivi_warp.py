"""KIVI-2bit decode attention in Pallas Mosaic GPU with warp-level tensor-core products.

Why next to `mosaic_kivi` (wgmma): there, each 128-token block costs 32 m64n8k16 wgmmas
(N = 8 query columns: the tensor pipe runs them at a small fraction of its rate) and two
warpgroup-wide exchanges (the column max through shared memory, p^T as the value products'
B operand). Measured: ~1,650 cycles per block and SM against ~810 for its bytes. Here each
warp owns 32 tokens of every block it sees, end to end, with `mma.sync` m16n8k16 products
whose operands are registers, so nothing in the loop is shared between warps:
  s [32 tokens, NP]  = dequant(K codes) @ q^T     (A: keys, the same register order as the
                                                   wgmma kernel; B: q, held in registers)
  per-head max over the warp's tokens: 3 butterfly shuffles; p = 2^(s - m)
  p -> B operand: one `movmatrix` transpose per 8 x 8 (the score fragment's rows are tokens,
                  the value product's B wants tokens along K)
  o^T [128 ch, NP]  += dequant(V^T codes of the warp's tokens) @ p   (values: the "warp"
                                                   layout of `mosaic_layout`)
Each warp keeps its own online-softmax state; after the loop the 4 W warps' partials are
merged in shared memory into one (o, lse) per CTA, and the wrapper merges the splits with the
exact window's partial in one LSE combine (as `mosaic_kivi`).

Grid (B * K, num_splits); warpgroup W is the TMA producer (the ring of `mosaic_kivi`:
codes and scales of keys and values per 128-token block), warpgroup w < W takes blocks
w, w + W, ... Instructions are PTX through `mosaic_ptx` inside `plgpu.inline_mgpu`.

Dequantization (`dequant`): "fold", the default, multiplies the key scales into q's B
fragments (a warp's 32 tokens are one key group) and the value scales into p's (per channel
group), so the codes enter the products as exact small integers (a lop3 and one packed FMA
per pair), and adds the zero points through one m16n8k16 product per k-step whose A operand
is the scale/zero chunk as loaded (`mosaic_warp_step`); "fma" dequantizes every element,
c * s + z (two packed FMAs per pair).

Measured (H200, interleaved rounds, BENCHMARKS.md "tenth" and "eleventh session"): with
"fold", 2.15-3.15x the cuDNN dense kernel at 16K/64K, B = 8/32, and 0.89-1.005x the time of
"fma" (geometric mean 0.96); warpgroups 2 (the default) and 3 are within 4% of each other.
The loop is 568 SASS instructions per warp and block with "fold" (137 LOP3, 128 HFMA2,
32 HMUL2, 42 HMMA), 630 with "fma" (256 HFMA2). Ablations (`skip`): no dequantization at all
(skip=4) takes 0.61x the "fma" call, so the dequantization still bounds the kernel.

Choices (as `mosaic_kivi`): q unscaled in the scales' 16-bit type, scores scaled in f32,
p rounded to the 16-bit type for the value product, tokens in [length, capacity) read and
masked. "fma" rounds each dequantized element once; "fold" rounds q * s and p * s once each
(p twice in all) and sums the zero points exactly in f32 (measured error against the
float32 reference: the same as "fma" with fp16 scales, up to 2x with bf16). Restrictions:
`mosaic_layout`'s (2-bit, groups of 32, H = 128, capacity a multiple of 128), QPK <= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..common import splitk
from . import mosaic_ring as ring
from . import mosaic_warp_step as ws
from .mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic

LOG2E = 1.4426950408889634


NAME = "mosaic KIVI (warp)"


def _smem_bytes(w, stages, np_):
  kib = lambda n: -(-n // 1024) * 1024
  return (stages * ring.SLOT_BYTES + kib(np_ * HEAD_DIM * 2)          # ring, q
          + kib(4 * w * HEAD_DIM * np_ * 4) + kib(4 * w * 2 * np_ * 4)  # warp partials
          + kib(HEAD_DIM * np_ * 4) + kib(np_ * 4) + 512)  # merged partial, barriers


DEQUANT = ("fold", "fma", "fold-keys", "fold-values")


def plan(q_shape, cache_shape, *, warpgroups=2, stages=None, num_splits=None,
         dequant="fold", skip=0):
  """Launch geometry (dict) with ValueErrors naming the bad argument (`ring.plan_ring`).
  dequant: "fold" (scales folded into q and p, zero points by small products) or "fma"
  (every element dequantized, two HFMA2 per pair), or "fold-keys" / "fold-values" (one side
  folded); `mosaic_warp_step.block_step`.
  skip: timing ablation (wrong output): 1 no value path, 2 / 3 / 4 constant key / value /
  both operands, 5 / 6 ("fma" only) dequantization without the scale FMA / as the bare lop3."""
  if dequant not in DEQUANT:
    raise ValueError(f"{NAME}: dequant must be one of {DEQUANT}, got {dequant!r}")
  if skip in (5, 6) and dequant != "fma":
    raise ValueError(f"{NAME}: skip={skip} is an ablation of dequant='fma'")
  p = ring.plan_ring(NAME, q_shape, cache_shape, warpgroups=warpgroups, stages=stages,
                     num_splits=num_splits, skip=skip, smem_bytes=_smem_bytes,
                     skips=tuple(range(7)))
  return dict(p, fold=(dequant in ("fold", "fold-keys"), dequant in ("fold", "fold-values")))


def _kernel(p, dtype, sm_scale, q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, o_ref,
            lse_ref, smem, bars):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  nw, stages, np_, ns, kh = p["w"], p["stages"], p["np"], p["num_splits"], p["kh"]
  nt = np_ // 8
  q_s, kc_s, ks_s, vc_s, vs_s, wo_s, wml_s, o_s, lse_s = smem
  q_bar, kc_bar, ks_bar, vc_bar, vs_bar, free, done = bars
  layout = plgpu.Layout.WGMMA
  sds = lambda cols, dt: plgpu.ShapeDtypeStruct((64, cols), dt, layout=layout)
  acc_t, ml_t, qb_t = sds(64 * nt, jnp.float32), sds(8 * nt, jnp.float32), sds(32 * nt,
                                                                               jnp.int32)
  ref = plgpu.RefType()
  pid = lax.axis_index("p")
  sid = lax.axis_index("s")
  wg = lax.axis_index("wg")
  b, head = pid // kh, pid % kh
  start, end, n_blocks = splitk.split_bounds(len_ref[b], ns, sid, BLOCK)
  scale2 = sm_scale * LOG2E

  @plgpu.inline_mgpu(arg_types=(ref,), return_type=qb_t)
  def load_q(_, q):
    return ws.query_fragments(q, nt, dtype)

  @plgpu.inline_mgpu(return_type=(acc_t, ml_t, ml_t))
  def init(_):
    return ws.initial_state(nt)

  @plgpu.inline_mgpu(arg_types=(ref, ref, ref, ref) + (layout,) * 5,
                     return_type=(acc_t, ml_t, ml_t))
  def step(_, kc, ks, vc, vs, qb, acc, ml, zacc, valid):
    return ws.block_step(kc, ks, vc, vs, qb, acc, ml, zacc, valid, nt=nt, dtype=dtype,
                         scale2=scale2, fold=p["fold"], skip=p["skip"])

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout, ref, ref))
  def publish(_, acc, ml, zacc, wo, wml):
    ws.publish_partial(acc, ml, zacc, wo, wml, nt, p["fold"][1])

  @plgpu.inline_mgpu(arg_types=(ref, ref, ref, ref))
  def merge(_, wo, wml, o, lse):
    ws.merge_partials(wo, wml, o, lse, 4 * nw, np_)

  def compute(w):
    plgpu.set_max_registers(p["regs"], action="increase")
    plgpu.barrier_wait(q_bar)
    qb = load_q(q_s)
    mine = jnp.maximum(n_blocks - w + nw - 1, 0) // nw

    def body(ii, carry):
      i = w + ii * nw
      slot = lax.rem(i, stages)
      for bar in (kc_bar, ks_bar, vc_bar, vs_bar):
        plgpu.barrier_wait(bar.at[slot])
      valid = plgpu.layout_cast(jnp.full((64, 8), end - (start + i * BLOCK), jnp.int32),
                                layout)
      carry = step(kc_s.at[slot], ks_s.at[slot], vc_s.at[slot], vs_s.at[slot], qb, *carry,
                   valid)
      plgpu.barrier_arrive(free.at[slot])
      return carry

    publish(*lax.fori_loop(0, mine, body, init()), wo_s, wml_s)
    plgpu.barrier_arrive(done)
    if w == 0:
      plgpu.barrier_wait(done)
      merge(wo_s, wml_s, o_s, lse_s)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_ref.at[pid, sid])
      plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[pid, sid])
      plgpu.wait_smem_to_gmem(0)

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

  def entry(q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, o_ref, lse_ref):
    scratch = [
        plgpu.SMEM((np_, HEAD_DIM), jdt),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, 4, 256), jdt),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, 4, 256), jdt),
        plgpu.SMEM((4 * nw, HEAD_DIM, np_), jnp.float32),
        plgpu.SMEM((4 * nw, 2, np_), jnp.float32),
        plgpu.SMEM((HEAD_DIM, np_), jnp.float32),
        plgpu.SMEM((np_,), jnp.float32),
    ]
    bars = (
        plgpu.Barrier(num_barriers=1),
        *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=nw, num_barriers=1),
    )
    pl.run_scoped(
        lambda *refs: _kernel(p, dtype, sm_scale, q_ref, kc_ref, ks_ref, vc_ref, vs_ref,
                              len_ref, o_ref, lse_ref, refs[:9], refs[9:]),
        *scratch, *bars, collective_axes="wg")

  kvh = p["b"] * p["kh"]
  out_types = (jax.ShapeDtypeStruct((kvh, ns, HEAD_DIM, np_), jnp.float32),
               jax.ShapeDtypeStruct((kvh, ns, np_), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_types, grid=p["grid"], grid_names=("p", "s"),
      num_threads=nw + 1, thread_name="wg",
  )(qt, cache.kc, cache.ks, cache.vc, cache.vs, lengths)


def kivi_attention_mosaic_warp(q, cache: KiviMosaic, k_win, v_win, q_len, w_len, *,
                               scale=None, out_dtype=None, warpgroups=2, stages=None,
                               num_splits=None, window_implementation="xla",
                               return_partials=False, dequant="fold", skip=0):
  """KIVI-2bit decode attention over a `KiviMosaic` cache in the "warp" layout plus the
  exact window; Args/Returns as `mosaic_kivi.kivi_attention_mosaic` (knobs: `plan`)."""
  dtype = ring.scale_dtype(NAME, cache, "warp")
  p = plan(q.shape, cache.kc.shape, warpgroups=warpgroups, stages=stages,
           num_splits=num_splits, dequant=dequant, skip=skip)
  sm_scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  qt = ring.query_operand(q, p, dtype)
  o_t, lse_t = _call(p, dtype, sm_scale, qt, cache, q_len.astype(jnp.int32))
  return ring.merge_with_window(q, o_t, lse_t, p["num_splits"], p, k_win, v_win, w_len,
                                scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)
