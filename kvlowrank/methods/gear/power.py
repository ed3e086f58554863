"""Low-rank factor of a residual by power iteration (GEAR Algorithm 2, after PowerSGD).

For X [..., n, d] (one (batch element, KV head) residual per leading index) and rank r:
    B <- B0 (random, seeded); for l in 0..L-1:
        if l == L-1: B <- QR(B)      (orthonormalise, last iteration only)
        A = X B
        if l == L-1: A <- QR(A)
        B = X^T A
so X ~= A B^T with A [n, r] orthonormal and B = X^T A (A B^T = A A^T X). fp32 throughout,
as the official code (`fake_poweriteration_group`: torch.rand init, fp32, --loop 3).

QR (`orthonormalize`): on a GPU, Householder QR over the r <= 8 columns in jnp
(`householder_q`), instead of `jnp.linalg.qr` (the official code's torch.linalg.qr); on
other platforms `jnp.linalg.qr` (LAPACK). Only Q is used, and A B^T = A A^T X depends on
span(A) alone, so column signs that differ between the two do not change the cache. The
reason is the GPU: `jnp.linalg.qr` runs as cuSOLVER calls (geqrf + orgqr) inside the chunk
compression's `lax.cond`; removing them shortened the GEAR-L-2 decode step (measured:
results/decode_ablations.md). On the CPU the LAPACK call compiles in a fraction of the
unrolled reflections' time (one reflection per column in the program; measured on a small
GEAR model: results/decode_ablations.md, "GEAR: the power iteration's QR"). Householder, not
Gram-Schmidt: after L-1 unnormalised iterations the columns are nearly parallel
(condition ~ (sigma_1 / sigma_r)^(2(L-1))), and Householder's Q stays orthonormal, with a
full basis for rank-deficient input as LAPACK's, where Gram-Schmidt loses the trailing
directions (a full-rank factor then no longer reproduces its chunk: tests/test_drift.py).

Init (`init_right`): B0 = uniform [0, 1) of shape [d, r] from jax.random.key(seed), shared
by every (batch element, head, chunk) -- the official code draws a fresh torch.rand per
call; a fixed seeded B0 makes the cache a deterministic function of its inputs (and lets
the float64 test reference start from the same B0). A is never read before its first
assignment, so its init does not matter. L <= 8 (`GearSpec.iterations`): without the
intermediate normalisation the first L-1 products grow like sigma_1^(2(L-1)), fine in fp32
for the products themselves; their squares are not, which `orthonormalize` scales away.

Rows of X that are all zero (tokens outside a segment) get zero rows in A whenever
A = X B has full column rank (its columns lie in the span of X's non-zero rows); `factor`
also zeroes them explicitly (rows outside `row_mask`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def init_right(seed: int, d: int, r: int):
  """B0: float32 [d, r], uniform [0, 1) from jax.random.key(seed)."""
  return jax.random.uniform(jax.random.key(seed), (d, r), jnp.float32)


def _scale_columns(m):
  """m [..., n, r] with each column divided by its largest magnitude (zero columns kept)."""
  peak = jnp.max(jnp.abs(m), axis=-2, keepdims=True)
  return m / jnp.where(peak > 0, peak, 1.0)


def householder_q(m):
  """Q [..., n, r] of m [..., n, r] (n >= r; r small, static): Householder QR, Q = H_0 ...
  H_{r-1} [I_r; 0]. A zero column (rank-deficient input) skips its reflection, so Q is
  orthonormal for every input, as LAPACK's. Each column is first divided by its largest
  magnitude (Q does not change under positive column scaling): the power iteration's
  unnormalised columns reach sigma_1^4 and more, whose squares would overflow fp32, where
  LAPACK's scaled norms do not."""
  n, r = m.shape[-2:]
  rows = jnp.arange(n)
  a = _scale_columns(m)
  refl = []
  for j in range(r):
    x = jnp.where(rows >= j, a[..., j], 0.0)                       # [..., n]
    alpha = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    sign = jnp.where(x[..., j:j + 1] >= 0, 1.0, -1.0)
    v = x + jnp.where(rows == j, sign * alpha, 0.0)
    vv = jnp.sum(v * v, axis=-1, keepdims=True)
    beta = jnp.where(vv > 0, 2.0 / jnp.where(vv > 0, vv, 1.0), 0.0)  # 0: H = I
    a = a - (beta * v)[..., :, None] * jnp.sum(v[..., :, None] * a, axis=-2, keepdims=True)
    refl.append((v, beta))
  q = jnp.broadcast_to(jnp.eye(n, r, dtype=m.dtype), m.shape)
  for v, beta in reversed(refl):
    q = q - (beta * v)[..., :, None] * jnp.sum(v[..., :, None] * q, axis=-2, keepdims=True)
  return q


def orthonormalize(m):
  """Q [..., n, r] of m [..., n, r] (n >= r): `householder_q` on a GPU, LAPACK's QR (after
  the same column scaling) elsewhere (module docstring)."""
  lapack = lambda m: jnp.linalg.qr(_scale_columns(m))[0]
  return jax.lax.platform_dependent(m, cuda=householder_q, rocm=householder_q, default=lapack)


def power_iteration(x, b0, iterations: int):
  """Algorithm 2. x [..., n, d] float32, b0 [d, r] -> (A [..., n, r], B [..., d, r])."""
  x = x.astype(jnp.float32)
  b = jnp.broadcast_to(b0, x.shape[:-2] + b0.shape)
  a = None
  for l in range(iterations):
    last = l == iterations - 1
    if last:
      b = orthonormalize(b)
    a = jnp.einsum("...nd,...dr->...nr", x, b, precision=_HI)
    if last:
      a = orthonormalize(a)
    b = jnp.einsum("...nd,...nr->...dr", x, a, precision=_HI)
  return a, b


def factor(x, rank: int, *, seed: int, iterations: int, row_mask=None):
  """Rank-`rank` factors (A, B) of x [..., n, d]; rows outside row_mask [..., n] (bool) are
  zeroed in x and in A."""
  if row_mask is not None:
    x = jnp.where(row_mask[..., None], x, 0.0)
  a, b = power_iteration(x, init_right(seed, x.shape[-1], rank), iterations)
  if row_mask is not None:
    a = jnp.where(row_mask[..., None], a, 0.0)
  return a, b
