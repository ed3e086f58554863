"""FDC and ZACK as evaluable methods (one family, two calibration recipes): calibrate = Q-K
and value Grams + factorisation + folds (kvlowrank.methods.rotated), cache = "rotated".

The Grams depend only on the model and the calibration tokens (random or data, not on the
rate / allocation / bits of a sweep point), so they are cached as .npz files under
workdir/rotated_stats/<sha256 of params and tokens> (Palu's `_cached`/`_fingerprint`): a
sweep pays the forward passes once and each point only re-factorises (seconds). The
registry's `calibrate` hook then checkpoints the compressed parameters with orbax.

KV bytes per token (asymptotic, summed over layers): Σ_g (k_g + v_g)·itemsize(cache dtype)
unquantized; quantized (KIVI-style over the packed widths W = Σk or Σv, group G): keys
W·bits/8 + 2·s·W/G (per-channel scale and zero per G tokens), values W·bits/8 + 2·s·W/G
(per-token scale and zero per G channels), s = 2 (fp16 scales); the exact window does not
grow with the context and is excluded (as KIVI's). Rotations are weights, not cache.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvlowrank.methods.palu import calibration as palu_calibration
from kvlowrank.methods.palu.method import _cached, _fingerprint  # pylint: disable=W0212
from kvlowrank.methods.registry import Method, register_method
from kvlowrank.methods.rotated import calibration
from kvlowrank.methods.rotated.compression import RotatedCalibration, compress
from kvlowrank.methods.rotated.spec import RotatedSpec, layout_from_params
from kvlowrank_kernels.quant import packing

log = logging.getLogger(__name__)
SCALE_BYTES = 2   # fp16 scales and zero points (KIVI's default)


def rotation_tokens(spec, rspec: RotatedSpec, tokens) -> np.ndarray:
  """The tokens the rotations are fitted on: the calib windows, or as many uniformly random
  vocabulary ids in windows of the same shape (seed 0)."""
  tokens = np.asarray(tokens, np.int32)
  if rspec.calibration == "random":
    return calibration.random_tokens(spec.vocab_size, tokens.shape, seed=0)
  return tokens


def statistics(params, spec, rspec: RotatedSpec, tokens, workdir=None, recipe: str = "fdc",
               batch_size: int = 4) -> RotatedCalibration:
  """The Grams `compress` needs, cached in workdir/rotated_stats."""
  root = None if workdir is None else Path(workdir) / "rotated_stats"
  toks = rotation_tokens(spec, rspec, tokens)
  key = None if root is None else _fingerprint(params, spec, toks, extra="rotated-qkv")
  g = _cached(None if root is None else root / f"qkv_{key}.npz",
              lambda: dict(zip(("qk", "v", "n"), calibration.gram_statistics(
                  params, spec, toks, batch_size=batch_size))))
  x_grams = None
  if recipe == "fdc" and rspec.v_decomposition == "whiten":
    data = np.asarray(tokens, np.int32)
    xkey = None if root is None else _fingerprint(params, spec, data, extra="gram")
    x = _cached(None if root is None else root / f"xgram_{xkey}.npz",
                lambda: {"grams": palu_calibration.gram_statistics(
                    params, spec, data, batch_size=batch_size)[0]})
    x_grams = x["grams"]
  return RotatedCalibration(qk_grams=g["qk"], v_grams=g["v"], n_tokens=int(g["n"]),
                                     x_grams=x_grams)


def _calibrate(params, spec, rspec: RotatedSpec, tokens, *, workdir=None, recipe: str):
  stats = statistics(params, spec, rspec, tokens, workdir, recipe)
  cparams, layout, rate = compress(params, spec, rspec, stats, recipe)
  log.info("%s: rate %s, widths K %s V %s, KV dims removed %.4f", recipe, rate,
           layout.k_widths, layout.v_widths, layout.compression_ratio())
  return cparams


def packed_bytes_per_token(width: int, rspec: RotatedSpec, cache_dtype, *,
                           values: bool) -> float:
  """Bytes one token's packed K' (values=False) or V' row of `width` channels costs, in
  the KIVI planar store's rows (see module docstring)."""
  if rspec.bits is None:
    return float(width * jnp.dtype(cache_dtype).itemsize)
  g = rspec.group_size
  plane = packing.plane_width(width, rspec.bits, g) if values else packing.plane_width(
      width, rspec.bits)
  return float(packing.packed_bytes(width, rspec.bits, plane) + 2 * SCALE_BYTES * width / g)


def _kv_bytes(spec, rspec: RotatedSpec, params, cache_dtype) -> float:
  layout = layout_from_params(params, spec.head_dim)
  return float(sum(packed_bytes_per_token(sum(kw), rspec, cache_dtype, values=False)
                   + packed_bytes_per_token(sum(vw), rspec, cache_dtype, values=True)
                   for kw, vw in zip(layout.k_widths, layout.v_widths)))


def _bits(rspec: RotatedSpec, cache_dtype) -> str:
  return str(8 * jnp.dtype(cache_dtype).itemsize if rspec.bits is None else rspec.bits)


def _validate(spec, rspec: RotatedSpec) -> None:
  if rspec.width_multiple > spec.head_dim:
    raise ValueError(f"RotatedSpec.width_multiple ({rspec.width_multiple}) must be <= the "
                     f"model's head_dim ({spec.head_dim})")
  if rspec.bits is not None and spec.head_dim % rspec.group_size:
    # Widths are capped at head_dim: a head kept whole has head_dim channels (spec.py).
    raise ValueError(f"RotatedSpec.group_size ({rspec.group_size}) must divide the model's "
                     f"head_dim ({spec.head_dim}) when bits is set: quantization groups of "
                     f"V' channels would straddle two heads")


FDC = register_method(Method(name="fdc", cache="fdc", spec_cls=RotatedSpec,
                             kv_bytes_per_token=_kv_bytes,
                             calibrate=functools.partial(_calibrate, recipe="fdc"),
                             validate=_validate, bits=_bits))
ZACK = register_method(Method(name="zack", cache="zack", spec_cls=RotatedSpec,
                              kv_bytes_per_token=_kv_bytes,
                              calibrate=functools.partial(_calibrate, recipe="zack"),
                              validate=_validate, bits=_bits))
