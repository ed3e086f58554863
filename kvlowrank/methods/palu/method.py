"""Palu (ICLR 2025) as an evaluable method: calibrate = whitening Grams + Fisher scores +
factorisation + folds (kvlowrank.methods.palu), cache = kvlowrank.methods.palu.cache ("palu").

Calibration statistics (per-layer XᵀX and Fisher scores) depend only on the model and
the calibration windows, not on the ratio / granularity / bits of a sweep point, so
they are cached as .npz files under workdir/palu_stats/<sha256 of params, windows and
Fisher settings>; a sweep pays the forward/backward passes once and each point only
re-factorises (seconds).

KV bytes per token (asymptotic, summed over layers; G groups per layer, group ranks
r_k, r_v): unquantized latents r·itemsize(cache dtype) per group latent; quantized ones
4·packed_words(r, bits) bytes of codes plus one fp16 (scale, zero) pair per (token,
group latent). The reconstruction matrices are weights, not cache. The optional
unquantized recent window does not grow with the context and is excluded.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.methods import palu
from kvlowrank.methods.palu.cache import SCALE_DTYPE
from kvlowrank.methods.registry import Method, register_method
from kvlowrank.methods.palu import calibration
from kvlowrank.methods.palu.compress import plan_layout
from kvlowrank.methods.palu.hadamard import hadamard_factors
from kvlowrank.methods.palu.spec import PaluSpec, layout_from_params, resolve_group_size
from kvlowrank_kernels.quant import packing

log = logging.getLogger(__name__)


def candidate_ranks(spec, pspec: PaluSpec) -> tuple[int, ...]:
  """Every group rank the rank search can give on this model, without calibration: the
  exact ranks for uniform allocation; for Fisher allocation (scores known only after
  calibration) every multiple of rank_multiple it may pick, and the full group rank."""
  layout = plan_layout(spec, pspec.replace(rank_search="uniform"))
  if pspec.rank_search == "uniform" or pspec.target_ratio == 0:
    return tuple(sorted(set(layout.ranks_k + layout.ranks_v)))
  full = min(spec.dim, layout.group_dim)
  lo = min(pspec.rank_multiple, full)
  return tuple(sorted({lo, full} | set(range(pspec.rank_multiple, full + 1,
                                               pspec.rank_multiple))))


def _validate(spec, pspec: PaluSpec) -> None:
  """Everything that can make a point infeasible, checked before any calibration: the
  group size (must divide n_kv_heads), the rank budget of target_ratio at rank_multiple,
  and a Hadamard order for every rank the rank search may give (hadamard=True; with
  Fisher ranks this is every candidate rank, so a rank_multiple that could land on an
  order without a Hadamard matrix is refused even if the scores would avoid it)."""
  resolve_group_size(pspec, spec)   # group_size must divide n_kv_heads
  ranks = candidate_ranks(spec, pspec)  # raises on an infeasible rank budget
  if pspec.hadamard:
    for r in ranks:
      try:
        hadamard_factors(r)
      except ValueError:
        raise ValueError(f"PaluSpec.hadamard: rank_multiple={pspec.rank_multiple} can give "
                         f"group rank {r} (candidates {list(ranks)}), which has no "
                         "Hadamard matrix; use rank_multiple=16 or 32, or hadamard=False"
                         ) from None


def _fingerprint(params, spec, *arrays, extra: str = "") -> str:
  h = hashlib.sha256(repr(spec).encode() + extra.encode())
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  for a in arrays:
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()[:16]


def _cached(path: Optional[Path], compute):
  """Loads a dict of arrays from `path` (.npz) or computes and saves it."""
  if path is not None and path.exists():
    with np.load(path) as z:
      return {k: z[k] for k in z.files}
  out = compute()
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **out)
    tmp.rename(path)
  return out


def statistics(params, spec, pspec: PaluSpec, tokens, workdir=None,
               batch_size: int = 4) -> palu.PaluCalibration:
  """Grams (always) and Fisher scores (for rank_search="fisher"), cached in workdir.

  Args:
    params: dense parameters.
    spec: model spec.
    pspec: Palu spec (rank_search, fisher_reduce, fisher_samples are read).
    tokens: int32 [n, T] calibration windows.
    workdir: folder for the .npz cache (None = no caching).
    batch_size: windows per forward.
  Returns:
    PaluCalibration.
  """
  tokens = np.asarray(tokens, np.int32)
  root = None if workdir is None else Path(workdir) / "palu_stats"
  key = None if root is None else _fingerprint(params, spec, tokens, extra="gram")
  g = _cached(None if root is None else root / f"gram_{key}.npz",
              lambda: dict(zip(("grams", "n_tokens"), calibration.gram_statistics(
                  params, spec, tokens, batch_size=batch_size))))
  fisher = None
  if pspec.rank_search == "fisher" and pspec.target_ratio > 0:
    fw = tokens if pspec.fisher_samples == 0 else tokens[:pspec.fisher_samples]
    fkey = None if root is None else _fingerprint(params, spec, fw,
                                                  extra=f"fisher-{pspec.fisher_reduce}")
    f = _cached(None if root is None else root / f"fisher_{fkey}.npz",
                lambda: {"fisher": calibration.fisher_scores(
                    params, spec, fw, reduce=pspec.fisher_reduce,
                    batch_size=max(1, batch_size // 2))})
    fisher = f["fisher"]
  return palu.PaluCalibration(grams=g["grams"], n_tokens=int(g["n_tokens"]), fisher=fisher,
                              fisher_reduce=None if fisher is None else pspec.fisher_reduce)


def _calibrate(params, spec, pspec: PaluSpec, tokens, *, workdir=None):
  stats = statistics(params, spec, pspec, tokens, workdir)
  cparams, layout = palu.compress(params, spec, pspec, stats)
  log.info("palu: gs=%d, %d groups, ranks K %s V %s, KV dims removed %.4f",
           layout.group_size, layout.n_groups, layout.ranks_k, layout.ranks_v,
           layout.compression_ratio())
  return cparams


def latent_bytes(rank: int, bits: Optional[int], cache_dtype) -> float:
  """Bytes of one token's latent of one group (codes + scale + zero, or raw)."""
  if bits is None:
    return float(rank * jnp.dtype(cache_dtype).itemsize)
  return float(4 * packing.packed_words(rank, bits) + 2 * jnp.dtype(SCALE_DTYPE).itemsize)


def _kv_bytes(spec, pspec: PaluSpec, params, cache_dtype) -> float:
  layout = layout_from_params(params, spec)
  return float(sum(layout.n_groups * (latent_bytes(rk, pspec.bits, cache_dtype)
                                      + latent_bytes(rv, pspec.bits, cache_dtype))
                   for rk, rv in zip(layout.ranks_k, layout.ranks_v)))


def _bits(pspec: PaluSpec, cache_dtype) -> str:
  if pspec.bits is None:
    return str(8 * jnp.dtype(cache_dtype).itemsize)
  return str(pspec.bits)


PALU = register_method(Method(name="palu", cache="palu", spec_cls=PaluSpec,
                              kv_bytes_per_token=_kv_bytes, calibrate=_calibrate,
                              validate=_validate, bits=_bits))
