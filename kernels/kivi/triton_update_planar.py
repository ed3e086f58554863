"""KIVI's decode-step cache update in one Triton launch, on the planar layout (`planar`).

The planar twin of `triton_update` (the warp layout): one new token per row, one program per
(row, KV head), in place, what `KiviCache._decode_update` (the jnp reference, some twenty
small XLA ops per layer) does:
  1. the value leaving the exact window (ring slot pos mod F, position pos - R) is
     quantized per token in groups of G channels; its scales and its row of packed bytes are
     written (the row is the token's own: no read-modify-write; token-blocked order);
  2. the new token's key and value take ring slot pos mod F;
  3. the key group the token belongs to (ring slots [G j, G j + G), the new key in its
     slot) is re-quantized per channel; its G rows of packed bytes and its scale row are
     written at their final slots of the store, and its dequantized keys staged (k_stage);
  4. when the token completes a block of F keys, the ring's keys become the staged ones.
The new lengths are the caller's, as in `triton_update`.
Packing (`planar`, the one packing module's plane layout): byte s CW + w of a row holds, at
bits [k b, (k + 1) b), the code of channel s ppb CW + k CW + w (ppb = 8 / b codes per byte).
So the kernel works plane by plane: plane k is the channels c(j, k) of bytes j, quantized and
shifted into place; a key channel's scale depends on its own column only, and a value plane
lies inside one channel group (CW divides G), whose scale the program wrote first and reads
back after a barrier.

Arithmetic: the project's one quantizer (`quant.quantizer`), as `triton_update` computes it
(fp32 min/max, scale = (max - min) * fp32(1 / (2^b - 1)) and zero = min rounded to the
scale dtype, round-half-even codes of (x - zero) / scale clipped to [0, 2^b - 1], 0 where the
scale is 0; `recip=True`: XLA:CPU's (x - zero) * (1 / scale), for the CPU interpreter check).
Widths need not be powers of two (the inner cache of FDC/ZACK with 4-bit K'/V' has one
"head" of width sum of the per-head widths): the program's index ranges are padded to the
next power of two and masked. Restrictions (`store.fused_update_fit`): 2, 4 or 8 bits, a group
G that is a power of two, R > 0 (F = R), a bf16/fp16 ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..common import triton_backend
from . import store as kstore
from .planar import VALUE_BLOCK
from .triton_update import _codes, _new_length, _quantize

FUSED_BITS = (2, 4, 8)


@triton.jit
def _planar_update_kernel(pos_ptr, lens_ptr, kvnew_ptr,
                          kc_in, ks_in, kz_in, vc_in, vs_in, vz_in, kres_in, vres_in, kst_in,
                          n_slots,
                          kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kres_ptr, vres_ptr,
                          kst_ptr,
                          KH: tl.constexpr, F: tl.constexpr, R: tl.constexpr,
                          G: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                          KBITS: tl.constexpr, VBITS: tl.constexpr, KCW: tl.constexpr,
                          VCW: tl.constexpr, VB: tl.constexpr, RECIP: tl.constexpr,
                          HP: tl.constexpr, HVP: tl.constexpr, RKP: tl.constexpr,
                          RVP: tl.constexpr, NGP: tl.constexpr):
  b = tl.program_id(0)
  kh = tl.program_id(1)
  pos, l1 = _new_length(pos_ptr, lens_ptr, b)
  if pos >= 0:
    sdt = ks_ptr.dtype.element_ty
    rdt = kres_ptr.dtype.element_ty
    KPPB: tl.constexpr = 8 // KBITS
    VPPB: tl.constexpr = 8 // VBITS
    RK: tl.constexpr = H * KBITS // 8          # bytes per key row
    RV: tl.constexpr = HV * VBITS // 8         # bytes per value row
    KLEV: tl.constexpr = (1 << KBITS) - 1
    VLEV: tl.constexpr = (1 << VBITS) - 1
    NG: tl.constexpr = HV // G                 # value groups per token
    prog = (b * KH + kh).to(tl.int64)
    knew_ptr = kvnew_ptr + prog * (H + HV)        # the token's key, then its value
    vnew_ptr = knew_ptr + H
    slot = pos % F
    vrow = vres_ptr + ((b * F + slot) * KH + kh) * HV
    # ---- 1. the value leaving the window (read before the ring slot is overwritten)
    vpos = pos - R
    if vpos >= 0:
      gi = tl.arange(0, NGP)
      ci = tl.arange(0, G)[None, :]
      x = tl.load(vrow + gi[:, None] * G + ci, mask=gi[:, None] < NG, other=0.0).to(tl.float32)
      mn = tl.min(x, 1)
      mx = tl.max(x, 1)
      srow = (prog * n_slots + vpos) * NG
      tl.store(vs_ptr + srow + gi, ((mx - mn) * (1.0 / VLEV)).to(sdt), mask=gi < NG)
      tl.store(vz_ptr + srow + gi, mn.to(sdt), mask=gi < NG)
      tl.debug_barrier()
      jv = tl.arange(0, RVP)
      jv_ok = jv < RV
      vbyte = tl.zeros((RVP,), tl.int32)
      for k in tl.static_range(VPPB):
        c = (jv // VCW) * (VPPB * VCW) + k * VCW + jv % VCW
        s = tl.load(vs_ptr + srow + c // G, mask=jv_ok, other=0.0).to(tl.float32)
        z = tl.load(vz_ptr + srow + c // G, mask=jv_ok, other=0.0).to(tl.float32)
        xv = tl.load(vrow + c, mask=jv_ok, other=0.0).to(tl.float32)
        vbyte = vbyte | (_codes(xv, s, z, VLEV, RECIP) << (k * VBITS))
      # token-blocked rows: byte j of token t at [t // VB, j, t % VB] (`planar`)
      vbase = prog * n_slots * RV + (vpos // VB) * (RV * VB) + vpos % VB
      tl.store(vc_ptr + vbase + jv * VB, vbyte.to(tl.uint8), mask=jv_ok)
    # ---- 3. the token's key group, from the ring with the new key in its slot
    gb = (slot // G) * G
    grp = pos // G
    r = tl.arange(0, G)[:, None]
    jk = tl.arange(0, RKP)[None, :]
    jk_ok = jk < RK
    ring = ((b * F + gb + r) * KH + kh) * H
    kbyte = tl.zeros((G, RKP), tl.int32)
    for k in tl.static_range(KPPB):
      c = (jk // KCW) * (KPPB * KCW) + k * KCW + jk % KCW           # [1, RKP] channels
      xk = tl.load(kres_ptr + ring + c, mask=jk_ok, other=0.0)
      kn = tl.load(knew_ptr + c, mask=jk_ok, other=0.0)
      xk = tl.where(r == slot - gb, kn, xk).to(tl.float32)
      code, sc, zr, s, z = _quantize(xk, tl.min(xk, 0)[None, :], tl.max(xk, 0)[None, :], sdt,
                                     KLEV, RECIP)
      tl.store(kst_ptr + ring + c, (code.to(tl.float32) * s + z).to(rdt), mask=jk_ok)
      tl.store(ks_ptr + (prog * (n_slots // G) + grp) * H + c, sc, mask=jk_ok)
      tl.store(kz_ptr + (prog * (n_slots // G) + grp) * H + c, zr, mask=jk_ok)
      kbyte = kbyte | (code << (k * KBITS))
    tl.store(kc_ptr + (prog * n_slots + grp * G + r) * RK + jk, kbyte.to(tl.uint8), mask=jk_ok)
    tl.debug_barrier()
    # ---- 2. the ring slot takes the new token (its old value was read above)
    hh = tl.arange(0, HP)
    hv = tl.arange(0, HVP)
    tl.store(kres_ptr + ((b * F + slot) * KH + kh) * H + hh,
             tl.load(knew_ptr + hh, mask=hh < H), mask=hh < H)
    tl.store(vrow + hv, tl.load(vnew_ptr + hv, mask=hv < HV), mask=hv < HV)
    # ---- 4. a completed block: the ring's keys become the staged ones
    if l1 % F == 0:
      tl.debug_barrier()
      hr = tl.arange(0, HP)[None, :]
      for i0 in tl.static_range(0, F, G):
        blk = ((b * F + i0 + r) * KH + kh) * H + hr
        tl.store(kres_ptr + blk, tl.load(kst_ptr + blk, mask=hr < H), mask=hr < H)


def decode_update_planar(store, k_res, v_res, k_stage, new_lens, pos, k_new, v_new, *,
                         residual: int, recip: bool = False):
  """One decode token per row into a planar KIVI store (`store.PlanarStore`), in place; the
  arguments and result of `triton_update.decode_update_triton`, which calls this for planar
  stores (v_res / v_new may be narrower or wider than the keys)."""
  why = kstore.fused_update_fit(store, k_res, residual)
  if why is not None:
    raise ValueError(f"KIVI fused update: {why}")
  keys, values = store.keys, store.values
  b, f, kh, h = k_res.shape
  hv = v_res.shape[-1]
  dt = k_res.dtype
  p2 = triton.next_power_of_2
  outs = [keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero,
          k_res, v_res, k_stage]
  out_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs]
  res = triton_backend.launch(
      _planar_update_kernel, pos.astype(jnp.int32), new_lens.astype(jnp.int32),
      # one operand [B, K, H + HV], the key then the value: XLA makes it in one fusion (as
      # `triton_update`'s [B, 2, K, 128]; the widths may differ here)
      jnp.concatenate([k_new.astype(dt), v_new.astype(dt)], -1), *outs,
      int(keys.codes.shape[2]), out_shapes=out_shapes, grid=(b, kh), num_warps=4, num_stages=1,
      aliases={3 + i: i for i in range(len(outs))}, inits=False, KH=kh, F=f, R=residual,
      G=keys.group, H=h, HV=hv, KBITS=keys.bits, VBITS=values.bits, KCW=keys.plane_width,
      VCW=values.plane_width, VB=VALUE_BLOCK, RECIP=bool(recip), HP=p2(h), HVP=p2(hv),
      RKP=p2(h * keys.bits // 8), RVP=p2(hv * values.bits // 8), NGP=p2(hv // keys.group))
  kc, ks, kz, vc, vs, vz, k_res, v_res, k_stage = res
  store = kstore.PlanarStore(
      keys=type(keys)(codes=kc, scale=ks, zero=kz, bits=keys.bits, group=keys.group),
      values=type(values)(codes=vc, scale=vs, zero=vz, bits=values.bits, group=values.group))
  return store, k_res, v_res, k_stage
