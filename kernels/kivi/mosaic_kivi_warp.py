"""KIVI-2bit decode attention in Pallas Mosaic GPU with warp-level tensor-core products.

Each warp owns 32 tokens of every 128-token block it sees, end to end, with `mma.sync`
m16n8k16 products whose operands are registers, so nothing in the loop is shared between
warps:
  s [32 tokens, NP]  = dequant(K codes) @ q^T     (A: keys, `mosaic_layout`; B: q, held in
                                                   registers)
  per-head max over the warp's tokens: 3 butterfly shuffles; p = 2^(s - m)
  p -> B operand: one `movmatrix` transpose per 8 x 8 (the score fragment's rows are tokens,
                  the value product's B wants tokens along K)
  o^T [128 ch, NP]  += dequant(V^T codes of the warp's tokens) @ p
Why warp-level products rather than warpgroup-wide wgmma: with N = 8 query columns a wgmma
runs at a small fraction of the tensor pipe's rate, and a warpgroup-wide block needs two
exchanges through shared memory (the column max, p^T as the value products' B operand);
here every warp keeps its own online-softmax state. After the loop the 4 W warps' partials
are merged in shared memory into one (o, lse) per CTA, and the wrapper merges the splits
with the exact window's partial in one LSE combine.

Grid (B * K, num_splits); warpgroup W is the TMA producer (`mosaic_ring`: codes and scales
of keys and values per 128-token block into a ring), warpgroup w < W takes blocks
w, w + W, ..., two per online-softmax step where the ring holds both (`plan`'s "group": the
loop is latency-bound, and two blocks' chains interleave). Instructions are PTX through
`mosaic_ptx` inside `plgpu.inline_mgpu`.

Dequantization (`mosaic_warp_step`): the key scales are multiplied into q's B fragments (a
warp's 32 tokens are one key group) and the value scales into p's (per channel group), so
the codes enter the products as exact small integers (a lop3 and one packed FMA per pair);
the zero points are added through one m16n8k16 product per k-step whose A operand is the
scale/zero chunk as loaded. Why: it takes half of the packed FMAs of dequantizing every
element (c * s + z per pair, the variant it replaced). Timings against the dense kernels
and that variant, and the loop's SASS instruction mix: BENCHMARKS.md.

Choices: q unscaled in the scales' 16-bit type, scores scaled in f32, p rounded to the
16-bit type for the value product, tokens in [length, capacity) read and masked; q * s and
p * s are rounded once each (p twice in all) and the zero points summed exactly in f32.
Restrictions: `mosaic_layout`'s (2-bit, groups of 32, H = 128, capacity a multiple of 128,
fp16/bf16 scales), QPK <= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..common import splitk
from . import mosaic_ring as ring
from . import mosaic_warp_step as ws
from .mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic, check_mosaic

LOG2E = 1.4426950408889634


NAME = "mosaic KIVI (warp)"


def _smem_bytes(w, stages, np_):
  kib = lambda n: -(-n // 1024) * 1024
  return (stages * ring.SLOT_BYTES + kib(np_ * HEAD_DIM * 2)          # ring, q
          + kib(4 * w * HEAD_DIM * np_ * 4) + kib(4 * w * 2 * np_ * 4)  # warp partials
          + kib(HEAD_DIM * np_ * 4) + kib(np_ * 4) + 512)  # merged partial, barriers


def plan(q_shape, cache_shape, *, warpgroups=2, stages=None, num_splits=None):
  """Launch geometry (dict) with ValueErrors naming the bad argument (`ring.plan_ring`).

  Args:
    q_shape: (B, N, H).
    cache_shape: the shape of `KiviMosaic.kc`, (B, K, S / 128, 4, 256) (the first three
      are read).
    warpgroups: compute warpgroups W (1, 2 or 3).
    stages: ring slots (a multiple of W); None: the deepest that fits.
    num_splits: split-K override (None: wave-balanced).
  The plan's "group": each warp takes its blocks GROUP at a time, one online-softmax step
  over them (`mosaic_warp_step.block_step`), 2 where the ring holds both (stages >= 2 W),
  else 1. Why 2: the loop is latency-bound (one CTA per multiprocessor, each block a
  dependent chain), and two blocks' chains interleave; measured in BENCHMARKS.md.
  """
  p = ring.plan_ring(NAME, q_shape, cache_shape, warpgroups=warpgroups, stages=stages,
                     num_splits=num_splits, smem_bytes=_smem_bytes)
  return dict(p, group=2 if p["stages"] >= 2 * p["w"] else 1)


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

  def make_step(k):  # one online-softmax step over k blocks (`mosaic_warp_step.block_step`)
    @plgpu.inline_mgpu(arg_types=(ref,) * (4 * k) + (layout,) * (4 + k),
                       return_type=(acc_t, ml_t, ml_t))
    def step(_, *args):
      refs, (qb, acc, ml, zacc), valids = args[:4 * k], args[4 * k:4 * k + 4], args[4 * k + 4:]
      slots = [tuple(refs[4 * j:4 * j + 4]) for j in range(k)]
      return ws.block_step(slots, qb, acc, ml, zacc, list(valids), nt=nt, dtype=dtype,
                           scale2=scale2)
    return step

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout, ref, ref))
  def publish(_, acc, ml, zacc, wo, wml):
    ws.publish_partial(acc, ml, zacc, wo, wml, nt)

  @plgpu.inline_mgpu(arg_types=(ref, ref, ref, ref))
  def merge(_, wo, wml, o, lse):
    ws.merge_partials(wo, wml, o, lse, 4 * nw, np_)

  def compute(w):
    plgpu.set_max_registers(p["regs"], action="increase")
    plgpu.barrier_wait(q_bar)
    qb = load_q(q_s)
    mine = jnp.maximum(n_blocks - w + nw - 1, 0) // nw  # blocks w, w + W, ...

    def arrived(i):  # block i's slot (its operands) and its valid-token count
      slot = lax.rem(i, stages)
      for bar in (kc_bar, ks_bar, vc_bar, vs_bar):
        plgpu.barrier_wait(bar.at[slot])
      valid = plgpu.layout_cast(jnp.full((64, 8), end - (start + i * BLOCK), jnp.int32),
                                layout)
      return slot, (kc_s.at[slot], ks_s.at[slot], vc_s.at[slot], vs_s.at[slot]), valid

    def body(k, first, ii, carry):  # blocks w + (first + k ii + j) W, j < k (k slots)
      got = [arrived(w + (first + k * ii + j) * nw) for j in range(k)]
      carry = steps[k](*[r for _, refs, _ in got for r in refs], qb, *carry,
                       *[valid for _, _, valid in got])
      for slot, _, _ in got:
        plgpu.barrier_arrive(free.at[slot])
      return carry

    k = p["group"]
    carry = lax.fori_loop(0, mine // k, functools.partial(body, k, 0), init())
    if k > 1:  # the last mine % k blocks, one at a time
      carry = lax.fori_loop(0, mine % k, functools.partial(body, 1, mine - mine % k), carry)
    publish(*carry, wo_s, wml_s)
    plgpu.barrier_arrive(done)
    if w == 0:
      plgpu.barrier_wait(done)
      merge(wo_s, wml_s, o_s, lse_s)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_ref.at[pid, sid])
      plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[pid, sid])
      plgpu.wait_smem_to_gmem(0)

  steps = {k: make_step(k) for k in {1, p["group"]}}
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
                               num_splits=None, window_implementation=None,
                               return_partials=False):
  """KIVI-2bit decode attention over a `KiviMosaic` cache plus the exact window.

  Args:
    q: [B, N, H] decode query (RoPE applied), H = 128.
    cache: the quantized prefix in the kernel's layout (`mosaic_layout`), capacity S.
    k_win, v_win: [B, W, K, H] full-precision recent tokens.
    q_len: [B] quantized tokens per sequence; w_len: [B] window tokens.
    scale: default H ** -0.5; out_dtype: default q.dtype.
    warpgroups, stages, num_splits: launch knobs (`plan`).
    window_implementation: the window's attention and the merge: None (the fastest that
      runs), "fused" (one Triton launch), "xla" (the reference), or a `dense.decode_attention`
      implementation.
    return_partials: also return the raw (o, lse) partials (the splits' and the window's).
  Returns:
    (out [B, N, H], lse [B, N] float32), plus the partials if asked.
  """
  dtype = check_mosaic(cache)
  p = plan(q.shape, cache.kc.shape, warpgroups=warpgroups, stages=stages,
           num_splits=num_splits)
  sm_scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  qt = ring.query_operand(q, p, dtype)
  o_t, lse_t = _call(p, dtype, sm_scale, qt, cache, q_len.astype(jnp.int32))
  return ring.merge_with_window(q, o_t, lse_t, p["num_splits"], p, k_win, v_win, w_len,
                                scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)
