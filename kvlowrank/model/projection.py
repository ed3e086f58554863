"""The model's projections x @ w, kept a GEMM when x is a single row (decode at batch 1).

XLA:GPU rewrites a dot whose one operand is a vector, and whose operands hold fewer than
10M elements together, into a multiply and a reduction ("dot strength reduction",
`GpuAlgebraicSimplifierVisitor::ShouldStrengthReduceDotToReduce` in XLA, on by default and
not a flag). A decode step at batch 1 has one row (B·T = 1), so the Llama-3-8B K and V
projections (4096 × 1024) and every projection of a small model became column reductions
over the weights, several times slower than a GEMM reading the same bytes (measured:
`results/decode_ablations.md`, "Batch 1: the projections XLA turned into reductions").
`project` runs one row as two (a zero row appended) and reads row 0 back behind an
optimization barrier, so XLA keeps the product a GEMM and cannot fold the slice back into
a one-row dot. Row 0 is the same product; only the summation order inside the GEMM may
differ from a vector kernel's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def project(x, w):
  """x [..., D] @ w [D, N] -> [..., N]; one row runs as a two-row GEMM (module docstring)."""
  if math.prod(x.shape[:-1]) != 1:
    return x @ w
  rows = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
  y = jax.lax.optimization_barrier(rows @ w)
  return y[:1].reshape(*x.shape[:-1], w.shape[-1])
