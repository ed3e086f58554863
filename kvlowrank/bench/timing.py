"""How the benchmarks time a decode op, and the device ceilings they compare it with.

A single host dispatch of a jitted decode kernel costs tens of microseconds of host time,
more than many of the kernels themselves, so timing back-to-back dispatches measures the
host. `time_op` therefore times `chained` executables: n calls of the op in one jitted
program, n sized so that one execution lasts >= `chain_s`, median over `samples`
executions, divided by n. Shorter executables read high; BENCHMARKS.md ("How kernels are
timed") has the measurement that set the defaults.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvlowrank.bench.inputs import rand


class Timing(NamedTuple):
  """A timing: median seconds per call, and the calls each timed sample ran."""

  seconds: float
  calls: int


class Ceilings(NamedTuple):
  """The device's measured ceilings (random data, this process)."""

  copy_Bps: float      # bf16 x + 1: bytes read + written per second
  read_Bps: float      # bf16 row sums: bytes read per second
  matmul_flops: float  # bf16 N^3 matmul, FLOP per second


def time_fn(fn, *, samples=50, min_sample_s=1e-3, max_calls=64) -> Timing:
  """Median seconds per call of fn() (no arguments; returns JAX arrays).

  Warms up, sizes k so that k back-to-back calls last >= min_sample_s (at most max_calls),
  then times `samples` groups of k calls.

  Returns:
    Timing(seconds per call, k).
  """
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  one = time.perf_counter() - t0
  k = int(min(max_calls, max(1, math.ceil(min_sample_s / max(one, 1e-7)))))
  for _ in range(2):
    jax.block_until_ready([fn() for _ in range(k)])
  times = []
  for _ in range(samples):
    t0 = time.perf_counter()
    jax.block_until_ready([fn() for _ in range(k)])
    times.append((time.perf_counter() - t0) / k)
  return Timing(statistics.median(times), k)


def chained(op, n):
  """jit of n back-to-back calls of op(*args) in one executable, returning a f32 scalar.

  Each call's smallest floating input gets `0 * (a scalar of the previous call's output)`
  added (XLA does not fold a float product with zero: it would change NaN/inf results), so
  XLA can neither hoist nor merge the calls: they run in sequence on the device with no
  host dispatch between them, plus one tiny elementwise kernel each. The op must use that
  smallest input (e.g. the query): if it does not, the calls are identical and XLA merges
  them (a cache's `attend` taking unused weights: `bench.decode` chains those itself).

  Raises:
    ValueError if n < 1 or op has no floating input.
  """
  if n < 1:
    raise ValueError(f"chained: n must be >= 1, got {n}")

  def run(*args):
    leaves, tree = jax.tree_util.tree_flatten(args)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not floats:
      raise ValueError("chained: op needs a floating-point input to chain the calls through")
    pick = min(floats, key=lambda i: leaves[i].size)
    acc = jnp.zeros((), jnp.float32)
    for _ in range(n):
      cur = list(leaves)
      cur[pick] = cur[pick] + (acc * 0).astype(cur[pick].dtype)
      out = op(*jax.tree_util.tree_unflatten(tree, cur))
      acc = acc + jax.tree_util.tree_leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
    return acc
  return jax.jit(run)


def time_op(op, args, *, chain_s=20e-3, max_chain=256, samples=50) -> Timing:
  """Device seconds per call of op(*args) (op: a jitted function).

  Times one call to size the chain, then `chained(op, n)` with n calls per executable
  (n sized so one execution runs >= chain_s, at most max_chain), median over `samples`
  executions, divided by n.

  Returns:
    Timing(seconds per call, n).
  """
  f1 = chained(op, 1)
  one = time_fn(lambda: f1(*args), samples=5).seconds
  n = int(min(max_chain, max(1, math.ceil(chain_s / one))))
  f = chained(op, n) if n > 1 else f1
  return Timing(time_fn(lambda: f(*args), samples=samples).seconds / n, n)


def measure_ceilings(copy_elems=1 << 31, matmul_n=8192, samples=20) -> Ceilings:
  """The device's copy and read bandwidth and bf16 matmul rate, on random data.

  Args:
    copy_elems: bf16 elements of the copy/read buffer (default 4 GiB: well past the caches).
    matmul_n: side of the square bf16 matmul.
    samples: timings per ceiling (median).
  """
  x = rand(jax.random.key(1), (copy_elems,))
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  bw = 2 * x.size * 2 / time_fn(lambda: copy(x), samples=samples).seconds
  width = 4096 if copy_elems % 4096 == 0 else 1  # row sums over 8 KiB rows
  rsum = jax.jit(lambda a: jnp.sum(a.reshape(-1, width).astype(jnp.float32), axis=1))
  rbw = x.size * 2 / time_fn(lambda: rsum(x), samples=samples).seconds
  del x
  a = rand(jax.random.key(2), (matmul_n, matmul_n))
  b = rand(jax.random.key(3), (matmul_n, matmul_n))
  mm = jax.jit(lambda p, r: p @ r)
  t = time_fn(lambda: mm(a, b), samples=samples).seconds
  return Ceilings(bw, rbw, 2 * matmul_n ** 3 / t)
