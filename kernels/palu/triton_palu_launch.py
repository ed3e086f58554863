"""Launch side of the Palu fused latent decode attention (`triton_palu` holds the kernel).

`palu_attention_triton` validates shapes (`plan`), builds the RoPE table and, for
MHA groups (one query head per KV head), the absorbed query operands, then runs the
kernel through jax-triton and merges the split-K partials.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..common import triton_backend
from .packed import PackedLatent
from .reference import rope_angles
from .triton_palu import latent_kernel
from .triton_plan import DEFAULT_BLOCK_S, latent_bits, plan  # noqa: F401  (re-exported)


def rope_table(inv_freq, capacity: int, dtype=jnp.float32):
  """[S, H] float32 table of fl(t * w) for every slot t: cos in even, sin in odd columns.

  (The reference's angles; interleaved so the MHA path's score is one row reduction
  sum_c x[:, c] * table[t, c] against the interleaved absorbed operand, and the GQA path
  splits one [T, H] tile into its cos and sin halves in registers.)
  """
  ang = rope_angles(inv_freq, jnp.arange(capacity))
  table = jnp.stack([jnp.cos(ang), jnp.sin(ang)], axis=-1).reshape(capacity, 2 * ang.shape[1])
  return table.astype(dtype)


def absorbed_queries(q, b_k, k_bias, scale, kdt):
  """Per-head absorbed query operands for the MHA path (Palu with one query per KV head).

  P = q1 B1 + q2 B2 and Q = q2 B1 - q1 B2 per rotation pair (q1, q2 the two RoPE halves
  of the scaled query, B1, B2 the matching column halves of the head's B_k slice),
  computed once per call in float32 here instead of once per tile in the kernel.
  Returns (pq [B, N, rk, H] kdt with P_i in column 2i and Q_i in column 2i + 1,
  pqb [B, N, H] float32 bias terms, interleaved the same way, or None).
  """
  b, n, h = q.shape
  gr, rk, gh = b_k.shape
  g, hh = gh // h, h // 2
  qf = q.astype(jnp.float32) * (scale * 1.4426950408889634)
  q1, q2 = qf[..., :hh], qf[..., hh:]
  bk = b_k.astype(jnp.float32).reshape(gr, rk, g, 2, hh).transpose(0, 2, 3, 1, 4)
  bk = bk.reshape(gr * g, 2, rk, hh)            # [N, 2, rk, hh] (one query head per KV head)
  b1, b2 = bk[None, :, 0], bk[None, :, 1]
  pm = q1[:, :, None, :] * b1 + q2[:, :, None, :] * b2
  qm = q2[:, :, None, :] * b1 - q1[:, :, None, :] * b2
  pq = jnp.stack([pm, qm], axis=-1).reshape(b, n, rk, h).astype(kdt)
  pqb = None
  if k_bias is not None:
    kb = k_bias.astype(jnp.float32).reshape(gr * g, 2, hh)[None]
    pqb = jnp.stack([q1 * kb[:, :, 0] + q2 * kb[:, :, 1], q2 * kb[:, :, 0] - q1 * kb[:, :, 1]],
                    axis=-1).reshape(b, n, h)
  return pq, pqb


def _latent_args(x, dummy):
  """(data, scale, zero, bits) for an array or PackedLatent. fp16 latents stay fp16 (the
  kernel's products then run in fp16); any other float array is rounded to bf16."""
  if isinstance(x, PackedLatent):
    return x.codes, x.scale, x.zero, x.bits
  return x.astype(_latent_dtype(x)), dummy, dummy, 16


def _latent_dtype(x):
  """Storage type of a 16-bit latent in the kernel: fp16 if given fp16, else bf16."""
  return jnp.float16 if jnp.dtype(x.dtype) == jnp.float16 else jnp.bfloat16


def palu_attention_triton(q, hk, hv, b_k, lengths, inv_freq, *, k_bias=None, scale=None,
                          out_dtype=None, block_s=DEFAULT_BLOCK_S, num_splits=None,
                          absorb=None, target_programs=None, trans=False, num_warps=8,
                          num_stages=1, poison=False, return_partials=False, rope=None,
                          heads_per_program=None, rope_dtype=jnp.float32):
  """Fused Palu decode attention; same contract as `palu_attention_reference`.

  Args (beyond the reference's): inv_freq [H/2] float32 (already resolved);
    block_s, num_splits, absorb, target_programs, trans, num_warps, num_stages: kernel knobs
      (trans: token tiles as the MMA N dim, [H/2, T]; else as M, [T, H/2]). Defaults: the
      fastest of the benchmark's sweep (BENCHMARKS.md): 128-token tiles on two warpgroups,
      warpgroup MMAs for the key product, no multi-stage pipelining (two stages of a 4-head
      group's latents do not fit next to its 128 KiB of reconstruction operands);
    poison: NaN-fill partial outputs first (tests); return_partials: also return them.
    rope: optional precomputed `rope_table(inv_freq, S)` (a model builds it once; by
      default it is built per call, inside the timed function in the benchmarks).
    rope_dtype: dtype of the per-call table (float32, or float16: half the bytes per tile;
      cos/sin then carry <= 2**-12 absolute error, below the bf16 rounding of the latents).
  """
  h = q.shape[-1]
  # np.float32: jax-triton passes a Python float as an fp64 scalar.
  scale = np.float32(h ** -0.5 if scale is None else scale)
  lengths = lengths.astype(jnp.int32)
  hk_d, hks, hkz, kbits = _latent_args(hk, lengths)
  hv_d, hvs, hvz, vbits = _latent_args(hv, lengths)
  p = plan(q.shape, hk.shape, hv.shape, b_k.shape, kbits=kbits, vbits=vbits,
           has_bias=k_bias is not None, block_s=block_s, num_splits=num_splits,
           absorb=absorb, target_programs=target_programs, trans=trans,
           heads_per_program=heads_per_program)
  bias = k_bias.astype(jnp.float32) if k_bias is not None else lengths
  rope = rope_table(inv_freq, int(hk.shape[1]), rope_dtype) if rope is None else rope
  pq, pqb = lengths, lengths
  # The key product's operand type: the key latent's storage type (fp16 when dequantized).
  # B_k travels as fp16 next to fp16 latents, else as bf16 (the kernel converts it to kdt).
  kdt = _latent_dtype(hk_d) if kbits == 16 else jnp.float16
  bk_dt = jnp.float16 if kbits == 16 and kdt == jnp.float16 else jnp.bfloat16
  if p["constexprs"]["ABSORB"]:
    pq, pqb = absorbed_queries(q, b_k, k_bias, scale, kdt)
    pqb = lengths if pqb is None else pqb
  return triton_backend.launch_split_k(
      latent_kernel,
      q.astype(jnp.bfloat16), hk_d, hks, hkz, hv_d, hvs, hvz, b_k.astype(bk_dt), bias,
      pq, pqb, rope, lengths, int(hk.shape[1]), p["num_splits"], scale,
      out_shapes=p["out_shapes"], grid=p["grid"], num_warps=num_warps, num_stages=num_stages,
      poison=poison, out_dtype=out_dtype or q.dtype, return_partials=return_partials,
      **p["constexprs"])
