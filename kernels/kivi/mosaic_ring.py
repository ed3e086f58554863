"""The pipeline around the Mosaic GPU KIVI kernel's compute warpgroups (`mosaic_kivi_warp`):
the launch plan's checks and ring depth, the query operand, the TMA producer warpgroup that
streams each 128-token block's key/value codes and scales into a `stages`-slot ring, and the
merge of the kernel's split-K partials with the exact window's.

Ring protocol: a CTA runs one or more items (a split of one KV head's sequence,
`item_geometry`), one after another through the same ring. Block i of an item goes to slot
i % stages, one barrier per slot signals the arrival of all its arrays, and the slot's consumer
(compute warpgroup i % W, since stages is a multiple of W) arrives on `free[slot]` once it no
longer reads the slot (and once before its first item). Where stages is a multiple of 4, warp
j of the producer warpgroup streams blocks j, j + 4, ... (`produce`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from ..common import splitk, triton_backend
from ..dense.xla import decode_attention_xla
from ..palu.mosaic_plan import SMEM_LIMIT, num_sms, query_columns
from .mosaic_layout import BLOCK, HEAD_DIM, scale_rows


def slot_bytes(group: int = 32) -> int:
  """A ring slot's bytes: the block's key and value codes (4 KiB each) and scale/zero pairs
  (2 KiB each at groups of 32, 1 KiB at 64)."""
  return 2 * (256 * 4 * 4) + 2 * scale_rows(group) * 512


def plan_ring(name, q_shape, cache_shape, *, warpgroups, stages, num_splits, smem_bytes):
  """The launch geometry (dict), with ValueErrors prefixed by `name` naming the bad
  argument. cache_shape: (B, K, S / 128, ...); smem_bytes(w, stages, np): the kernel's shared
  memory; stages None picks the deepest multiple of `warpgroups` that fits, up to 4 per
  warpgroup."""
  b, n, h = q_shape
  cb, kh, nb = cache_shape[:3]
  if h != HEAD_DIM:
    raise ValueError(f"{name}: head dim must be {HEAD_DIM}, got q.shape={q_shape}")
  if cb != b:
    raise ValueError(f"{name}: cache batch {cb} != q batch {b}")
  if n % kh:
    raise ValueError(f"{name}: query heads ({n}) must be a multiple of KV heads ({kh})")
  qpk = n // kh
  if qpk > 16:
    raise ValueError(f"{name}: at most 16 query heads per KV head, got {qpk}")
  if warpgroups not in (1, 2, 3):
    raise ValueError(f"{name}: warpgroups must be 1, 2 or 3, got {warpgroups}")
  np_ = query_columns(qpk)
  if stages is None:
    stages = warpgroups
    while (smem_bytes(warpgroups, stages + warpgroups, np_) <= SMEM_LIMIT
           and stages + warpgroups <= 4 * warpgroups):
      stages += warpgroups
  if stages < 1 or stages % warpgroups:
    raise ValueError(f"{name}: stages ({stages}) must be a positive multiple of "
                     f"warpgroups ({warpgroups})")
  if smem_bytes(warpgroups, stages, np_) > SMEM_LIMIT:
    raise ValueError(f"{name}: {stages} stages need {smem_bytes(warpgroups, stages, np_)}"
                     f" bytes of shared memory, over {SMEM_LIMIT}")
  if num_splits is None:
    num_splits = splitk.wave_balanced_splits(b * kh, nb * BLOCK, BLOCK, num_sms(),
                                             min_tiles=2 * warpgroups)
  num_splits = max(1, min(int(num_splits), nb))
  regs = min(232, (512 - 40) // warpgroups // 8 * 8)
  return dict(b=b, n=n, kh=kh, qpk=qpk, np=np_, nb=nb, w=warpgroups, stages=stages,
              num_splits=num_splits, regs=regs, grid=(b * kh, num_splits))


def query_operand(q, p, dtype: str):
  """q [B, N, H] -> [B K, NP, H] in the scales' type, each KV head's query heads padded."""
  b, _, h = q.shape
  kh, qpk, np_ = p["kh"], p["qpk"], p["np"]
  return jnp.pad(q.reshape(b * kh, qpk, h), ((0, 0), (0, np_ - qpk), (0, 0))).astype(dtype)


_BIG = 1 << 30  # above any |v| `_pos` sees (token counts)


def _pos(v):
  """max(v, 0) for |v| < 2^30 with +, * and a truncating division alone: the producer's warps
  run this, and JAX 0.11.2's warp context lowers few primitives (`not` failed there)."""
  return v * lax.div(v + _BIG, _BIG)


