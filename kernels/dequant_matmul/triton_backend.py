"""jax-triton 0.3.1 GPU kernels (Triton language) for XQuant rematerialisation.

Two kernels share one in-register dequantizer (`_dequant_tile`: packed uint32 codes ->
code·scale + zero, fp32, for the layouts of reference.py; 3-bit codes that straddle a
word read both words):

* `_dm_kernel`: out = dequant(X codes) @ W, a [BLOCK_M, BLOCK_N] tile per program,
  fp32 accumulation over BLOCK_K-channel slices (tensor cores, operands in W's dtype).
* `_remat_attn_kernel`: decode attention that rematerialises K and V tile by tile
  and never writes them to HBM. Program (split, kv head, batch row) walks its share
  of the cached tokens in BLOCK_S tiles: K_tile = X̂_tile·W_k[:, head] computed as two
  halves (the half-rotation RoPE pairs channel i with i + H/2), RoPE from a cos/sin
  table at the key positions, scores for the G query heads of the group (padded to
  16 rows for the MMA), online softmax, V_tile = X̂_tile·W_v[:, head], P·V. Partial
  (out, lse) per split are merged in jnp (flash-decoding). With `shared` (XQuant's X
  path) one X̂ tile feeds both K and V; otherwise (GQA latent path) K and V read their
  own latent stores.

jax-triton 0.3.x: `triton_call(*arrays, kernel=, out_shape=, grid=, **constexprs)`;
outputs follow inputs in the kernel signature. Every shape is a constexpr (one
compile per shape; the benchmark and the cache have static shapes).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp

try:  # Triton is only present on the GPU machine.
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs
  triton = None
  tl = None

from kvlowrank.quant import packing


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """True when jax-triton and Triton import and JAX's default backend is a CUDA GPU."""
  if triton is None or importlib.util.find_spec("jax_triton") is None:
    return False
  try:
    if jax.default_backend() != "gpu":
      return False
    import jax_triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except Exception:  # pylint: disable=broad-except
    return False
  return True


