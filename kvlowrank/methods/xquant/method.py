"""XQuant and XQuant-CL (Tomar, Hooper et al. 2025) as evaluable methods; no calibration
(the GQA SVDs are exact factorisations of the weights, done when the caches are built).

KV bytes per token (asymptotic, summed over layers; analytic, equal to the caches'
`bytes_per_token()`): per stored tensor of width C at b bits, 4·words(C, b) bytes of
packed codes plus one fp16 (scale, zero) pair per group (2·2·C/group bytes), with
  XQuant "x" path:      one tensor, C = D (per token)
  XQuant "latent" path: X·U_k (C = kv_dim, per channel) + X·U_v (C = kv_dim, per token)
  XQuant-CL deltas:     C = D ("x") or 2·kv_dim ("latent"); layers before the base
                        layer are plain XQuant layers.
Layers before `n_high_layers` count at `high_bits`. Exact tails (per-channel token
groups, the optional window) do not grow with the context and are excluded.
"""

from __future__ import annotations

from kvlowrank.methods.xquant.cache import XQuantSpec, choose_path
from kvlowrank.methods.xquant.cl import XQuantCLSpec
from kvlowrank.methods.xquant.store import bytes_per_token, resolve_group
from kvlowrank.methods.registry import Method, register_method


def _latent_width(spec) -> int:
  return min(spec.dim, spec.kv_dim)


def _xq_layer_bytes(spec, xs: XQuantSpec, bits, cache_dtype) -> float:
  kw = dict(scale_dtype=xs.scale_dtype, cache_dtype=cache_dtype)
  if choose_path(spec, xs.path) == "x":
    return bytes_per_token(spec.dim, bits, "token", xs.group_size, **kw)
  r = _latent_width(spec)
  return (bytes_per_token(r, bits, xs.key_axis, xs.group_size, **kw)
          + bytes_per_token(r, bits, xs.value_axis, xs.group_size, **kw))


def _xq_bytes(spec, xs: XQuantSpec, params, cache_dtype) -> float:
  del params
  return float(sum(_xq_layer_bytes(spec, xs, xs.layer_bits(i), cache_dtype)
                   for i in range(spec.n_layers)))


def _xq_validate(spec, xs: XQuantSpec) -> None:
  if xs.bits is None:
    return
  if choose_path(spec, xs.path) == "x":
    resolve_group(xs.group_size, spec.dim, "token", "config.xquant.group_size")
  else:
    r = _latent_width(spec)
    for axis in (xs.key_axis, xs.value_axis):
      resolve_group(xs.group_size, r, axis, "config.xquant.group_size")


def _cl_delta_width(spec, cs: XQuantCLSpec) -> int:
  return spec.dim if choose_path(spec, cs.path) == "x" else min(spec.dim, 2 * spec.kv_dim)


def _cl_bytes(spec, cs: XQuantCLSpec, params, cache_dtype) -> float:
  del params
  plain = cs.plain_spec()
  total = 0.0
  for i in range(spec.n_layers):
    bits = cs.bits_of(i)
    if i < cs.base_layer:
      total += _xq_layer_bytes(spec, plain, bits, cache_dtype)
    else:
      total += bytes_per_token(_cl_delta_width(spec, cs), bits, cs.delta_axis, cs.group_size,
                               scale_dtype=cs.scale_dtype, cache_dtype=cache_dtype)
  return total


def _cl_validate(spec, cs: XQuantCLSpec) -> None:
  if cs.base_layer >= spec.n_layers:
    raise ValueError(f"config.xquant_cl.base_layer ({cs.base_layer}) must be < n_layers "
                     f"({spec.n_layers})")
  if cs.layer_bits and len(cs.layer_bits) != spec.n_layers:
    raise ValueError(f"config.xquant_cl.layer_bits has {len(cs.layer_bits)} entries, the "
                     f"model has {spec.n_layers} layers")
  if cs.bits is not None:
    resolve_group(cs.group_size, _cl_delta_width(spec, cs), cs.delta_axis,
                  "config.xquant_cl.group_size")
  if cs.base_layer:
    _xq_validate(spec, cs.plain_spec())


def _bits_label(s, cache_dtype) -> str:
  del cache_dtype
  if s.bits is None:
    return "exact"
  return f"{s.bits}+{s.high_bits}x{s.n_high_layers}" if s.n_high_layers else str(s.bits)


XQUANT = register_method(Method(name="xquant", cache="xquant", spec_cls=XQuantSpec,
                                kv_bytes_per_token=_xq_bytes, validate=_xq_validate,
                                bits=_bits_label))
XQUANT_CL = register_method(Method(name="xquant_cl", cache="xquant_cl", spec_cls=XQuantCLSpec,
                                   kv_bytes_per_token=_cl_bytes, validate=_cl_validate,
                                   bits=_bits_label))
