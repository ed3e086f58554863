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
here every warp keeps its own online-softmax state. After an item's blocks the 4 W warps'
partials are merged in shared memory into one (o, lse) per item, and the wrapper merges the
splits with the exact window's partial in one LSE combine.

Work: B * K * num_splits items (a split of one KV head's sequence, `ring.item_geometry`). Grid:
one CTA per item, or (`plan`'s persistent, the default, GEAR-L's extension included) at most one per
multiprocessor, each running its items one after another through the same ring, so the
producer streams the next item's q and blocks while the compute warpgroups finish the current
one. Why: a CTA takes all of a multiprocessor (its registers), and a CTA's fixed costs were
~3.5 µs per wave of splits (results/decode_ablations.md, "the fixed cost of a wave of CTAs").
Warpgroup W is the TMA producer (`mosaic_ring`: codes and scales of keys and values per
128-token block into a ring), warpgroup w < W takes an item's blocks w, w + W, ..., two per
online-softmax step where the ring holds both (`plan`'s "group": the loop is latency-bound,
and two blocks' chains interleave). Instructions are PTX through
`mosaic_ptx` inside `plgpu.inline_mgpu`.

Dequantization (`mosaic_warp_step`): the key scales are multiplied into q's B fragments (a
warp's 32 tokens are one key group) and the value scales into p's (per channel group), so
the value codes enter the products as exact small integers (a lop3 and one packed FMA per
pair) and the key codes as the lop3's 1024 + c / f alone (q's fragments pre-scaled by f,
1024's share subtracted by one more product per k-step); the zero points are added through
one m16n8k16 product per k-step whose A operand is the scale/zero chunk as loaded. Why: it
takes half of the packed FMAs of dequantizing every element (c * s + z per pair, the variant
it replaced), and the keys' FMAs went too (results/decode_ablations.md, "KIVI-2's key codes
without the packed FMA"). Timings against the dense kernels and that variant, and the loop's
SASS instruction mix: BENCHMARKS.md.

Choices: q in the scales' 16-bit type (and q f, exact: f a power of two), scores scaled in
f32, p rounded to the 16-bit type for the value product, tokens in [length, capacity) read
and masked; q f * s and p * s are rounded once each (p twice in all) and the zero points
summed exactly in f32.
Restrictions: `mosaic_layout`'s (2-bit, groups of 32, H = 128, capacity a multiple of 128,
fp16/bf16 scales), QPK <= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import mosaic_ring as ring
from . import mosaic_warp_step as ws
from .mosaic_layout import BLOCK, HEAD_DIM, KiviMosaic, check_mosaic, scale_rows

LOG2E = 1.4426950408889634


NAME = "mosaic KIVI (warp)"


def _smem_bytes(w, stages, np_, group=32, q_slots=1):
  kib = lambda n: -(-n // 1024) * 1024
  return (stages * ring.slot_bytes(group) + kib(q_slots * np_ * HEAD_DIM * 2)   # ring, q
          + kib(4 * w * HEAD_DIM * np_ * 4) + kib(4 * w * 2 * np_ * 4)  # warp partials
          + kib(HEAD_DIM * np_ * 4) + kib(np_ * 4) + 512)  # merged partial, barriers


def plan(q_shape, cache_shape, *, warpgroups=2, stages=None, num_splits=None,
         extra_smem=None, kgroup=32, persistent=True, ctas=None):
  """Launch geometry (dict) with ValueErrors naming the bad argument (`ring.plan_ring`).

  Args:
    q_shape: (B, N, H).
    cache_shape: the shape of `KiviMosaic.kc`, (B, K, S / 128, 4, 256) (the first three
      are read).
    warpgroups: compute warpgroups W (1, 2 or 3).
    stages: ring slots (a multiple of W); None: the deepest that fits.
    num_splits: split-K override (None: wave-balanced).
    extra_smem: None, or (w, stages, np, q_slots) -> the shared-memory bytes a caller's
      extension (`launch`'s `ext`) adds (its per-item constants: one copy per q slot).
    kgroup: the cache's key / value group (32 or 64, `KiviMosaic.group`).
    persistent: at most one CTA per multiprocessor, each running its items (splits) one
      after another through one ring (`ring.item_geometry`), so a CTA's fixed costs (q and
      the ring's first blocks in flight, the launch) are paid once per multiprocessor, not
      once per wave of splits; False: a CTA per split.
    ctas: the persistent CTA count (None: min(multiprocessors, items); tests force a few).
  The plan's "group": each warp takes its blocks GROUP at a time, one online-softmax step
  over them (`mosaic_warp_step.block_step`), 2 where the ring holds both (stages >= 2 W),
  else 1. Why 2: the loop is latency-bound (one CTA per multiprocessor, each block a
  dependent chain), and two blocks' chains interleave; measured in BENCHMARKS.md.
  """
  if ctas is not None and (not persistent or ctas < 1):
    raise ValueError(f"{NAME}: ctas ({ctas}) needs persistent=True and must be >= 1")

  def ring_plan(q_slots, ns):
    base = lambda w, st, np_: _smem_bytes(w, st, np_, kgroup, q_slots)
    smem = base if extra_smem is None else (
        lambda w, st, np_: base(w, st, np_) + extra_smem(w, st, np_, q_slots))
    return ring.plan_ring(NAME, q_shape, cache_shape, warpgroups=warpgroups, stages=stages,
                          num_splits=ns, smem_bytes=smem)

  p = ring_plan(1, num_splits)
  items = p["b"] * p["kh"] * p["num_splits"]
  n_cta = items if not persistent else min(items, ctas or ring.num_sms())
  q_slots = 1
  if n_cta < items:  # several items per CTA: the next item's q (and constants) double-buffered
    p, q_slots = ring_plan(2, p["num_splits"]), 2
  return dict(p, group=2 if p["stages"] >= 2 * p["w"] else 1, kgroup=kgroup, items=items,
              ctas=n_cta, q_slots=q_slots)


def _kernel(p, dtype, sm_scale, ext, q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, ext_in,
            o_ref, lse_ref, smem, bars, ext_smem, ext_bars):
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  nw, stages, np_, ns, kh = p["w"], p["stages"], p["np"], p["num_splits"], p["kh"]
  n_cta = p["ctas"]
  nt = np_ // 8
  q_s, kc_s, ks_s, vc_s, vs_s, wo_s, wml_s, o_s, lse_s = smem
  q_bar, q_free, slot_bar, free, done, merged = bars
  layout = plgpu.Layout.WGMMA
  sds = lambda cols, dt: plgpu.ShapeDtypeStruct((64, cols), dt, layout=layout)
  acc_t, ml_t, qb_t = sds(64 * nt, jnp.float32), sds(8 * nt, jnp.float32), sds(64 * nt,
                                                                               jnp.int32)
  ref = plgpu.RefType()
  cta = lax.axis_index("p")
  wg = lax.axis_index("wg")
  # the CTA's items: p["items"] = B K splits, `n_cta` apart (`ring.item_geometry`); one each
  # where n_cta = items (`plan`'s persistent=False, or one wave)
  n_items = 1 if n_cta == p["items"] else lax.div(p["items"] - cta + n_cta - 1, n_cta)
  item = functools.partial(ring.item_geometry, pid=cta, n_cta=n_cta, ns=ns, kh=kh,
                           lengths=len_ref)
  scale2 = sm_scale * LOG2E

  def bind(j):  # ext (a caller's extra terms, `launch`) bound to item j and its q slot
    pair, _, b, head, _, _, _ = item(j)
    return ext.bind(p, dtype, b=b, head=head, pid=pair, cslot=lax.rem(j, p["q_slots"]),
                    inputs=ext_in, smem=ext_smem, bars=ext_bars, slot_bar=slot_bar)

  # x: None for KIVI; else the extension bound to the CTA's first item, for what does not
  # depend on the item (the steps' hooks, the state's types); each item binds its own
  x = None if ext is None else bind(0)
  n_ref, n_state, n_const = (0, 0, 0) if x is None else (x.refs_per_block, x.n_state,
                                                         x.n_const)

  @plgpu.inline_mgpu(arg_types=(ref,), return_type=qb_t)
  def load_q(_, q):
    return ws.query_fragments(q, nt, dtype)

  @plgpu.inline_mgpu(return_type=(acc_t, ml_t, ml_t))
  def init(_):
    return ws.initial_state(nt)

  def make_step(k, general):  # one online-softmax step over k blocks (`ws.block_step`)
    per = 4 + n_ref
    ret = (acc_t, ml_t, ml_t) + (() if x is None else x.state_types(sds))

    @plgpu.inline_mgpu(arg_types=(ref,) * (per * k) + (layout,) * (4 + n_state + n_const
                                                                   + k * (1 + (x is not None))),
                       return_type=ret)
    def step(_, *args):
      refs, rest = args[:per * k], args[per * k:]
      (qb, acc, ml, zacc), rest = rest[:4], rest[4:]
      state, rest = rest[:n_state], rest[n_state:]
      const, rest = rest[:n_const], rest[n_const:]
      valids, extras = rest[:k], rest[k:]
      slots = [tuple(refs[per * j:per * j + 4]) for j in range(k)]
      hook = None if x is None else x.step_hook(
          [refs[per * j + 4:per * (j + 1)] for j in range(k)], state, const, extras, nt=nt,
          general=general)
      out = ws.block_step(slots, qb, acc, ml, zacc, list(valids), nt=nt, dtype=dtype,
                          scale2=scale2, ext=hook, group=p["kgroup"])
      return out if hook is None else out + hook.state()
    return step

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout, ref, ref))
  def publish(_, acc, ml, zacc, wo, wml):
    ws.publish_partial(acc, ml, zacc, wo, wml, nt, group=p["kgroup"])

  @plgpu.inline_mgpu(arg_types=(ref,) * (4 + (0 if x is None else len(x.merge_refs()))))
  def merge(_, wo, wml, o, lse, *extra):
    ws.merge_partials(wo, wml, o, lse, 4 * nw, np_,
                      extra=None if x is None else x.merge_hook(extra, 4 * nw, np_))

  def compute(w):
    plgpu.set_max_registers(p["regs"], action="increase")
    # once before the first item: the ring slots this warpgroup reads and the q slots are
    # free, and the (absent) previous item's partials merged
    for slot in range(w, stages, nw):
      plgpu.barrier_arrive(free.at[slot])
    for qs in range(q_s.shape[0]):
      plgpu.barrier_arrive(q_free.at[qs])
    if w == 0:
      plgpu.barrier_arrive(merged)
    k = p["group"]

    def run_item(j):
      pair, sid, _, _, start, end, n_blocks = item(j)
      qs = lax.rem(j, q_s.shape[0])
      xj = None if x is None else bind(j)
      plgpu.barrier_wait(q_bar.at[qs])
      qb = load_q(q_s.at[qs])
      const = () if xj is None else xj.load_const()
      mine = jnp.maximum(n_blocks - w + nw - 1, 0) // nw  # blocks w, w + W, ...

      def arrived(i):  # block i's slot (its operands) and its valid-token count
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(slot_bar.at[slot])
        refs = (kc_s.at[slot], ks_s.at[slot], vc_s.at[slot], vs_s.at[slot])
        valid = plgpu.layout_cast(jnp.full((64, 8), end - (start + i * BLOCK), jnp.int32),
                                  layout)
        extras = ()
        if xj is not None:
          refs += xj.arrived(slot)
          extras = (xj.block_value(start + i * BLOCK, layout),)
        return slot, refs, valid, extras

      def body(k, first, general, ii, carry):  # blocks w + (first + k ii + j) W, j < k
        got = [arrived(w + (first + k * ii + jj) * nw) for jj in range(k)]
        carry = steps[k, general](*[r for _, refs, _, _ in got for r in refs], qb, *carry,
                                  *const, *[valid for _, _, valid, _ in got],
                                  *[e for _, _, _, ex in got for e in ex])
        for slot, _, _, _ in got:
          plgpu.barrier_arrive(free.at[slot])
        return carry

      def run(first, count, general, carry):  # `count` of this warpgroup's blocks from `first`
        carry = lax.fori_loop(0, count // k, functools.partial(body, k, first, general), carry)
        if k > 1:  # the last count % k blocks, one at a time
          carry = lax.fori_loop(0, count % k, functools.partial(
              body, 1, first + count - count % k, general), carry)
        return carry

      carry = tuple(init()) + (() if xj is None else tuple(xj.init_state()))
      if xj is None:
        carry = run(0, mine, False, carry)
      else:  # the extension's plain blocks first (no per-warp branches), then the general ones
        plain = jnp.minimum(
            jnp.maximum(xj.plain_blocks(start, n_blocks) - w + nw - 1, 0) // nw, mine)
        carry = run(plain, mine - plain, True, run(0, plain, False, carry))
      # q's slot is free once the item's blocks are done, not once load_q has run: the
      # compiled steps read the slot during the item (measured on an H200: with the arrival
      # right after load_q, an empty next item let the producer copy the next-but-one
      # item's q into this slot mid-item, and the item's partial came out wrong). An
      # extension's constants share the slot, and warpgroup 0's merge reads them: there,
      # warpgroup 0 releases it after the merge
      after_merge = xj is not None and w == 0
      if not after_merge:
        plgpu.barrier_arrive(q_free.at[qs])
      # every thread of warpgroup 0 has merged the previous item's partials out of wo_s /
      # wml_s (warpgroup 0's own warps too: one could otherwise publish a short item while
      # another still reads its region)
      plgpu.barrier_wait(merged)
      publish(*carry[:3], wo_s, wml_s)
      if xj is not None:
        xj.publish(carry[3:])
      plgpu.barrier_arrive(done)
      if w == 0:
        plgpu.barrier_wait(done)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's copies of o_s
        merge(wo_s, wml_s, o_s, lse_s, *(() if xj is None else xj.merge_refs()))
        plgpu.barrier_arrive(merged)
        if after_merge:
          plgpu.barrier_arrive(q_free.at[qs])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref.at[pair, sid])
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[pair, sid])

    if n_cta == p["items"]:
      run_item(0)
    else:
      pl.loop(0, n_items)(run_item)
    if w == 0:
      plgpu.wait_smem_to_gmem(0)

  steps = {(k, g): make_step(k, g) for k in {1, p["group"]}
           for g in ((False,) if x is None else (False, True))}
  for w in range(nw):
    pl.when(wg == w)(functools.partial(compute, w))

  pl.when(wg == nw)(functools.partial(
      ring.produce, q_ref, q_s, q_bar, q_free,
      ((kc_ref, kc_s), (ks_ref, ks_s), (vc_ref, vc_s), (vs_ref, vs_s)), slot_bar, free,
      n_items=n_items, item=item, stages=stages, extra=None if ext is None else bind))


