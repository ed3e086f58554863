"""Seeded KIVI-2bit cases shared by the Mosaic warp kernel tests (`test_kivi_mosaic_warp.py`)."""

import jax
import numpy as np
import pytest

from kvlowrank_kernels.dense import shapes as dshapes
from kvlowrank_kernels.kivi import shapes

KS = shapes.KiviShape

# Llama-3-like GQA 4, MHA, GQA 8 and GQA 16; fp16 (KIVI's format) and bf16 scale/zero;
# groups of 32, and one shape with groups of 64.
SHAPES = (
    KS(batch=3, capacity=640, window=128, n_heads=8, n_kv_heads=2, scale_dtype="float16"),
    KS(batch=2, capacity=384, window=37, n_heads=4, n_kv_heads=4, scale_dtype="float16"),
    KS(batch=2, capacity=512, window=128, n_heads=16, n_kv_heads=2, scale_dtype="bfloat16"),
    KS(batch=2, capacity=256, window=5, n_heads=16, n_kv_heads=1, scale_dtype="float16"),
    # groups of 64 (GEAR's backbone): warps 2 i, 2 i + 1 share a key scale row
    KS(batch=3, capacity=640, window=64, n_heads=8, n_kv_heads=2, k_group=64, v_group=64,
       scale_dtype="float16"),
)


def case(idx, seed, ragged=True):
  shape = SHAPES[idx]
  rng = np.random.default_rng(seed)
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, rng) if ragged else None
  wl = rng.integers(0, shape.window + 1, shape.batch).astype(np.int32)
  return shape, shapes.make_inputs(shape, jax.random.key(seed), q_len=lens, w_len=wl)


# (change to a valid plan request, the ValueError's expected words), for the kernel's `plan`.
PLAN_REJECTS = (
    (dict(q_shape=(2, 8, 64)), "head dim"),
    (dict(q_shape=(3, 8, 128)), "batch"),
    (dict(q_shape=(2, 6, 128), cache_shape=(2, 4, 2)), "multiple of KV heads"),
    (dict(q_shape=(2, 34, 128), cache_shape=(2, 2, 2)), "at most 16"),
    (dict(warpgroups=4), "warpgroups"),
    (dict(stages=3), "multiple of warpgroups"),
    (dict(stages=40), "shared memory"),
)


def assert_plan_rejects(plan, change, match):
  args = dict(q_shape=(2, 8, 128), cache_shape=(2, 2, 4), warpgroups=2)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    plan(args.pop("q_shape"), args.pop("cache_shape"), **args)