def item_geometry(j, *, pid, n_cta, ns, kh, lengths):
  """(pair b K + head, sid, b, head, start, end, n_blocks) of the j-th item of CTA pid: item
  pid + j n_cta, splits of a pair's sequence `ns` apart (a wave holds every pair's split sid
  before sid + 1, the order of the (B K, splits) grid it replaces); start, end and n_blocks
  as `splitk.split_bounds`. Scalar +, -, *, lax.div and lax.rem only: it runs in the
  producer's warps too."""
  it = pid + j * n_cta
  bk = lengths.shape[0] * kh
  sid, pair = lax.div(it, bk), lax.rem(it, bk)
  b, head = lax.div(pair, kh), lax.rem(pair, kh)
  length = lengths[b]
  cb = lax.div(lax.div(length + ns - 1, ns) + BLOCK - 1, BLOCK)  # blocks per split
  chunk = cb * BLOCK
  start = sid * chunk
  end = start + chunk - _pos(start + chunk - length)  # min(start + chunk, length)
  n_blocks = cb - _pos(cb - _pos(lax.div(length + BLOCK - 1, BLOCK) - sid * cb))
  return pair, sid, b, head, start, end, n_blocks


def produce(q_src, q_dst, q_bar, q_free, arrays, slot_bar, free, *, n_items, item, stages,
            extra=None):
  """The producer warpgroup's body: for each of the CTA's items (a split of one KV head's
  sequence), its q (and an extension's constants), then its blocks into the ring.

  q_src: gmem [B K, NP, H]; q_dst [q slots, NP, H] with q_bar / q_free [q slots] (item j's q
  goes to slot j % q slots once the compute warpgroups have released the slot: after item
  j - q slots' blocks, which read it, or after its merge where an extension's constants
  share the slot).
  arrays: ((gmem ref [B, K, S / 128, 4, 256], smem ring [stages, 4, 256]) x 4), copied with
  slot_bar [stages] (4 arrivals per block, plus the extra's); block i of an item goes to slot
  i % stages once free[slot] has completed (the compute warpgroups arrive on every free slot
  once before their first item, so the first use waits on nothing).
  n_items: the CTA's item count (a Python int 1 with one item per CTA); item(j):
  `item_geometry`.
  extra: None, or j -> a caller's operands bound to item j, with `copy_const()` (its
  constants into item j's q slot, after q) and `copy_block(block index, slot)` (with each
  block).
  """
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  plgpu.set_max_registers(40, action="decrease")
  q_slots = q_dst.shape[0]

  def copy_q(j, pair, xj):
    qs = lax.rem(j, q_slots)
    plgpu.barrier_wait(q_free.at[qs])
    plgpu.copy_gmem_to_smem(q_src.at[pair], q_dst.at[qs], q_bar.at[qs])
    if xj is not None:
      xj.copy_const()

  def load(b, head, blk, slot, xj):
    plgpu.barrier_wait(free.at[slot])
    for src, dst in arrays:
      plgpu.copy_gmem_to_smem(src.at[b, head, blk], dst.at[slot], slot_bar.at[slot])
    if xj is not None:
      xj.copy_block(blk, slot)

  if stages % 4:  # one loop, the whole warpgroup (one elected thread issues)
    @pl.loop(0, n_items)
    def _(j):
      pair, _, b, head, start, _, n_blocks = item(j)
      xj = None if extra is None else extra(j)
      copy_q(j, pair, xj)
      blk0 = lax.div(start, BLOCK)

      @pl.loop(0, n_blocks)
      def _(i):
        load(b, head, blk0 + i, lax.rem(i, stages), xj)
    return

  # Warp j of the warpgroup streams blocks j, j + 4, ... of each item (so slots j, j + 4, ...:
  # every slot is one warp's, and its free barrier's phases are that warp's alone); warp 0
  # copies the items' q and constants. Why: the four warps each ran the whole loop, issuing
  # about a sixth of the CTA's instructions on the compute warps' schedulers; now each runs a
  # quarter (results/decode_ablations.md, "the producer's share of the issue slots"). An
  # extension's copies run here too, so they must lower in a warp's context (JAX 0.11.2: no
  # `not`, no `//`; GEAR's use a comparison and lax.div).
  @pl.core_map(plgpu.WarpMesh(axis_name="producer_warp"))
  def _():
    wp = lax.axis_index("producer_warp")

    @pl.loop(0, n_items)
    def _(j):
      pair, _, b, head, start, _, n_blocks = item(j)
      xj = None if extra is None else extra(j)
      pl.when(wp == 0)(functools.partial(copy_q, j, pair, xj))
      blk0 = lax.div(start, BLOCK)

      @pl.loop(0, lax.div(n_blocks - wp + 3, 4))  # n_blocks >= 0, wp <= 3; no `//` in a warp
      def _(k):
        i = wp + 4 * k
        load(b, head, blk0 + i, lax.rem(i, stages), xj)


