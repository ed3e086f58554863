"""The pipeline around the Mosaic GPU KIVI kernel's compute warpgroups (`mosaic_kivi_warp`):
the launch plan's checks and ring depth, the query operand, the TMA producer warpgroup that
streams each 128-token block's key/value codes and scales into a `stages`-slot ring, and the
merge of the kernel's split-K partials with the exact window's.

Ring protocol: block i of a CTA's split goes to slot i % stages, one barrier per slot signals
the arrival of all its arrays, and the slot's consumer (compute warpgroup i % W, since stages
is a multiple of W) arrives on `free[slot]` once it no longer reads the slot. Where stages is
a multiple of 4, warp j of the producer warpgroup streams blocks j, j + 4, ... (`produce`).
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


def produce(q_src, q_dst, q_bar, arrays, slot_bar, free, *, b, head, start, n_blocks, stages,
            extra=None):
  """The producer warpgroup's body: q once, then every block of the split into the ring.

  arrays: ((gmem ref [B, K, S / 128, 4, 256], smem ring [stages, 4, 256]) x 4), copied with
  slot_bar [stages] (4 arrivals per block, plus the extra's);
  start: the split's first token (a multiple of 128); extra: None, or a caller's operands
  with `copy_const()` (once, after q) and `copy_block(block index, slot)` (with each block).
  """
  import jax.experimental.pallas as pl  # pylint: disable=import-outside-toplevel
  import jax.experimental.pallas.mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  plgpu.set_max_registers(40, action="decrease")
  plgpu.copy_gmem_to_smem(q_src, q_dst, q_bar)
  if extra is not None:
    extra.copy_const()
  blk0 = start // BLOCK

  def load(i, slot):
    for src, dst in arrays:
      plgpu.copy_gmem_to_smem(src.at[b, head, blk0 + i], dst.at[slot], slot_bar.at[slot])
    if extra is not None:
      extra.copy_block(blk0 + i, slot)

  if stages % 4:  # one loop, the whole warpgroup (one thread issues)
    for i in range(stages):
      pl.when(i < n_blocks)(functools.partial(load, i, i))

    @pl.loop(0, n_blocks)
    def _(i):
      slot = lax.rem(i, stages)

      @pl.when(i + stages < n_blocks)
      def _():
        plgpu.barrier_wait(free.at[slot])
        load(i + stages, slot)
    return

  # Warp j of the warpgroup streams blocks j, j + 4, ... (so slots j, j + 4, ...: every slot
  # is one warp's, and its free barrier's phases are that warp's alone). Why: the four warps
  # each ran the whole loop, issuing about a sixth of the CTA's instructions on the compute
  # warps' schedulers; now each runs a quarter (results/decode_ablations.md, "the producer's
  # share of the issue slots"). An extension's copy_block runs here too, so it must lower in
  # a warp's context (JAX 0.11.2: no `not`, no `//`; GEAR's uses a comparison and lax.div).
  @pl.core_map(plgpu.WarpMesh(axis_name="producer_warp"))
  def _():
    wp = lax.axis_index("producer_warp")

    @pl.loop(0, lax.div(n_blocks - wp + 3, 4))  # n_blocks >= 0, wp <= 3; no `//` in a warp
    def _(k):
      i = wp + 4 * k
      slot = lax.rem(i, stages)

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(free.at[slot])

      load(i, slot)


def merge_with_window(q, o_t, lse_t, parts, p, k_win, v_win, w_len, *, scale, out_dtype,
                      window_implementation, return_partials):
  """The Mosaic KIVI kernel's partials (o_t [B K, parts, H, NP], lse_t [B K, parts, NP]) and
  the exact window's (attended by `window_implementation`) merged in one LSE combine.
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
    return window_merge_triton(q, o_t, lse_t, parts, p, k_win, v_win, w_len, scale=scale,
                               out_dtype=out_dtype or q.dtype)
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