def launch(p, dtype, sm_scale, qt, cache: KiviMosaic, lengths, ext=None, ext_inputs=()):
  """The kernel's (o^T [B K, splits, 128, NP], lse [B K, splits, NP]) partials.

  ext: None (KIVI), or extra terms a caller adds (GEAR's low-rank residual,
  `kvlowrank_kernels.gear.mosaic_gear`), with their gmem operands `ext_inputs` (appended to
  the kernel's inputs). Its protocol: `scratch(p, dtype)` / `barriers(p)` list its shared
  memory and barriers; `ring_arrivals`: the arrivals it adds to a ring slot's barrier (its
  per-block copies arrive on the block's slot barrier, so the compute warps wait on no
  more barriers than KIVI's); `bind(p, dtype, b=, head=, pid=, cslot=, inputs=, smem=, bars=,
  slot_bar=)` returns the object bound to one item (sequence b, KV head `head`, pair pid; its
  constants in slot cslot of p["q_slots"], released with the item's q slot after warpgroup
  0's merge) that the kernel body calls: `copy_const()` / `copy_block(block, slot)` in the
  producer (`mosaic_ring.produce`); in each compute warpgroup `load_const()` (the item's
  constants), `init_state()`, `plain_blocks(start, n_blocks)` (how many of the
  split's first blocks take the plain step: `step_hook(..., general=False)`; the rest take
  `general=True`), per block `arrived(slot)` (its slot refs; the slot's barrier covers them) and
  `block_value(first token, layout)`, `step_hook(...)` inside each step
  (`mosaic_warp_step.block_step`'s `ext`), `state_types(sds)`, `publish(state)`,
  `merge_refs()` and `merge_hook(refs, n_warps, np)` (`mosaic_warp_step.merge_partials`);
  attributes refs_per_block, n_state, n_const.
  """
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  nw, stages, np_, ns = p["w"], p["stages"], p["np"], p["num_splits"]
  jdt = jnp.dtype(dtype)
  n_in = len(ext_inputs)
  rows = scale_rows(p["kgroup"])

  def entry(q_ref, kc_ref, ks_ref, vc_ref, vs_ref, len_ref, *rest):
    ext_in, (o_ref, lse_ref) = rest[:n_in], rest[n_in:]
    scratch = [
        plgpu.SMEM((p["q_slots"], np_, HEAD_DIM), jdt),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, rows, 256), jdt),
        plgpu.SMEM((stages, 4, 256), jnp.uint32),
        plgpu.SMEM((stages, rows, 256), jdt),
        plgpu.SMEM((4 * nw, HEAD_DIM, np_), jnp.float32),
        plgpu.SMEM((4 * nw, 2, np_), jnp.float32),
        plgpu.SMEM((HEAD_DIM, np_), jnp.float32),
        plgpu.SMEM((np_,), jnp.float32),
    ]
    more = 0 if ext is None else ext.ring_arrivals
    bars = (
        plgpu.Barrier(num_barriers=p["q_slots"]),
        plgpu.Barrier(num_arrivals=nw, num_barriers=p["q_slots"]),
        # one per ring slot: the block's four copies (and an extension's) arrive on it. Why
        # not one per array: the compute warps' three extra waits per block cost issue
        # slots (results/decode_ablations.md, "the producer's share of the issue slots")
        plgpu.Barrier(num_arrivals=4 + more, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=nw, num_barriers=1),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),
    )
    x_scratch = [] if ext is None else list(ext.scratch(p, dtype))
    x_bars = () if ext is None else tuple(ext.barriers(p))
    n_s, n_b = len(scratch), len(bars)
    pl.run_scoped(
        lambda *refs: _kernel(p, dtype, sm_scale, ext, q_ref, kc_ref, ks_ref, vc_ref, vs_ref,
                              len_ref, ext_in, o_ref, lse_ref, refs[:n_s],
                              refs[n_s + len(x_scratch):n_s + len(x_scratch) + n_b],
                              refs[n_s:n_s + len(x_scratch)],
                              refs[n_s + len(x_scratch) + n_b:]),
        *scratch, *x_scratch, *bars, *x_bars, collective_axes="wg")

  kvh = p["b"] * p["kh"]
  out_types = (jax.ShapeDtypeStruct((kvh, ns, HEAD_DIM, np_), jnp.float32),
               jax.ShapeDtypeStruct((kvh, ns, np_), jnp.float32))
  return plgpu.kernel(
      entry, out_type=out_types, grid=(p["ctas"],), grid_names=("p",),
      num_threads=nw + 1, thread_name="wg",
  )(qt, cache.kc, cache.ks, cache.vc, cache.vs, lengths, *ext_inputs)


