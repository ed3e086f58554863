"""Orthonormal Walsh-Hadamard matrices and a fast transform (Palu §3.4, Eq. 8).

Palu folds an orthonormal Hadamard rotation R into its low-rank factors offline
(A <- A R, B <- R^T B) so that the cached latents x A R have no outlier channels
before quantization. Ranks are multiples of 32, so besides powers of two we need
sizes like 96 = 8*12, 160 = 8*20, 224 = 8*28 (QuIP#/Palu use had12/20/28 factors).

Construction (`hadamard_factors`): n = 2^k * m with
  * m = 1: Sylvester, H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] (symmetric);
  * m = q + 1 for a prime q = 3 (mod 4), m not a power of two: Paley I,
      H = I + [[0, 1^T], [-1, Q]], Q the q x q Jacobsthal matrix Q_ij = chi(j - i)
      (chi = Legendre symbol mod q, chi(0) = 0);
  * m = 2(q + 1) for a prime q = 1 (mod 4): Paley II, the symmetric conference
      matrix C = [[0, 1^T], [1, Q]] with 0 -> [[1,-1],[-1,-1]], +-1 -> +-[[1,1],[1,-1]].
The smallest such m is chosen (largest power-of-two factor, fastest transform) and
the matrix is kron(H_{2^k}, H_m) / sqrt(n), orthonormal. Supported n include every
power of two, 12, 20, 24, 28, 36, 40, 44, 48, 56, 60, ... and every multiple of 32 up
to 1344 (e.g. 416 = 4 * 104). Unsupported n (odd n > 1, 6, 10, 52, 92, 100, 1376, ...)
raise ValueError. Only prime fields are used (no GF(p^k) arithmetic).

`hadamard_transform(x, axis)` computes y = x @ H along `axis` (contracting that axis
with H's rows) in O(n log n + n m): a butterfly FWHT over the 2^k factor and an
m x m matmul for the Paley factor; `inverse=True` applies H^T (= H^-1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _is_prime(q: int) -> bool:
  if q < 2:
    return False
  return all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
  residues = {(i * i) % q for i in range(1, q)}
  chi = np.array([0] + [1 if a in residues else -1 for a in range(1, q)], np.float64)
  idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
  return chi[idx]


def _paley1(q: int) -> np.ndarray:
  """Order q+1 Hadamard matrix for prime q = 3 mod 4."""
  s = np.zeros((q + 1, q + 1))
  s[0, 1:] = 1.0
  s[1:, 0] = -1.0
  s[1:, 1:] = _jacobsthal(q)
  return np.eye(q + 1) + s


def _paley2(q: int) -> np.ndarray:
  """Order 2(q+1) Hadamard matrix for prime q = 1 mod 4."""
  c = np.zeros((q + 1, q + 1))
  c[0, 1:] = 1.0
  c[1:, 0] = 1.0
  c[1:, 1:] = _jacobsthal(q)
  zero_blk = np.array([[1.0, -1.0], [-1.0, -1.0]])
  one_blk = np.array([[1.0, 1.0], [1.0, -1.0]])
  return np.kron(c, one_blk) + np.kron(c == 0, zero_blk)


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def _paley_kind(m: int):
  """'paley1'/'paley2' if an order-m Paley matrix over a prime field exists, else None."""
  if m % 4 or _is_pow2(m):
    return None
  if _is_prime(m - 1) and (m - 1) % 4 == 3:
    return "paley1"
  if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
    return "paley2"
  return None


def hadamard_factors(n: int) -> tuple[int, int]:
  """Returns (2^k, m) with n = 2^k * m as constructed here (m = 1: pure Sylvester).

  Raises ValueError if no supported construction exists for n.
  """
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"Hadamard size n must be a positive int, got {n!r}")
  n = int(n)
  if _is_pow2(n):
    return n, 1
  p = n & -n  # largest power of two dividing n
  while p >= 1:
    if _paley_kind(n // p):
      return p, n // p
    p //= 2
  raise ValueError(
      f"Hadamard size n={n} unsupported: need n = 2^k * m with m = 1, m = q+1 (prime "
      f"q = 3 mod 4) or m = 2(q+1) (prime q = 1 mod 4)")


@functools.lru_cache(maxsize=None)
def _small_factor(m: int) -> np.ndarray:
  """Unnormalised +-1 order-m factor (m = 1 or a Paley order), verified H H^T = m I."""
  if m == 1:
    h = np.ones((1, 1))
  else:
    kind = _paley_kind(m)
    h = _paley1(m - 1) if kind == "paley1" else _paley2(m // 2 - 1)
  if not np.array_equal(h @ h.T, m * np.eye(m)):  # construction self-check
    raise AssertionError(f"internal error: Paley factor of order {m} is not Hadamard")
  h.setflags(write=False)
  return h


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  h.setflags(write=False)
  return h


def hadamard_matrix(n: int, dtype=jnp.float32) -> jax.Array:
  """Orthonormal Hadamard matrix H [n, n] (H H^T = I), entries +-1/sqrt(n).

  Args:
    n: size (see module doc for the supported sizes).
    dtype: output dtype.
  Returns:
    kron(Sylvester(2^k), Paley(m)) / sqrt(n) as a jax array.
  """
  p, m = hadamard_factors(n)
  h = np.kron(_sylvester(p), _small_factor(m)) / np.sqrt(n)
  return jnp.asarray(h, dtype)


@functools.partial(jax.jit, static_argnames=("axis", "inverse"))
def hadamard_transform(x, axis: int = -1, *, inverse: bool = False):
  """y = x @ H along `axis` (or x @ H^T when inverse) with H = hadamard_matrix(n).

  Fast path: for n = 2^k * m, view the axis as [2^k, m]; multiply the m-axis by the
  small Paley factor and run the butterfly FWHT (Sylvester is symmetric) over 2^k.
  Computation is fp32 (HIGHEST matmul precision); the result has x's dtype.
  """
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"hadamard_transform: axis {axis} out of range for ndim {x.ndim}")
  n = x.shape[axis]
  p, m = hadamard_factors(n)
  dtype = x.dtype
  y = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
  lead = y.shape[:-1]
  y = y.reshape(lead + (p, m))
  if m > 1:
    hm = _small_factor(m)
    hm = jnp.asarray(hm.T if inverse else hm, jnp.float32)
    y = jnp.einsum("...am,mn->...an", y, hm, precision=jax.lax.Precision.HIGHEST)
  h = 1
  while h < p:
    # In-place FWHT stage: pairs (i, i + h) inside blocks of 2h -> (a + b, a - b).
    y = y.reshape(lead + (p // (2 * h), 2, h, m))
    a, b = y[..., 0, :, :], y[..., 1, :, :]
    y = jnp.stack([a + b, a - b], axis=-3)
    h *= 2
  y = y.reshape(lead + (n,)) * np.float32(1.0 / np.sqrt(n))
  return jnp.moveaxis(y, -1, axis).astype(dtype)
