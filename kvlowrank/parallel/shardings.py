"""How a model's parameters and caches split over a (data, model) mesh.

Parameters: q/k/v projections (and their biases), gate/up, Palu's down-projections
`palu_ak`/`palu_av` and FDC/ZACK's value down-projections `rot_av` are split by output
column blocks; W_o and w_down by input row blocks; Palu's per-group reconstructions
`palu_bk`/`palu_bv` by group, FDC/ZACK's per-head rotations `rot_rk`/`rot_bv` and widths
`rot_kw`/`rot_vw` by KV head; the embedding table and LM head by vocabulary; norms and the
output bias are replicated. Every block is head-major, so device d holds KV heads
[d K/tp, (d + 1) K/tp) and their query heads, with their latents. FDC/ZACK's ragged heads
split in equal blocks only once balanced (`kvlowrank.methods.rotated.balance`: heads
permuted and zero-padded so every device holds the same widths); `shard_params` and the
rotated cache refuse unbalanced ones with a one-line error naming it.
The embedding and LM head are split over the vocabulary rather than replicated: replicated,
every device would read the whole LM head at every decode step (1 GiB for Llama-3-8B,
2 GiB for the 70B shapes), which does not shrink with the number of devices.

Caches: every per-layer cache declares, per array, its batch axis and its KV-head (or
latent-group) axis (`KVCache.shard_axes`); the batch axis splits over "data", the head axis
over "model", arrays without a head axis (XQuant's X) are kept whole on every device of the
model axis.
"""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kvlowrank.cache import base as cache_base
from kvlowrank.methods.rotated import sharding as rotated_sharding
from kvlowrank.parallel.mesh import DATA, MODEL, check_layout
from kvlowrank.spec import ModelSpec

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "palu_ak", "palu_av", "rot_av")  # axis 1
ROW = ("wo", "w_down", "bq", "bk", "bv", "palu_bk", "palu_bv", "rot_rk", "rot_bv",
       "rot_kw", "rot_vw")                                                     # axis 0
REPLICATED = ("attn_norm", "mlp_norm", "bo")


def _split(ndim: int, axis: Optional[int], name: Optional[str] = MODEL,
           batch: Optional[int] = None) -> P:
  parts = [None] * ndim
  if axis is not None:
    parts[axis] = name
  if batch is not None:
    parts[batch] = DATA
  return P(*parts)


def param_specs(params, spec: ModelSpec, tp: int = 1) -> dict:
  """PartitionSpecs of a parameter pytree (same structure). Raises one-line ValueErrors for
  an unknown layer entry or Palu groups that would straddle devices."""
  def layer(i, lp):
    out = {}
    for key, w in lp.items():
      if key in COLUMN:
        out[key] = _split(w.ndim, 1)
      elif key in ROW:
        out[key] = _split(w.ndim, 0)
      elif key in REPLICATED:
        out[key] = _split(w.ndim, None)
      else:
        raise ValueError(f"params['layers'][{i}][{key!r}]: no tensor-parallel split is "
                         f"known for this entry")
    if "palu_bk" in lp:
      g = lp["palu_bk"].shape[0]
      if g % tp:
        raise ValueError(
            f"Palu latent groups: layer {i} has {g} groups of {spec.n_kv_heads // g} KV "
            f"heads; over mesh model={tp} a group would straddle devices (groups must be a "
            f"multiple of {tp}: use a smaller PaluSpec.group_size)")
    return out

  out = {"embed": _split(2, 0), "final_norm": _split(1, None),
         "layers": [layer(i, lp) for i, lp in enumerate(params["layers"])]}
  if "lm_head" in params:
    out["lm_head"] = _split(2, 1)
  if unknown := sorted(set(params) - set(out)):
    raise ValueError(f"params[{unknown[0]!r}]: no tensor-parallel split is known for this "
                     f"entry")
  return out


def cache_specs(caches) -> Optional[tuple]:
  """PartitionSpecs of a model-level cache (tuple of per-layer caches; same structure)."""
  if caches is None:
    return None

  def one(cache):
    leaves, treedef = cache_base.leaf_axes(cache)
    specs = [_split(leaf.ndim, head, batch=batch) for _, leaf, (batch, head) in leaves]
    return jax.tree_util.tree_unflatten(treedef, specs)

  return tuple(one(c) for c in caches)


def _place(tree, specs, mesh):
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs,
                      is_leaf=lambda x: x is None)


def shard_params(params, spec: ModelSpec, mesh):
  """Places a parameter pytree on the mesh (after `check_layout`; FDC/ZACK params must be
  balanced for the mesh's model axis)."""
  check_layout(spec, mesh)
  if "rot_kw" in params["layers"][0]:
    rotated_sharding.check_balanced(params, mesh.shape[MODEL])
  return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                      param_specs(params, spec, mesh.shape[MODEL]))


def shard_caches(caches, mesh):
  """Places a model-level cache on the mesh."""
  specs = cache_specs(caches)
  return tuple(jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), c, cs)
               for c, cs in zip(caches, specs))
