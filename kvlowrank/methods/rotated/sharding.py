"""FDC / ZACK over a tensor-parallel mesh: balancing ragged KV heads by total width (#24).

`kvlowrank.parallel` splits a layer's KV heads over the mesh's "model" axis in equal
contiguous blocks, and `jax.shard_map` traces ONE body for every device, so every device's
rotated cache must have the same static widths, in the same order. FDC/ZACK's ragged widths
(`RotatedSpec.rate`) do not: `balance` makes them so, per layer independently,

  1. sorting the KV heads by k_g + v_g, descending (ties by head index),
  2. dealing them in rounds of tp: round j is the next tp heads of that order, and device i
     gets round j's i-th head in its slot j (so each device holds K / tp heads, one per
     round; new head index i·K/tp + j, device-major as `kvlowrank.parallel` splits them),
  3. padding each head's K' and V' widths up to its round's maxima (the slot widths) with
     exact zero columns: zero rotation columns (rot_rk), zero value down-projection columns
     (rot_av); the reconstruction rows (rot_bv) and folded W_O' rows past a head's width are
     zero already (`compression`),

and permuting every per-head block of the layer consistently (the query heads of each KV
head in wq / bq, wk / bk, wv / bv, rot_rk / rot_bv / rot_av / widths, the folded W_O' row
blocks; bo, norms and the MLP unchanged). A permutation of KV heads with their query heads
is exact, and so is zero padding (q'·0 = 0 in the scores, 0 value columns meet zero W_O'
rows), so the balanced model computes the unbalanced one's function on any mesh. tp = 1 is
the identity.

Optimality: a device layout is an assignment of the K heads to a (K/tp slots) x (tp devices)
grid, and it stores tp · Σ_j max_{g in slot j} w_g per token. For one cost w, sorted
consecutive rounds minimise that sum: let the rounds' maxima be m_1 >= m_2 >= ...; the
(j-1)·tp + 1 widest heads cannot fit in j - 1 rounds, so at least j rounds have a maximum
>= w_((j-1)tp+1) (the (j-1)·tp+1-th widest), i.e. m_j >= w_((j-1)tp+1) for every
assignment, and sorted rounds attain every bound with equality. Keys and values are padded
separately (k and v slot widths); sorting by k_g + v_g is then optimal whenever k and v
order the heads the same way, and a heuristic otherwise (tests/test_rotated_sharding.py
checks the one-cost and same-order cases against brute force over every assignment).
`padding_fraction` says what the padding costs.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvlowrank.methods.rotated.spec import layout_from_params
from kvlowrank.spec import ModelSpec

# Layer entries `balance` knows: per-head blocks it permutes, and the rest, which it keeps.
PER_HEAD = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "rot_rk", "rot_av", "rot_bv", "rot_kw",
            "rot_vw")
UNCHANGED = ("attn_norm", "mlp_norm", "bo", "w_gate", "w_up", "w_down")


def _check_tp(n_kv_heads: int, tp) -> int:
  if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
    raise ValueError(f"balance: tp must be a positive int, got {tp!r}")
  if n_kv_heads % tp:
    raise ValueError(f"ModelSpec.n_kv_heads={n_kv_heads} does not split over mesh "
                     f"model={tp} devices (it must be a multiple of {tp})")
  return int(tp)


def plan(k_widths, v_widths, tp: int):
  """One layer's balanced layout: (perm, k_slots, v_slots).

  perm[i·K/tp + j] is the original KV head placed on device i in slot j (module docstring);
  k_slots / v_slots [K/tp] are the slot widths, the same on every device."""
  k, v = np.asarray(k_widths, np.int64), np.asarray(v_widths, np.int64)
  n = len(k)
  tp = _check_tp(n, tp)
  order = sorted(range(n), key=lambda g: (-(k[g] + v[g]), g))
  rounds = np.asarray(order).reshape(n // tp, tp)            # [round j, device i]
  perm = tuple(int(g) for g in rounds.T.reshape(-1))         # device-major
  return (perm, tuple(int(x) for x in k[rounds].max(axis=1)),
          tuple(int(x) for x in v[rounds].max(axis=1)))


def unbalanced(k_widths, v_widths, tp: int) -> Optional[str]:
  """None when the heads split into tp device blocks of equal widths, else why (one line,
  naming `balance`)."""
  n = len(k_widths)
  m = n // tp
  blocks = {(tuple(k_widths[d * m:(d + 1) * m]), tuple(v_widths[d * m:(d + 1) * m]))
            for d in range(tp)}
  if n % tp == 0 and len(blocks) == 1:
    return None
  return (f"FDC/ZACK KV-head widths K {tuple(k_widths)} / V {tuple(v_widths)} differ between "
          f"the devices of mesh model={tp} (one traced body needs equal widths on every "
          f"device): call kvlowrank.methods.rotated.balance(params, spec, tp={tp}) first")


def check_balanced(params, tp: int) -> None:
  """One-line ValueError (naming `balance`) when a layer's widths do not split over tp."""
  layout = layout_from_params(params, 0)
  for kw, vw in zip(layout.k_widths, layout.v_widths):
    if why := unbalanced(kw, vw, tp):
      raise ValueError(why)


