"""The ragged kernels' split-K combine in one Triton launch.

`triton_ragged.combine_heads` (jnp, the reference beside this kernel) merges the chunks'
compact partials (o [T, G, VW], lse [T, GP], chunk id t = (b * n_chunks + c) * n_groups + i)
into the per-head output; under XLA that was six fusions per layer (the max and the sum of
the split weights, the division, the weighted sum over the chunks, the output and LSE
gathers), each a launch plus its gap. Here program (b, h, j) merges columns
[j * WB, (j + 1) * WB) of KV head h of row b: its group i, its rows h_j * G + g of the
group's LSE and its value columns [vlo, vlo + v_h) of the compact partials. One pass over the
chunks in blocks of CB, every block's LSE and partial tile loaded at once (at decode shapes
the chunks of a task fit one block: one round trip to memory), merged as the reference does
(the maximum m, w_c = exp(lse_c - m) (0 for empty chunks), denom = sum_c w_c, out = sum_c w_c
o_c / denom, lse = m + log(denom); rows with no key: 0 and -inf), the blocks by an online
rescale. It writes straight into the caller's layout (packed [B, G, sum v], or per head
[B, K, G, W] zero-padded) and the LSE [B, K, G]. (A first version, one program per (b, h)
with three dependent passes over the chunks, was slower: `results/rotated_kernel.md`,
"One-launch records and combine".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..common import triton_backend
from .triton_plan import pow2_at_least

ELEMENTS = 8192   # partial elements per loop step (chunks x queries x columns) at most
WB = 32           # output columns per program


@triton.jit
def combine_kernel(o_ptr, lse_ptr, tab_ptr, out_ptr, tot_ptr, NC: tl.constexpr,
                   NG: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                   GC: tl.constexpr, VW: tl.constexpr, WB: tl.constexpr, CB: tl.constexpr,
                   SB: tl.constexpr, SH: tl.constexpr, SG: tl.constexpr, HEADS: tl.constexpr,
                   W: tl.constexpr):
  b = tl.program_id(0)
  h = tl.program_id(1)
  j = tl.program_id(2)
  tab = tab_ptr + h * 5
  grp = tl.load(tab)
  row0 = tl.load(tab + 1)
  vlo = tl.load(tab + 2)
  vw = tl.load(tab + 3)
  off = tl.load(tab + 4)
  g = tl.arange(0, GC)
  gok = g < G
  cb = tl.arange(0, CB)
  cols = j * WB + tl.arange(0, WB)
  vok = cols < vw
  m = tl.full([GC], float("-inf"), tl.float32)
  denom = tl.zeros([GC], tl.float32)
  acc = tl.zeros([GC, WB], tl.float32)
  for c0 in range(0, NC, CB):
    t = ((b * NC + c0 + cb) * NG + grp).to(tl.int64)
    ok = (c0 + cb < NC)[:, None] & gok[None, :]
    lse = tl.load(lse_ptr + t[:, None] * GP + row0 + g[None, :], mask=ok, other=float("-inf"))
    o = tl.load(o_ptr + (t[:, None, None] * G + g[None, :, None]) * VW + vlo
                + cols[None, None, :], mask=ok[:, :, None] & vok[None, None, :], other=0.0)
    m_new = tl.maximum(m, tl.max(lse, 0))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.where(m > float("-inf"), tl.exp(m - m_safe), 0.0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m_safe[None, :]), 0.0)
    denom = denom * alpha + tl.sum(w, 0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
    m = m_new
  has = denom > 0
  denom = tl.where(has, denom, 1.0)
  total = tl.where(has, tl.where(m > float("-inf"), m, 0.0) + tl.log(denom), float("-inf"))
  span = W if HEADS else vw
  out = out_ptr + b.to(tl.int64) * SB + h * SH + off + g[:, None] * SG + cols[None, :]
  tl.store(out, (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
           mask=gok[:, None] & (cols < span)[None, :])
  tl.store(tot_ptr + (b * K + h) * G + g, total, mask=gok & (j == 0))


def combine_heads_triton(o, lse, p, out_dtype, heads_width=None):
  """`triton_ragged.combine_heads(o, lse, p, out_dtype, heads_width)` in one launch (module
  docstring): (out [B, G, sum v] or [B, K, G, heads_width] out_dtype, lse [B, K, G] float32)."""
  c = p.constexprs
  k, g, bsz = len(p.v_widths), p.groups, p.batch
  tab = p.head_table()
  span = max(p.v_widths) if heads_width is None else int(heads_width)
  gc = pow2_at_least(g, 2)
  wb = max(2, min(WB, pow2_at_least(span, 1)))
  cb = max(2, min(pow2_at_least(p.n_chunks, 1), ELEMENTS // (gc * wb)))
  if heads_width is None:
    sv = sum(p.v_widths)
    shape, sb, sh, sg, width = (bsz, g, sv), g * sv, 0, sv, 0
  else:
    tab[:, 4] = 0
    w = int(heads_width)
    shape, sb, sh, sg, width = (bsz, k, g, w), k * g * w, g * w, w, w
  out, total = triton_backend.launch(
      combine_kernel, o, lse, jnp.asarray(tab.reshape(-1)),
      out_shapes=[jax.ShapeDtypeStruct(shape, jnp.dtype(out_dtype)),
                  jax.ShapeDtypeStruct((bsz, k, g), jnp.float32)],
      grid=(bsz, k, -(-span // wb)), num_warps=4, num_stages=1, inits=False, NC=p.n_chunks,
      NG=p.n_groups, K=k, G=g, GP=c["GP"], GC=gc, VW=c["VW"], WB=wb, CB=cb, SB=sb, SH=sh, SG=sg,
      HEADS=heads_width is not None, W=width)
  return out, total