def merge_with_window(q, qt, o_t, lse_t, parts, p, k_win, v_win, w_len, *, scale, out_dtype,
                      window_implementation, return_partials):
  """The Mosaic KIVI kernel's partials (o_t [B K, parts, H, NP], lse_t [B K, parts, NP]) and
  the exact window's (attended by `window_implementation`) merged in one LSE combine.
  qt: the kernel's query operand (`query_operand`), which the fused window reads in place of
  q (`triton_window.window_merge_triton`).
  window_implementation: "fused" (`triton_window`: window and merge in one Triton launch),
  "xla" (the reference: XLA ops), or a `dense.decode_attention` implementation; None:
  "fused" where jax-triton runs and the window fits it (not with return_partials), else
  "xla"."""
  from ..dense import decode_attention  # pylint: disable=import-outside-toplevel
  if window_implementation is None:
    window_implementation = "xla"
    if not return_partials and triton_backend.available():
      from .triton_window import window_fit  # pylint: disable=import-outside-toplevel
      if window_fit(k_win, q.shape[-1]) is None:
        window_implementation = "fused"
  if window_implementation == "fused":
    from .triton_window import window_merge_triton  # pylint: disable=import-outside-toplevel
    if return_partials:
      raise ValueError("KIVI window_implementation 'fused' does not return partials")
    return window_merge_triton(q.shape, qt, o_t, lse_t, parts, p, k_win, v_win, w_len,
                               scale=scale, out_dtype=out_dtype or q.dtype)
  b, n, h = q.shape
  kh, qpk = p["kh"], p["qpk"]
  o = o_t[..., :qpk].reshape(b, kh, parts, h, qpk).transpose(0, 1, 4, 2, 3)
  lse = lse_t[..., :qpk].reshape(b, kh, parts, qpk).transpose(0, 1, 3, 2)
  o, lse = o.reshape(b, n, parts, h), lse.reshape(b, n, parts)
  if window_implementation == "xla":
    ow, lw = decode_attention_xla(q, k_win, v_win, w_len, scale=scale, out_dtype=jnp.float32)
  else:
    ow, lw = decode_attention(q, k_win, v_win, w_len, scale=scale, out_dtype=jnp.float32,
                              implementation=window_implementation)
  o = jnp.concatenate([o, ow[:, :, None].astype(jnp.float32)], -2)
  lse = jnp.concatenate([lse, lw[:, :, None]], -1)
  return splitk.combine_result(o, lse, out_dtype or q.dtype, return_partials)
