"""Calibration statistics of FDC / ZACK: per-KV-head Grams of the post-RoPE Q-K stacks and of V.

The rotation of KV head g is the right singular vectors of the UNCENTERED stack
X_g = [Q_n (every query head n of the group, post-RoPE); K_g (post-RoPE)] over all
calibration tokens (FDC §5.1; under GQA the group shares one R so the cache stores one K'
per KV head). X_gᵀX_g is only H×H, so R and the singular values come from its eigen-
decomposition (θ_i = sqrt(λ_i)); no mean is subtracted (centering would break the
dot-product identity (q R)(k R)ᵀ = q kᵀ). ZACK's value rotation likewise comes from
VᵀV + Σ_n W_O^n W_O^nᵀ (the Gram of [V; W_O^{n ᵀ}...], ZACK §4.2: plain concatenation,
no reweighting of the two blocks, as the paper).

Tokens: "random" = uniformly random vocabulary ids (FDC: R barely depends on the data;
>= 8K tokens), "data" = the calib windows. Positions are 0..T-1 of each window, so
calib.seq_len should cover the evaluated context (post-RoPE statistics depend on position).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.model.transformer import forward, qkv_projections
from kvlowrank.spec import ModelSpec

_HI = jax.lax.Precision.HIGHEST


def random_tokens(vocab_size: int, shape, seed: int) -> np.ndarray:
  """int32 [n, T] ids drawn uniformly from [0, vocab_size) (numpy PCG64, seeded)."""
  return np.random.default_rng(seed).integers(0, vocab_size, size=shape).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("spec",))
def _grams_batch(params, tokens, spec: ModelSpec):
  """Per-layer Grams of one batch of windows: (qk [L,K,H,H], v [L,K,H,H]) fp32."""
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, _, xs = forward(params, tokens, pos, None, spec, capture_inputs=True)
  kh, g, h = spec.n_kv_heads, spec.group_size, spec.head_dim
  qk, vv = [], []
  for lp, x in zip(params["layers"], xs):
    q, inp = qkv_projections(lp, x, pos, spec)
    qf = q.astype(jnp.float32).reshape(b, t, kh, g, h)
    kf, vf = inp.k.astype(jnp.float32), inp.v.astype(jnp.float32)
    qk.append(jnp.einsum("btkgh,btkgi->khi", qf, qf, precision=_HI)
              + jnp.einsum("btkh,btki->khi", kf, kf, precision=_HI))
    vv.append(jnp.einsum("btkh,btki->khi", vf, vf, precision=_HI))
  return jnp.stack(qk), jnp.stack(vv)


def gram_statistics(params, spec: ModelSpec, windows, *, batch_size: int = 4):
  """Sums of the per-KV-head Grams over all windows.

  Args:
    params: dense parameters.
    spec: model spec.
    windows: int [n, T] token windows (no padding).
    batch_size: windows per forward.
  Returns:
    (qk [L, K, H, H], v [L, K, H, H]) float64 (batches summed on the host), n_tokens.
  """
  w = np.asarray(windows)
  if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 2:
    raise ValueError(f"rotated calibration: tokens must be [n_windows, seq_len>=2], got "
                     f"shape {w.shape}")
  w = w.astype(np.int32)
  shape = (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.head_dim)
  qk, vv = np.zeros(shape), np.zeros(shape)
  for i in range(0, w.shape[0], batch_size):
    a, b = _grams_batch(params, jnp.asarray(w[i:i + batch_size]), spec)
    qk += np.asarray(a, np.float64)
    vv += np.asarray(b, np.float64)
  return qk, vv, int(w.size)


def rotation_from_gram(gram):
  """(R [.., H, H] columns = right singular vectors, sigma [.., H]) from stacked Grams
  [.., H, H], singular values descending (θ = sqrt of the Gram's eigenvalues)."""
  g = np.asarray(gram, np.float64)
  g = 0.5 * (g + np.swapaxes(g, -1, -2))
  lam, vec = np.linalg.eigh(g)
  order = np.argsort(-lam, axis=-1)
  lam = np.take_along_axis(lam, order, -1)
  vec = np.take_along_axis(vec, order[..., None, :], -1)
  # Singular vectors are defined up to sign: make each column's largest-magnitude entry
  # positive, so rotations from two calibrations can be compared entry by entry (FDC's
  # δ̄/ε̄ test); the folds do not care (Q and K share the same R).
  big = np.take_along_axis(vec, np.argmax(np.abs(vec), axis=-2)[..., None, :], -2)
  vec = vec * np.where(big < 0, -1.0, 1.0)
  return vec, np.sqrt(np.clip(lam, 0.0, None))
