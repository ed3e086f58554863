"""The Mosaic KIVI kernel's epilogue in one Triton launch: the exact window's attention and
the log-sum-exp merge with the kernel's split-K partials.

`mosaic_ring.merge_with_window` with window_implementation "xla" (the reference beside this
kernel) runs the window's attention and the merge as about ten small XLA ops per layer
(the partials' transpose, two einsums, the softmax, the concatenations, the combine). Here
one program per (row, KV head) does all of it:
  scores [QP, W] = q [QP, H] @ k_win^T (bf16 products, fp32 accumulation) * scale, masked
  beyond w_len; e = exp(scores - max), o_w = e (rounded to the window's dtype) @ v_win,
  lse_w = max + log(sum e) (as `dense.xla.decode_attention_xla`);
  then out = (sum_s exp(lse_s - m) o_s + exp(lse_w - m) o_w / sum e) / (the weights' sum),
  lse = m + log(the weights' sum), m the largest lse (as `splitk.combine_partials`).
QP = the KV head's query heads padded to 16 rows (tl.dot's smallest). Restrictions: head dim
128, a window of 16-256 tokens (a power of 2), bf16/fp16 window (`window_fit`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..common import triton_backend


@triton.jit
def _window_merge_kernel(q_ptr, kw_ptr, vw_ptr, wlen_ptr, o_ptr, lse_ptr, sm_scale,
                         out_ptr, lse_out_ptr,
                         KH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr,
                         H: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr):
  pid = tl.program_id(0)
  b = pid // KH
  kh = pid % KH
  n = KH * QPK
  qi = tl.arange(0, QP)
  hh = tl.arange(0, H)
  ti = tl.arange(0, W)
  live = qi < QPK
  head = b * n + kh * QPK + qi
  rows = ((b * W + ti[:, None]) * KH + kh) * H + hh[None, :]
  k = tl.load(kw_ptr + rows)
  q = tl.load(q_ptr + (pid * NP + qi[:, None]) * H + hh[None, :], mask=live[:, None],
              other=0.0)
  s = tl.dot(q.to(k.dtype), tl.trans(k)) * sm_scale
  valid = ti[None, :] < tl.load(wlen_ptr + b)
  s = tl.where(valid, s, float("-inf"))
  m = tl.max(s, 1)
  m_safe = tl.where(m > float("-inf"), m, 0.0)
  e = tl.where(valid, tl.exp(s - m_safe[:, None]), 0.0)
  z = tl.sum(e, 1)
  v = tl.load(vw_ptr + rows)
  o_w = tl.dot(e.to(v.dtype), v)                    # [QP, H], not normalised
  z_safe = tl.where(z > 0, z, 1.0)
  lse_w = tl.where(z > 0, m_safe + tl.log(z_safe), float("-inf"))
  top = lse_w
  for sp in range(NS):
    top = tl.maximum(top, tl.load(lse_ptr + (pid * NS + sp) * NP + qi, mask=live,
                                  other=float("-inf")))
  top_safe = tl.where(top > float("-inf"), top, 0.0)
  w_w = tl.where(lse_w > float("-inf"), tl.exp(lse_w - top_safe), 0.0)
  acc = o_w * (w_w / z_safe)[:, None]
  den = w_w
  for sp in range(NS):
    l_s = tl.load(lse_ptr + (pid * NS + sp) * NP + qi, mask=live, other=float("-inf"))
    w_s = tl.where(l_s > float("-inf"), tl.exp(l_s - top_safe), 0.0)
    o_s = tl.load(o_ptr + ((pid * NS + sp) * H + hh[None, :]) * NP + qi[:, None],
                  mask=live[:, None], other=0.0)
    acc += w_s[:, None] * o_s
    den += w_s
  den_safe = tl.where(den > 0, den, 1.0)
  tl.store(out_ptr + head[:, None] * H + hh[None, :],
           (acc / den_safe[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])
  tl.store(lse_out_ptr + head, tl.where(den > 0, top_safe + tl.log(den_safe), float("-inf")),
           mask=live)


def window_fit(k_win, head_dim: int) -> str | None:
  """None when the fused epilogue takes this window, else why not (one line)."""
  w = k_win.shape[1]
  if head_dim != 128:
    return f"head dim {head_dim} (the fused window takes 128)"
  if w < 16 or w > 256 or w & (w - 1):
    return f"window of {w} tokens (the fused window takes a power of 2 in [16, 256])"
  if k_win.dtype not in (jnp.bfloat16, jnp.float16):
    return f"{jnp.dtype(k_win.dtype).name} window (the fused window takes bf16/fp16)"
  return None


def window_merge_triton(q_shape, qt, o_t, lse_t, parts, p, k_win, v_win, w_len, *, scale,
                        out_dtype):
  """(out [B, N, H], lse [B, N]) of the kernel's partials (o_t [B K, parts, H, NP], lse_t
  [B K, parts, NP]) merged with the window's attention; `mosaic_ring.merge_with_window`'s
  contract without return_partials. The query is the Mosaic kernel's own operand qt
  [B K, NP, H] (`mosaic_ring.query_operand`: each KV head's query heads, padded, in the
  scales' type): read here too, KIVI's decode query has no consumer but that operand, so XLA
  computes its RoPE, padding and cast in one fusion (two launches per layer when the window
  read q [B, N, H]; GEAR-L's query has other consumers, its low-rank products). q's values
  are bf16/fp16 ones, which the 16-bit types hold alike (bf16 -> fp16 -> bf16 is exact in
  fp16's normal range), and the kernel casts to the window's type."""
  b, n, h = q_shape
  kh, qpk, np_ = p["kh"], p["qpk"], p["np"]
  why = window_fit(k_win, h)
  if why is not None:
    raise ValueError(f"KIVI fused window: {why}")
  sm_scale = h ** -0.5 if scale is None else float(scale)
  out, lse = triton_backend.launch(
      _window_merge_kernel, qt, k_win, v_win.astype(k_win.dtype),
      w_len.astype(jnp.int32), o_t, lse_t, sm_scale,
      out_shapes=[jax.ShapeDtypeStruct((b, n, h), out_dtype),
                  jax.ShapeDtypeStruct((b, n), jnp.float32)],
      grid=(b * kh,), num_warps=4, num_stages=1, inits=False, KH=kh, QPK=qpk, QP=16, H=h,
      W=k_win.shape[1], NS=parts, NP=np_)
  return out, lse
