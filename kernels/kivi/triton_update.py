"""KIVI's decode-step cache update in one Triton launch, on the warp layout (`store`).

One new token per row: what `KiviCache._decode_update` (kvlowrank/methods/kivi/cache.py,
the jnp reference) does in some twenty small XLA ops per layer, here one program per
(row, KV head) does in place:
  1. the value leaving the exact window (ring slot pos mod F, position pos - R) is
     quantized per token (groups of 32 channels) and its 128 codes are merged into the 32
     words they share with three other tokens (read-modify-write), its scales written;
  2. the new token's key and value take ring slot pos mod F;
  3. the key group the token belongs to (ring slots [32 j, 32 j + 32)) is re-quantized
     per channel, its 256 code words and 256 scale halves written at their final slots of
     the store, and its dequantized keys staged (k_stage);
  4. when the token completes a block of F keys, the ring's keys become the staged ones.
The new lengths max(lens, pos + 1) are the caller's (the cache computes them from the step's
inputs, so XLA runs them inside its CUDA graph before the launch).
The arrays are aliased (`input_output_aliases`): the launch writes the cache's own buffers
(donated by the decode loop), and the kernel reads them through its output pointers, so
it reads what it wrote. Codes and scales go through scratch outputs (a program's codes
in natural order, then gathered into the layout's order after a barrier: a register
gather by a table is not expressible in Triton).

Arithmetic, as the project's one quantizer (`quant.quantizer`) compiles, operation for
operation: fp32 min/max, scale = (max - min) * fp32(1/3) and zero = min rounded to the
store's 16-bit type, codes round-half-even((x - zero) / scale) clipped to [0, 3], 0 where
the scale is 0; the staged keys code * scale + zero in fp32, cast to the cache dtype. The
division is Triton's fp32 `/` (div.full.f32), which is what XLA:GPU runs for the
quantizer's; XLA:CPU runs (x - zero) * (1 / scale) instead (its algebraic simplifier),
which `recip=True` follows (the CPU interpreter check). Codes at a rounding tie depend on
that choice, hence the knob. Restrictions: the warp layout (2-bit, groups of 32, H = 128),
R > 0 (F = R, a multiple of 32), bf16/fp16 ring. Rows with pos < 0 are left as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ..common import triton_backend
from . import store as kstore
from .mosaic_layout import GROUP, HEAD_DIM, KiviMosaic


@triton.jit
def _rint(x):
  """Round half to even (exact in fp32 for |x| < 2**22; no libdevice, so the CPU
  interpreter runs it too)."""
  r = tl.floor(x)
  f = x - r
  odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
  return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _codes(x, s, z, LEV: tl.constexpr, RECIP: tl.constexpr):
  """int32 codes of x (fp32) with the stored scale s and zero z (fp32, broadcast):
  round-half-even((x - z) / s) clipped to [0, LEV], 0 where s is 0."""
  pos = s > 0
  den = tl.where(pos, s, 1.0)
  if RECIP:
    q = _rint((x - z) * (1.0 / den))
  else:
    q = _rint((x - z) / den)
  return tl.where(pos, tl.minimum(tl.maximum(q, 0.0), LEV * 1.0), 0.0).to(tl.int32)


@triton.jit
def _quantize(x, mn, mx, sdt: tl.constexpr, LEV: tl.constexpr, RECIP: tl.constexpr):
  """(codes int32, scale sdt, zero sdt, scale f32, zero f32) of x given its group's
  min/max broadcast to x's shape (the quantizer's formula, LEV = 2^bits - 1 levels)."""
  sc = ((mx - mn) * (1.0 / LEV)).to(sdt)
  zr = mn.to(sdt)
  s = sc.to(tl.float32)
  z = zr.to(tl.float32)
  return _codes(x, s, z, LEV, RECIP), sc, zr, s, z


@triton.jit
def _new_length(pos_ptr, lens_ptr, b):
  """(pos, new length) of row b; lens_ptr holds the new lengths max(lens, pos + 1) (lens for
  pos < 0), which the wrapper computes in XLA: so the old lengths have no reader after
  them, and XLA needs no copy of them in the decode loop (it copied them, per layer and step,
  while this kernel read the old ones; results/decode_ablations.md). The kernel's own use:
  the block completion; the launch does not write them."""
  return tl.load(pos_ptr + b), tl.load(lens_ptr + b)


@triton.jit
def _update_kernel(pos_ptr, lens_ptr, kvnew_ptr,
                   kc_in, ks_in, vc_in, vs_in, kres_in, vres_in, kstage_in,
                   kw_ptr, ksrc_ptr, kssrc_ptr, vw_ptr, vsrc_ptr, vsh_ptr, vsi_ptr,
                   n_blocks,
                   kc_ptr, ks_ptr, vc_ptr, vs_ptr, kres_ptr, vres_ptr, kstage_ptr,
                   scodes_ptr, sscale_ptr,
                   KH: tl.constexpr, F: tl.constexpr, R: tl.constexpr, RECIP: tl.constexpr):
  H: tl.constexpr = 128
  G: tl.constexpr = 32
  b = tl.program_id(0)
  kh = tl.program_id(1)
  pos, l1 = _new_length(pos_ptr, lens_ptr, b)
  if pos >= 0:
    sdt = ks_ptr.dtype.element_ty
    rdt = kres_ptr.dtype.element_ty
    prog = b * KH + kh
    base = prog.to(tl.int64) * n_blocks * 1024          # this (row, head)'s store
    sc_base = prog.to(tl.int64) * (G * H + H)           # scratch codes: keys, then value
    ss_base = prog.to(tl.int64) * (2 * H)               # scratch key scale, zero
    slot = pos % F
    hh = tl.arange(0, H)
    gb = (slot // G) * G
    r = tl.arange(0, G)[:, None]
    rows = ((b * F + gb + r) * KH + kh) * H + hh[None, :]
    kn = tl.load(kvnew_ptr + ((2 * b) * KH + kh) * H + hh)
    vn = tl.load(kvnew_ptr + ((2 * b + 1) * KH + kh) * H + hh)
    kgrp = tl.load(kres_ptr + rows)
    # ---- 1. the value leaving the window (read before the ring slot is overwritten)
    vpos = pos - R
    if vpos >= 0:
      gi = tl.arange(0, 4)[:, None]
      ci = tl.arange(0, G)[None, :]
      x = tl.load(vres_ptr + ((b * F + slot) * KH + kh) * H + gi * G + ci).to(tl.float32)
      mn = tl.min(x, 1)[:, None]
      mx = tl.max(x, 1)[:, None]
      code, sc, zr, s, z = _quantize(x, mn, mx, sdt, 3, RECIP)
      tl.store(scodes_ptr + sc_base + G * H + gi * G + ci, code)
      tb = vpos % 128
      vbase = base + (vpos // 128) * 1024
      gv = tl.arange(0, 4)
      tl.store(vs_ptr + vbase + tl.load(vsi_ptr + tb * 8 + gv * 2), tl.reshape(sc, (4,)))
      tl.store(vs_ptr + vbase + tl.load(vsi_ptr + tb * 8 + gv * 2 + 1), tl.reshape(zr, (4,)))
      tl.debug_barrier()
      wi = tl.arange(0, 32)[:, None]
      j = tl.arange(0, 4)[None, :]
      src = tl.load(vsrc_ptr + tb * 128 + wi * 4 + j)
      sh = tl.load(vsh_ptr + tb * 128 + wi * 4 + j).to(tl.uint32)
      c = tl.load(scodes_ptr + sc_base + G * H + src).to(tl.uint32)
      new = tl.sum(c << sh, 1)
      mask = tl.sum(tl.full((32, 4), 3, tl.uint32) << sh, 1)
      widx = vbase + tl.load(vw_ptr + tb * 32 + tl.arange(0, 32))
      old = tl.load(vc_ptr + widx).to(tl.uint32)
      tl.store(vc_ptr + widx, (old - (old & mask)) | new)
    # ---- 3. the token's key group, from the ring with the new key in its slot (loaded
    # first: the value's work below runs while these loads are in flight)
    xk = tl.where(r == slot - gb, kn[None, :], kgrp).to(tl.float32)
    kmn = tl.min(xk, 0)[None, :]
    kmx = tl.max(xk, 0)[None, :]
    kcode, ksc, kzr, ks, kz = _quantize(xk, kmn, kmx, sdt, 3, RECIP)
    tl.store(kstage_ptr + rows, (kcode.to(tl.float32) * ks + kz).to(rdt))
    tl.store(scodes_ptr + sc_base + r * H + hh[None, :], kcode)
    tl.store(sscale_ptr + ss_base + hh, tl.reshape(ksc, (H,)).to(tl.float32))
    tl.store(sscale_ptr + ss_base + H + hh, tl.reshape(kzr, (H,)).to(tl.float32))
    tl.debug_barrier()
    # ---- 2. the ring slot takes the new token (its old value was read above)
    tl.store(kres_ptr + ((b * F + slot) * KH + kh) * H + hh, kn)
    tl.store(vres_ptr + ((b * F + slot) * KH + kh) * H + hh, vn)
    grp = pos // G
    kbase = base + (grp // 4) * 1024
    w = grp % 4
    jw = tl.arange(0, 256)
    c16 = tl.arange(0, 16)[None, :]
    src = tl.load(ksrc_ptr + jw[:, None] * 16 + c16)
    kc = tl.load(scodes_ptr + sc_base + src).to(tl.uint32)
    words = tl.sum(kc << (2 * c16).to(tl.uint32), 1)
    tl.store(kc_ptr + kbase + tl.load(kw_ptr + w * 256 + jw), words)
    tl.store(ks_ptr + kbase + w * 256 + jw,
             tl.load(sscale_ptr + ss_base + tl.load(kssrc_ptr + jw)).to(sdt))
    # ---- 4. a completed block: the ring's keys become the staged ones
    if l1 % F == 0:
      tl.debug_barrier()
      for i0 in tl.static_range(0, F, G):
        blk = ((b * F + i0 + r) * KH + kh) * H + hh[None, :]
        tl.store(kres_ptr + blk, tl.load(kstage_ptr + blk))


@functools.lru_cache(maxsize=None)
def _tables():
  """The warp layout's index tables (`store._warp_tables`) in the kernel's form, int32:
  key words [4, 256]; each word's 16 code sources (token * 128 + channel, code 8 e + k at
  bits 2 (8 e + k)) [256, 16]; each scale half's source (0: scale, 1: zero) * 128 +
  channel [256]; value words [128, 32]; value code channels and shifts [128, 32, 4]; value
  scale slots [128, 4, 2]."""
  t = kstore._warp_tables()  # pylint: disable=protected-access
  src = t["key_tok"] * HEAD_DIM + t["key_ch"]                      # [256, 8 k, 2 e]
  key_src = np.swapaxes(src, 1, 2).reshape(256, 16)                # code 8 e + k
  key_scale_src = t["key_scale_sz"] * HEAD_DIM + t["key_scale_ch"]
  out = (t["key_words"], key_src, key_scale_src, t["val_words"], t["val_ch"],
         t["val_shift"], t["val_scale_idx"])
  return tuple(np.ascontiguousarray(a, dtype=np.int32) for a in out)


def decode_update_triton(store, k_res, v_res, k_stage, new_lens, pos, k_new, v_new,
                         *, residual: int, recip: bool = False):
  """One decode token per row into a KIVI cache, in place (module docstring); a planar
  store (`store.PlanarStore`) goes to `triton_update_planar`.

  Args:
    store: the quantized store (KiviMosaic or PlanarStore), capacity S.
    k_res, v_res, k_stage: [B, F, K, 128] ring and staged keys (F = residual).
    new_lens: [B] int32 lengths after the token (max(lens, pos + 1), lens where pos < 0: the
      cache's `base.new_lengths`); the launch reads these, not the lengths before the token,
      so that those have no reader after the new ones are computed (`_new_length`).
    pos: [B] int32 the token's position (-1: padding).
    k_new, v_new: [B, K, 128] the token's key (post-RoPE) and value.
    residual: R.
    recip: codes from (x - zero) * (1 / scale), as XLA:CPU computes the quantizer's division
      (default: (x - zero) / scale, as XLA:GPU does; module docstring).
  Returns:
    (store, k_res, v_res, k_stage), as `KiviCache._decode_update` computes them.
  """
  if isinstance(store, kstore.PlanarStore):
    from .triton_update_planar import decode_update_planar  # pylint: disable=C0415
    return decode_update_planar(store, k_res, v_res, k_stage, new_lens, pos, k_new, v_new,
                                residual=residual, recip=recip)
  why = kstore.fused_update_fit(store, k_res, residual)
  if why is not None:
    raise ValueError(f"KIVI fused update: {why}")
  b, f, kh, h = k_res.shape
  dt = k_res.dtype
  nb = store.kc.shape[2]
  tables = [jnp.asarray(a) for a in _tables()]
  outs = [store.kc, store.ks, store.vc, store.vs, k_res, v_res, k_stage]
  out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs] + [
      jax.ShapeDtypeStruct((b * kh * (GROUP * h + h),), jnp.int32),
      jax.ShapeDtypeStruct((b * kh * 2 * h,), jnp.float32)]
  res = triton_backend.launch(
      _update_kernel, pos.astype(jnp.int32), new_lens.astype(jnp.int32),
      # one operand [B, 2, K, 128]: XLA makes it in one fusion (the key's RoPE and the value's
      # slice of the projection), where two operands took a launch each
      jnp.stack([k_new.astype(dt), v_new.astype(dt)], 1), *outs, *tables, int(nb),
      out_shapes=out_shapes, grid=(b, kh), num_warps=4, num_stages=1,
      aliases={3 + i: i for i in range(len(outs))}, inits=False, KH=kh, F=f, R=residual,
      RECIP=bool(recip))
  kc, ks, vc, vs, k_res, v_res, k_stage = res[:7]
  return KiviMosaic(kc=kc, ks=ks, vc=vc, vs=vs), k_res, v_res, k_stage