def kivi_attention_mosaic_warp(q, cache: KiviMosaic, k_win, v_win, q_len, w_len, *,
                               scale=None, out_dtype=None, warpgroups=2, stages=None,
                               num_splits=None, persistent=True, ctas=None,
                               window_implementation=None, return_partials=False):
  """KIVI-2bit decode attention over a `KiviMosaic` cache plus the exact window.

  Args:
    q: [B, N, H] decode query (RoPE applied), H = 128.
    cache: the quantized prefix in the kernel's layout (`mosaic_layout`), capacity S.
    k_win, v_win: [B, W, K, H] full-precision recent tokens.
    q_len: [B] quantized tokens per sequence; w_len: [B] window tokens.
    scale: default H ** -0.5; out_dtype: default q.dtype.
    warpgroups, stages, num_splits, persistent, ctas: launch knobs (`plan`).
    window_implementation: the window's attention and the merge: None (the fastest that
      runs), "fused" (one Triton launch), "xla" (the reference), or a `dense.decode_attention`
      implementation.
    return_partials: also return the raw (o, lse) partials (the splits' and the window's).
  Returns:
    (out [B, N, H], lse [B, N] float32), plus the partials if asked.
  """
  dtype = check_mosaic(cache)
  p = plan(q.shape, cache.kc.shape, warpgroups=warpgroups, stages=stages,
           num_splits=num_splits, kgroup=cache.group, persistent=persistent, ctas=ctas)
  sm_scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  qt = ring.query_operand(q, p, dtype)
  o_t, lse_t = launch(p, dtype, sm_scale, qt, cache, q_len.astype(jnp.int32))
  return ring.merge_with_window(q, qt, o_t, lse_t, p["num_splits"], p, k_win, v_win, w_len,
                                scale=scale, out_dtype=out_dtype,
                                window_implementation=window_implementation,
                                return_partials=return_partials)
