"""Seeded decode-update cases for the fused KIVI update (`kivi.triton_update`, and
`kivi.triton_update_planar` for the planar layout), shared by the CPU interpreter check
(`interpret_checks.check_kivi_update`) and the GPU test (`test_kivi_update_gpu.py`): a KIVI
cache (warp or planar layout) prefilled to ragged lengths, then
decode steps run twice, through the cache's jnp update (`KiviCache._decode_update`, the
reference) and through the kernel, each evolving its own state.

The starting lengths put steps on every boundary the update has: a token that completes a
block of F keys (the ring takes the staged keys), a key group crossing a 128-token store
block, a value leaving the window into a new store block, a row short of R tokens (no value
leaves yet), a padding row (pos = -1), and a row whose next position is past the capacity
(dropped like padding by `update`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvlowrank.cache import base
from kvlowrank.methods.kivi.cache import KiviCache, KiviSpec
from kvlowrank.spec import ModelSpec


def spec(kv_heads: int, head_dim: int = 128) -> ModelSpec:
  return ModelSpec(vocab_size=32, dim=head_dim * kv_heads, n_layers=1, n_heads=2 * kv_heads,
                   n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=64)


def prefilled(seed, *, starts, kv_heads=2, residual=64, capacity=512, scale_dtype="float16",
              layout="warp", bits=2, v_bits=None, group=32, head_dim=128, v_head_dim=None):
  """A KIVI cache (`layout`, `bits`-bit keys, `v_bits`-bit values, groups of `group`; keys
  `head_dim` wide, values `v_head_dim`: planar, e.g. FDC/ZACK's inner cache) with row b
  holding starts[b] random tokens (bf16)."""
  b = len(starts)
  kspec = KiviSpec(bits=bits, v_bits=v_bits, group_size=group, residual=residual,
                   layout=layout, scale_dtype=scale_dtype, implementation="reference")
  cache = KiviCache.init(kspec, spec(kv_heads, head_dim), batch=b, capacity=capacity,
                         v_head_dim=v_head_dim)
  t = max(starts)
  pos = np.where(np.arange(t)[None, :] < np.asarray(starts)[:, None], np.arange(t)[None, :], -1)
  return cache.update(inputs(seed, pos, kv_heads=kv_heads, widths=widths_of(cache)), None)


def widths_of(cache: KiviCache):
  """(key width, value width) of a cache's ring."""
  return cache.k_res.shape[-1], cache.v_res.shape[-1]


def inputs(seed, positions, kv_heads=None, dtype=jnp.bfloat16, widths=(128, 128)):
  """AttnInputs with random keys/values (3x unit normal, a few outlier channels) for
  positions [B, T], keys and values `widths` wide."""
  positions = jnp.asarray(positions, jnp.int32)
  b, t = positions.shape
  kh = 2 if kv_heads is None else kv_heads
  k1, k2 = jax.random.split(jax.random.key(seed))
  k = 3.0 * jax.random.normal(k1, (b, t, kh, widths[0]))
  k = k.at[..., 5].multiply(8.0).astype(dtype)
  v = jax.random.normal(k2, (b, t, kh, widths[1])).astype(dtype)
  return base.AttnInputs(x=jnp.zeros((b, t, 8), dtype), k=k, k_pre=k, v=v, positions=positions)


def step_positions(cache: KiviCache, pad_rows=()):
  """Each row's next position (lens), -1 for pad_rows; past the capacity -> -1 (as `update`)."""
  pos = np.asarray(cache.lens).copy()
  pos[list(pad_rows)] = -1
  return np.where(pos < cache.capacity, pos, -1).astype(np.int32)


def compare(got: KiviCache, want: KiviCache, what: str):
  """Codes, scales and lengths equal; ring and staged keys within one bf16 ulp (the same fp32
  arithmetic, then one rounding to bf16: an FMA contraction may move it by one ulp, and
  Triton's CPU interpreter truncates where the GPU rounds to nearest), or 2^-16 absolute
  where code * scale + zero cancels to near 0 (one fp32 ulp of terms up to ~100, as an FMA
  contraction leaves it; seen with fp32 scales, whose zero is the exact minimum)."""
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(got.store),
                          jax.tree_util.tree_leaves(want.store), strict=True):
    name = jax.tree_util.keystr(path)
    a, e = np.asarray(a), np.asarray(e)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bad = np.argwhere(a.view(view) != e.view(view))
    if len(bad):
      raise AssertionError(f"{what}: store{name} differs at {len(bad)} elements, first "
                           f"{bad[0].tolist()}: {a[tuple(bad[0])]} vs {e[tuple(bad[0])]}")
  np.testing.assert_array_equal(np.asarray(got.lens), np.asarray(want.lens), f"{what}: lens")
  for name in ("k_res", "v_res", "k_stage"):
    a = np.asarray(getattr(got, name), np.float32)
    e = np.asarray(getattr(want, name), np.float32)
    np.testing.assert_allclose(a, e, rtol=2.0 ** -7, atol=2.0 ** -16, err_msg=f"{what}: {name}")
