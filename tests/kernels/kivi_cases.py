"""Seeded KIVI-2bit cases shared by the Mosaic kernel tests (`test_kivi_mosaic*.py`)."""

import jax
import numpy as np

from kvlowrank_kernels.decode_attention import shapes as dshapes
from kvlowrank_kernels.kivi_attention import shapes

KS = shapes.KiviShape

# Llama-3-like GQA 4, MHA, GQA 8 and GQA 16; fp16 (KIVI's format) and bf16 scale/zero.
SHAPES = (
    KS(batch=3, capacity=640, window=128, n_heads=8, n_kv_heads=2, scale_dtype="float16"),
    KS(batch=2, capacity=384, window=37, n_heads=4, n_kv_heads=4, scale_dtype="float16"),
    KS(batch=2, capacity=512, window=128, n_heads=16, n_kv_heads=2, scale_dtype="bfloat16"),
    KS(batch=2, capacity=256, window=5, n_heads=16, n_kv_heads=1, scale_dtype="float16"),
)


def case(idx, seed, ragged=True):
  shape = SHAPES[idx]
  rng = np.random.default_rng(seed)
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, rng) if ragged else None
  wl = rng.integers(0, shape.window + 1, shape.batch).astype(np.int32)
  return shape, shapes.make_inputs(shape, jax.random.key(seed), q_len=lens, w_len=wl)
