"""Calibration statistics for Palu: per-layer input Gram matrices XᵀX and Fisher scores.

Both are computed on the *original, uncompressed* model, as the official code does
(layer inputs propagate through dense layers). The inputs of k_proj and v_proj are
the same normed hidden states, so one Gram per layer serves both projections.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.model.transformer import forward
from kvlowrank.spec import ModelSpec

_HI = jax.lax.Precision.HIGHEST


def _check_windows(windows, who: str) -> np.ndarray:
  w = np.asarray(windows)
  if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 2:
    raise ValueError(f"{who}: calibration tokens must be [n_windows, seq_len>=2], got shape "
                     f"{w.shape}")
  return w.astype(np.int32)


def _batches(windows: np.ndarray, batch_size: int) -> Iterable[np.ndarray]:
  for i in range(0, windows.shape[0], batch_size):
    yield windows[i:i + batch_size]


@functools.partial(jax.jit, static_argnames=("spec",))
def _gram_batch(params, tokens, spec: ModelSpec):
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  _, _, xs = forward(params, tokens, pos, None, spec, capture_inputs=True)
  xs = xs.astype(jnp.float32)  # [L, B, T, D]
  # fp32 accumulation of XᵀX within the batch (HIGHEST: no bf16 passes on TPU/GPU).
  return jnp.einsum("lbtd,lbte->lde", xs, xs, precision=_HI)


def gram_statistics(params, spec: ModelSpec, windows, *, batch_size: int = 4):
  """Per-layer XᵀX of the attention inputs (post-RMSNorm hidden states).

  Args:
    params: dense model parameters.
    spec: model spec.
    windows: [n, T] int token windows (no padding).
    batch_size: windows per forward.
  Returns:
    (grams [L, D, D] float64, n_tokens). Each batch's Gram is accumulated in fp32 on
    device; batches are summed in float64 on the host.
  """
  windows = _check_windows(windows, "gram_statistics")
  total = np.zeros((spec.n_layers, spec.dim, spec.dim), np.float64)
  for chunk in _batches(windows, batch_size):
    total += np.asarray(_gram_batch(params, jnp.asarray(chunk), spec), np.float64)
  return total, int(windows.size)


def lm_loss(params, tokens, spec: ModelSpec):
  """Mean next-token cross-entropy of one batch of windows [B, T] (no padding)."""
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  logits, _ = forward(params, tokens, pos, None, spec)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.mean(nll)


@functools.partial(jax.jit, static_argnames=("spec",))
def _kv_grads(params, tokens, spec: ModelSpec):
  """Per-window gradients of the LM loss w.r.t. every layer's wk and wv.

  Returns [B, L, 2, D, K*H] fp32 (one gradient per window: the empirical Fisher is
  the mean of *per-sample* squared gradients, not the square of a batch mean).
  """
  kv = [(lp["wk"], lp["wv"]) for lp in params["layers"]]

  def loss_one(kv_, toks):
    layers = [dict(lp, wk=k, wv=v) for lp, (k, v) in zip(params["layers"], kv_)]
    return lm_loss(dict(params, layers=layers), toks[None], spec)

  g = jax.vmap(jax.grad(loss_one), in_axes=(None, 0))(kv, tokens)
  return jnp.stack([jnp.stack([gk, gv], axis=1) for gk, gv in g], axis=1).astype(jnp.float32)


def fisher_scores(params, spec: ModelSpec, windows, *, reduce: str = "rms",
                  batch_size: int = 2, n_groups: Optional[int] = None) -> np.ndarray:
  """Fisher importance of each (layer, K|V) projection [Palu §3.3, App. F.3].

  The empirical Fisher of a weight entry is E[g²] over calibration windows, g the
  gradient of the next-token loss. Paper and code disagree on the reduction:
  * "rms" (official `rank_search.py`, default here because it produced Table 8):
    f = mean over the projection's entries of sqrt(E[g²]).
  * "sum_sq" (the paper: "the sum of Fisher information"): f = sum of E[g²].
  K and V projections have the same shape, so sum-vs-mean only rescales; the sqrt
  is what changes the allocation (sum_sq is far more skewed).

  Args:
    params: dense parameters (fp32 recommended: gradients of a bf16 model are noisy).
    spec: model spec.
    windows: [n, T] token windows.
    reduce: "rms" or "sum_sq".
    batch_size: windows per vmapped gradient call.
    n_groups: if given, return per-group scores [L, 2, n_groups] (columns split into
      contiguous groups of KV heads) instead of per-projection scores.
  Returns:
    float64 [L, 2] (or [L, 2, n_groups]), index 0 = keys, 1 = values.
  """
  if reduce not in ("rms", "sum_sq"):
    raise ValueError(f"fisher reduce must be 'rms' or 'sum_sq', got {reduce!r}")
  windows = _check_windows(windows, "fisher_scores")
  sq = np.zeros((spec.n_layers, 2, spec.dim, spec.kv_dim), np.float64)
  for chunk in _batches(windows, batch_size):
    g = np.asarray(_kv_grads(params, jnp.asarray(chunk), spec), np.float64)
    sq += np.sum(g * g, axis=0)
  sq /= windows.shape[0]  # E[g²] per entry
  groups = 1 if n_groups is None else n_groups
  per = sq.reshape(spec.n_layers, 2, spec.dim, groups, spec.kv_dim // groups)
  if reduce == "rms":
    out = np.sqrt(per).mean(axis=(2, 4))
  else:
    out = per.sum(axis=(2, 4))
  return out[..., 0] if n_groups is None else out
