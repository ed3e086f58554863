"""`forward` over a (data, model) mesh: the single-device model on every device's shard."""

from __future__ import annotations

from typing import Optional

import jax
from jax.sharding import PartitionSpec as P

from kvlowrank.model.transformer import forward as model_forward
from kvlowrank.parallel.mesh import DATA, MODEL, check_layout, local_spec
from kvlowrank.parallel.shardings import cache_specs, param_specs
from kvlowrank.spec import ModelSpec


def forward(mesh, params, tokens, positions, caches: Optional[tuple], spec: ModelSpec, *,
            last_only: bool = False, logits_at: Optional[jax.Array] = None,
            allow_beyond_max_seq_len: bool = False):
  """`kvlowrank.model.forward` on a mesh; same arguments and results (global shapes).

  params and caches may already be placed (`shard_params`, `shard_caches`) or not (then
  they are moved at every call). Each device runs the model on its batch rows, KV heads,
  MLP columns and vocabulary block (`local_spec`); its caches hold only its KV heads and
  their `attend` runs the method's decode path (kernel or reference) on them. Logits come
  back [B, T, V] (the vocabulary blocks concatenated).
  """
  tp = mesh.shape[MODEL]
  check_layout(spec, mesh, batch=tokens.shape[0])
  local = local_spec(spec, tp)
  cspecs = cache_specs(caches)

  def body(p, tok, pos, cs, at):
    if cs is not None:
      cs = tuple(c.for_spec(local) for c in cs)
    logits, cs = model_forward(p, tok, pos, cs, local, last_only=last_only, logits_at=at,
                               allow_beyond_max_seq_len=allow_beyond_max_seq_len,
                               axis_name=MODEL)
    if cs is not None:
      cs = tuple(c.for_spec(spec) for c in cs)
    return logits, cs

  run = jax.shard_map(
      body, mesh=mesh,
      in_specs=(param_specs(params, spec, tp), P(DATA), P(DATA),
                P() if caches is None else cspecs, P() if logits_at is None else P(DATA)),
      out_specs=(P(DATA, None, MODEL), P() if caches is None else cspecs), check_vma=False)
  return run(params, tokens, positions, caches, logits_at)