if triton is not None:

  @triton.jit
  def _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, row_ok, row0, k0, C: tl.constexpr,
                    NW: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr,
                    WPB: tl.constexpr, TOKEN_AXIS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R, BLOCK_K] fp32 X̂ for channels k0 .. k0 + BLOCK_K of `rows`.

    rows = row0 + arange(BLOCK_R) (row0 a multiple of BLOCK_R). When a tile's scales
    are one vector (token axis with GROUP % BLOCK_K == 0: one group per row; channel
    axis with GROUP % BLOCK_R == 0: one token group per tile) they are loaded once per
    row / channel instead of per element (fewer loads, less pipelining smem).
    """
    rk = k0 + tl.arange(0, BLOCK_K)
    start = (rk % CPB) * BITS                   # bit offset of the code in its block
    word = (rk // CPB) * WPB + start // 32
    off = (start % 32).to(tl.uint32)
    rows64 = rows.to(tl.int64)
    base = codes_ptr + rows64[:, None] * NW + word[None, :]
    # Bitcast: the shifts below must be logical (uint32) whatever the pointer type says.
    lo = tl.load(base, mask=row_ok[:, None], other=0).to(tl.uint32, bitcast=True)
    val = lo >> off[None, :]
    if BITS == 3:  # codes 10 and 21 of each 32-code block straddle two words
      spill = (start % 32) + BITS > 32
      hi = tl.load(base + 1, mask=row_ok[:, None] & spill[None, :],
                   other=0).to(tl.uint32, bitcast=True)
      val = val | tl.where(spill[None, :], hi << (32 - off)[None, :], 0)
    code = (val & ((1 << BITS) - 1)).to(tl.float32)
    if TOKEN_AXIS:
      if GROUP % BLOCK_K == 0:
        sidx = rows64 * (C // GROUP) + k0 // GROUP
        s = tl.load(scale_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(zero_ptr + sidx, mask=row_ok, other=0.0).to(tl.float32)[:, None]
      else:
        sidx = rows64[:, None] * (C // GROUP) + (rk // GROUP)[None, :]
        s = tl.load(scale_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
    else:
      if GROUP % BLOCK_R == 0:
        sidx = (row0.to(tl.int64) // GROUP) * C + rk
        s = tl.load(scale_ptr + sidx).to(tl.float32)[None, :]
        z = tl.load(zero_ptr + sidx).to(tl.float32)[None, :]
      else:
        sidx = (rows64 // GROUP)[:, None] * C + rk[None, :]
        s = tl.load(scale_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + sidx, mask=row_ok[:, None], other=0.0).to(tl.float32)
    return code * s + z

  @triton.jit
  def _dm_kernel(codes_ptr, scale_ptr, zero_ptr, w_ptr, out_ptr, M: tl.constexpr,
                 C: tl.constexpr, N: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr,
                 CPB: tl.constexpr, WPB: tl.constexpr, TOKEN_AXIS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, C, BLOCK_K):
      x = _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rm, m_ok, tl.program_id(0) * BLOCK_M,
                        k0, C, NW, BITS, CPB, WPB, TOKEN_AXIS, GROUP, BLOCK_M, BLOCK_K)
      rk = k0 + tl.arange(0, BLOCK_K)
      w = tl.load(w_ptr + rk[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0.0)
      acc += tl.dot(x.to(w.dtype), w)
    optr = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

  @triton.jit
  def _remat_attn_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, wk_ptr,
                         wv_ptr, bk_ptr, bv_ptr, cos_ptr, sin_ptr, lens_ptr, o_ptr, lse_ptr,
                         S: tl.constexpr, N: tl.constexpr, KH: tl.constexpr,
                         H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                         SPLITS: tl.constexpr, PER: tl.constexpr, SCALE: tl.constexpr,
                         SHARED: tl.constexpr, CK: tl.constexpr, NWK: tl.constexpr,
                         BITSK: tl.constexpr, CPBK: tl.constexpr, WPBK: tl.constexpr,
                         TOKK: tl.constexpr, GRPK: tl.constexpr, CV: tl.constexpr,
                         NWV: tl.constexpr, BITSV: tl.constexpr, CPBV: tl.constexpr,
                         WPBV: tl.constexpr, TOKV: tl.constexpr, GRPV: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    sp = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    H2: tl.constexpr = H // 2
    length = tl.load(lens_ptr + b)
    g = tl.arange(0, GP)
    g_ok = g < G
    h2 = tl.arange(0, H2)
    hh = tl.arange(0, H)
    qrow = (b * N + kh * G + g).to(tl.int64)
    q1 = tl.load(q_ptr + qrow[:, None] * H + h2[None, :], mask=g_ok[:, None], other=0.0)
    q2 = tl.load(q_ptr + qrow[:, None] * H + H2 + h2[None, :], mask=g_ok[:, None], other=0.0)
    q1 = q1.to(tl.float32) * SCALE
    q2 = q2.to(tl.float32) * SCALE
    bk1 = tl.load(bk_ptr + kh * H + h2).to(tl.float32)
    bk2 = tl.load(bk_ptr + kh * H + H2 + h2).to(tl.float32)
    bvv = tl.load(bv_ptr + kh * H + hh).to(tl.float32)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, H), tl.float32)
    start = sp * PER
    stop = tl.minimum(start + PER, length)
    for s0 in range(start, stop, BLOCK_S):
      rs = s0 + tl.arange(0, BLOCK_S)
      ok = rs < stop
      grow = b * S + rs
      k1 = tl.zeros((BLOCK_S, H2), tl.float32)
      k2 = tl.zeros((BLOCK_S, H2), tl.float32)
      v = tl.zeros((BLOCK_S, H), tl.float32)
      for c0 in range(0, CK, BLOCK_K):
        x = _dequant_tile(kc_ptr, ks_ptr, kz_ptr, grow, ok, b * S + s0, c0, CK, NWK, BITSK,
                          CPBK, WPBK, TOKK, GRPK, BLOCK_S, BLOCK_K)
        rk = c0 + tl.arange(0, BLOCK_K)
        wrow = wk_ptr + rk[:, None] * (KH * H) + kh * H
        w1 = tl.load(wrow + h2[None, :])
        w2 = tl.load(wrow + H2 + h2[None, :])
        xb = x.to(w1.dtype)
        k1 += tl.dot(xb, w1)
        k2 += tl.dot(xb, w2)
        if SHARED:
          wvt = tl.load(wv_ptr + rk[:, None] * (KH * H) + kh * H + hh[None, :])
          v += tl.dot(xb, wvt)
      if not SHARED:
        for c0 in range(0, CV, BLOCK_K):
          x = _dequant_tile(vc_ptr, vs_ptr, vz_ptr, grow, ok, b * S + s0, c0, CV, NWV, BITSV,
                            CPBV, WPBV, TOKV, GRPV, BLOCK_S, BLOCK_K)
          rk = c0 + tl.arange(0, BLOCK_K)
          wvt = tl.load(wv_ptr + rk[:, None] * (KH * H) + kh * H + hh[None, :])
          v += tl.dot(x.to(wvt.dtype), wvt)
      k1 += bk1[None, :]
      k2 += bk2[None, :]
      v += bvv[None, :]
      cs = tl.load(cos_ptr + rs[:, None] * H2 + h2[None, :], mask=ok[:, None], other=0.0)
      sn = tl.load(sin_ptr + rs[:, None] * H2 + h2[None, :], mask=ok[:, None], other=0.0)
      r1 = k1 * cs - k2 * sn
      r2 = k2 * cs + k1 * sn
      sc = tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))   # [GP, BLOCK_S]
      sc = tl.where(ok[None, :], sc, float("-inf"))
      m_new = tl.maximum(m_i, tl.max(sc, axis=1))
      p = tl.exp(sc - m_new[:, None])
      alpha = tl.exp(m_i - m_new)
      l_i = l_i * alpha + tl.sum(p, axis=1)
      pv_t = wv_ptr.dtype.element_ty   # MMA operand dtype = the weights' (bf16 in use)
      acc = acc * alpha[:, None] + tl.dot(p.to(pv_t), v.to(pv_t))
      m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    prow = ((b * KH + kh) * SPLITS + sp).to(tl.int64) * GP + g
    tl.store(o_ptr + prow[:, None] * H + hh[None, :], out)
    tl.store(lse_ptr + prow, lse)


def _bits_meta(bits: int, width: int):
  cpb, wpb = packing.block_shape(bits)
  return dict(NW=packing.packed_words(width, bits), BITS=bits, CPB=cpb, WPB=wpb)


def _pick_block_k(c: int) -> int:
  for bk in (64, 32, 16):
    if c % bk == 0:
      return bk
  raise ValueError(f"the quantized width ({c}) must be a multiple of 16 for the Triton kernel")


def dequant_matmul(codes, scale, zero, w, *, bits: int, axis: str, group: int,
                   out_dtype=jnp.float32, block_m: int = 64, block_n: int = 128,
                   block_k: int = 0, num_warps: int = 4, num_stages: int = 2):
  """Triton out [M, N] = dequant(codes, scale, zero) @ w (layout as reference.py)."""
  import jax_triton as jt  # pylint: disable=import-outside-toplevel
  m, c, n = codes.shape[0], w.shape[0], w.shape[1]
  meta = _bits_meta(bits, c)
  grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
  return jt.triton_call(
      codes, scale, zero, w, kernel=_dm_kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=grid, num_warps=num_warps,
      num_stages=num_stages, M=m, C=c, N=n, TOKEN_AXIS=axis == "token", GROUP=group,
      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k or _pick_block_k(c), **meta)


def remat_decode_attention(q, k_rows, v_rows, wk, wv, bk, bv, cos, sin, lens, *,
                           n_kv_heads: int, splits: int = 0, block_s: int = 64,
                           block_k: int = 0, num_warps: int = 8, num_stages: int = 2):
  """Fused rematerialise-and-attend decode (one query token per row).

  Args mirror reference.remat_decode_attention; returns out [B, N, H] fp32.
  """
  import jax_triton as jt  # pylint: disable=import-outside-toplevel
  b, n, h = q.shape
  s = k_rows.codes.shape[1]
  kh = n_kv_heads
  g = n // kh
  gp = max(16, 1 << (g - 1).bit_length())
  if splits <= 0:   # enough programs to fill ~132 SMs several times over
    splits = max(1, min(triton.cdiv(s, block_s), triton.cdiv(4 * 132, b * kh)))
  per = triton.cdiv(triton.cdiv(s, splits), block_s) * block_s
  splits = triton.cdiv(s, per)
  shared = v_rows is None
  v_rows = k_rows if shared else v_rows
  ck, cv = wk.shape[0], wv.shape[0]
  mk, mv = _bits_meta(k_rows.bits, ck), _bits_meta(v_rows.bits, cv)
  flat = lambda a: a.reshape(-1, a.shape[-1])
  o, lse = jt.triton_call(
      q, flat(k_rows.codes), flat(k_rows.scale), flat(k_rows.zero), flat(v_rows.codes),
      flat(v_rows.scale), flat(v_rows.zero), wk, wv, bk, bv, cos, sin, lens.astype(jnp.int32),
      kernel=_remat_attn_kernel,
      out_shape=[jax.ShapeDtypeStruct((b, kh, splits, gp, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, gp), jnp.float32)],
      grid=(splits, kh, b), num_warps=num_warps, num_stages=num_stages,
      S=s, N=n, KH=kh, H=h, G=g, GP=gp, SPLITS=splits, PER=per, SCALE=1.0 / math.sqrt(h),
      SHARED=shared, CK=ck, NWK=mk["NW"], BITSK=mk["BITS"], CPBK=mk["CPB"], WPBK=mk["WPB"],
      TOKK=k_rows.axis == "token", GRPK=k_rows.group, CV=cv, NWV=mv["NW"],
      BITSV=mv["BITS"], CPBV=mv["CPB"], WPBV=mv["WPB"], TOKV=v_rows.axis == "token",
      GRPV=v_rows.group, BLOCK_S=block_s, BLOCK_K=block_k or _pick_block_k(math.gcd(ck, cv)))
  o, lse = o[:, :, :, :g], lse[:, :, :, :g]              # [B, K, P, G, H], [B, K, P, G]
  tot = jax.nn.logsumexp(lse, axis=2, keepdims=True)
  wgt = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(tot), tot, 0.0)), 0.0)
  out = jnp.sum(wgt[..., None] * o, axis=2)               # [B, K, G, H]
  return out.reshape(b, n, h)