def _head_columns(perm, width: int) -> np.ndarray:
  """Column indices of the blocks of `width` in `perm` order."""
  return (np.asarray(perm)[:, None] * width + np.arange(width)).reshape(-1)


def balance_layer(lp: dict, spec: ModelSpec, tp: int, index: int = 0) -> dict:
  """One compressed layer, balanced for tp devices (module docstring)."""
  if unknown := sorted(set(lp) - set(PER_HEAD) - set(UNCHANGED)):
    raise ValueError(f"params['layers'][{index}][{unknown[0]!r}]: balance does not know "
                     f"how this entry follows a permutation of KV heads")
  kw = [int(x) for x in np.asarray(lp["rot_kw"])]
  vw = [int(x) for x in np.asarray(lp["rot_vw"])]
  perm, k_slots, v_slots = plan(kw, vw, tp)
  kh, g, h = spec.n_kv_heads, spec.group_size, spec.head_dim
  qcols, kvcols = _head_columns(perm, g * h), _head_columns(perm, h)
  out = dict(lp)
  out["wq"] = jnp.take(lp["wq"], qcols, axis=1)
  for key in ("wk", "wv"):
    out[key] = jnp.take(lp[key], kvcols, axis=1)
  if "bq" in lp:
    out["bq"] = jnp.take(lp["bq"], qcols)
  for key in ("bk", "bv"):
    if key in lp:
      out[key] = jnp.take(lp[key], kvcols)
  out["rot_rk"] = jnp.take(lp["rot_rk"], np.asarray(perm), axis=0)
  out["rot_bv"] = jnp.take(lp["rot_bv"], np.asarray(perm), axis=0)
  wo = lp["wo"]
  out["wo"] = jnp.take(wo.reshape(kh, -1, wo.shape[-1]), np.asarray(perm),
                       axis=0).reshape(wo.shape)
  av, offs = lp["rot_av"], np.concatenate([[0], np.cumsum(vw)])
  cols = []
  for j, old in enumerate(perm):
    cols.append(av[:, offs[old]:offs[old + 1]])
    slot = v_slots[j % (kh // tp)]
    if slot > vw[old]:
      cols.append(jnp.zeros((av.shape[0], slot - vw[old]), av.dtype))
  out["rot_av"] = jnp.concatenate(cols, axis=1)
  out["rot_kw"] = jnp.asarray(np.tile(k_slots, tp), jnp.int32)
  out["rot_vw"] = jnp.asarray(np.tile(v_slots, tp), jnp.int32)
  return out


def balance(params, spec: ModelSpec, tp: int):
  """FDC/ZACK-compressed params with every layer's KV heads permuted and zero-padded so that
  they split over a mesh of `tp` model devices with equal widths (module docstring). The
  same function on one device (exact up to fp rounding); tp = 1 returns `params`."""
  layout_from_params(params, spec.head_dim)   # one line when not FDC/ZACK-compressed
  tp = _check_tp(spec.n_kv_heads, tp)
  if tp == 1:
    return params
  return dict(params, layers=[balance_layer(lp, spec, tp, i)
                              for i, lp in enumerate(params["layers"])])


def padding_fraction(params, tp: int) -> float:
  """Extra K'/V' cache bytes `balance(params, spec, tp)` adds, as a fraction of the
  unbalanced params' (unquantized: padded channels / kept channels, summed over layers)."""
  layout = layout_from_params(params, 0)
  kept = padded = 0
  for kw, vw in zip(layout.k_widths, layout.v_widths):
    _, ks, vs = plan(kw, vw, tp)
    kept += sum(kw) + sum(vw)
    padded += tp * (sum(ks) + sum(vs))
  return (padded - kept) / kept
