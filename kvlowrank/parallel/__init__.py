"""Tensor- and data-parallel decoding over the GPUs of one host, on JAX SPMD.

A `jax.sharding.Mesh` with axes ("data", "model") (`make_mesh`). The model axis splits
attention by KV head (q/k/v column blocks, W_o row block; the query heads of a KV head stay
with it), the MLP Megatron-style (gate/up column blocks, down row block) and the embedding
and LM head over the vocabulary; the data axis splits the batch. `forward` runs the
single-device `kvlowrank.model.forward` on every device under `jax.shard_map`, with the local
spec (`local_spec`) and shards: each device's caches are ordinary caches over its own KV
heads, so every method's decode kernel runs unchanged on its shard; the row-split products
are summed with `psum` over "model". `shard_params` / `shard_caches` place a model and its
caches (`param_specs` / `cache_specs` say how each array splits; a cache declares its head
axes with `KVCache.shard_axes`). FDC/ZACK's ragged KV heads must first be balanced for the
model axis (`kvlowrank.methods.rotated.balance`: heads permuted and zero-padded so every
device holds the same widths).
"""

from kvlowrank.parallel.mesh import DATA, MODEL, check_layout, local_spec, make_mesh
from kvlowrank.parallel.shardings import (cache_specs, param_specs, shard_caches,
                                          shard_params)
from kvlowrank.parallel.forward import forward
