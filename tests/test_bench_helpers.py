"""kvlowrank.bench: timing, random inputs, environment, memory counters, roofline (CPU)."""

import datetime
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank import bench
from kvlowrank.bench import env, memory


def _rand_reference(key, shape):
  """float64 numpy: 7 mantissa bits m of each 16-bit draw -> 2 * (1 + m / 128 - 1.5)."""
  bits = np.asarray(jax.random.bits(key, shape, jnp.uint16)).astype(np.int64)
  return 2.0 * (1.0 + (bits & 0x7F) / 128.0 - 1.5)


def test_rand_matches_reference_range_and_seed():
  key = jax.random.key(3)
  x = bench.rand(key, (64, 64))
  assert x.dtype == jnp.bfloat16 and x.shape == (64, 64)
  got = np.asarray(x, np.float64)
  np.testing.assert_array_equal(got, _rand_reference(key, (64, 64)))
  assert got.min() == -1.0 and got.max() == 1.0 - 2.0 ** -6  # [-1, 1), grid of 2^-6
  np.testing.assert_array_equal(np.asarray(bench.rand(key, (64, 64), jnp.float32)), got)
  np.testing.assert_array_equal(np.asarray(bench.rand(jax.random.key(3), (64, 64))), got)
  # Negative control: another key gives other values.
  other = np.asarray(bench.rand(jax.random.key(4), (64, 64)), np.float64)
  assert np.mean(other != got) > 0.9


def test_rand_u8_is_seeded_and_covers_every_byte():
  a = np.asarray(bench.rand_u8(jax.random.key(0), (1 << 16,)))
  assert a.dtype == np.uint8 and len(np.unique(a)) == 256
  np.testing.assert_array_equal(a, np.asarray(bench.rand_u8(jax.random.key(0), (1 << 16,))))
  assert np.mean(a != np.asarray(bench.rand_u8(jax.random.key(1), (1 << 16,)))) > 0.9


def test_chained_runs_the_op_n_times_in_sequence():
  traced = []

  def op(x, n):
    traced.append(1)
    return x * 2.0, n

  x = jnp.full((3,), 1.5, jnp.float32)
  out = bench.chained(op, 5)(x, jnp.arange(3))
  assert len(traced) == 5  # five calls in one executable
  assert float(out) == 5 * 3.0  # the sum of each call's first output element
  # Negative controls: no calls, or nothing floating to chain the calls through.
  with pytest.raises(ValueError, match="n must be >= 1"):
    bench.chained(op, 0)
  with pytest.raises(ValueError, match="floating-point input"):
    bench.chained(lambda n: n + 1, 2)(jnp.arange(3))


def test_time_op_returns_a_positive_median_and_the_chain_count():
  op = jax.jit(lambda x: x + 1.0)
  x = jnp.ones((8,), jnp.float32)
  t = bench.time_op(op, (x,), chain_s=1e-4, max_chain=16, samples=5)
  assert isinstance(t, bench.Timing)
  assert 0 < t.seconds < 0.1 and math.isfinite(t.seconds)
  assert 1 <= t.calls <= 16
  # The chain length obeys its bounds: capped by max_chain, 1 when one call is long enough.
  assert bench.time_op(op, (x,), chain_s=10.0, max_chain=4, samples=3).calls == 4
  assert bench.time_op(op, (x,), chain_s=1e-12, max_chain=64, samples=3).calls == 1


def test_time_op_tells_a_heavy_op_from_a_light_one():
  """Negative control of the timing itself: 48 chained 256^3 matmuls are not free."""
  a = bench.rand(jax.random.key(0), (256, 256), jnp.float32)

  def heavy(m):
    for _ in range(48):
      m = (m @ a) * (1.0 / 16)
    return m

  light = bench.time_op(jax.jit(lambda m: m[:1, :1] + 1.0), (a,), chain_s=2e-3, samples=5)
  slow = bench.time_op(jax.jit(heavy), (a,), chain_s=2e-3, samples=5)
  assert slow.seconds > 5 * light.seconds, (slow, light)


def test_time_fn_counts_calls_per_sample():
  f = jax.jit(lambda: jnp.zeros((4,)) + 1.0)
  t = bench.time_fn(f, samples=3, min_sample_s=1e-3, max_calls=8)
  assert t.seconds > 0 and 1 <= t.calls <= 8


def test_measure_ceilings_small():
  c = bench.measure_ceilings(copy_elems=1 << 16, matmul_n=64, samples=3)
  assert isinstance(c, bench.Ceilings)
  assert all(math.isfinite(v) and v > 0 for v in c)


def test_environment_has_the_header_keys():
  info = bench.environment()
  assert set(info) == {"device", "platform", "device_count", "memory_bytes", "jax", "jaxlib",
                       "triton", "jax_triton", "python", "date"}
  assert info["jax"] == jax.__version__
  assert info["python"] == sys.version.split()[0]
  assert info["date"] == datetime.date.today().isoformat()
  assert info["device"] == jax.devices()[0].device_kind and info["device_count"] >= 1
  if info["platform"] == "cpu":
    assert info["memory_bytes"] is None


def test_environment_reports_a_missing_package_as_none(monkeypatch):
  monkeypatch.setattr(env, "PACKAGES", dict(env.PACKAGES, absent="no-such-distribution-kvl"))
  info = bench.environment()
  assert info["absent"] is None and info["jax"] == jax.__version__


class _FakeDevice:

  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    return self._stats


def test_memory_counters(monkeypatch):
  stats = dict(peak_bytes_in_use=300, bytes_in_use=100, bytes_limit=1000)
  monkeypatch.setattr(memory.jax, "devices", lambda: [_FakeDevice(stats)])
  assert (memory.peak_bytes(), memory.bytes_in_use(), memory.bytes_limit()) == (300, 100, 1000)
  # Negative controls: no statistics (the CPU backend), or a counter the backend lacks.
  monkeypatch.setattr(memory.jax, "devices", lambda: [_FakeDevice(None)])
  assert (memory.peak_bytes(), memory.bytes_in_use(), memory.bytes_limit()) == (None,) * 3
  monkeypatch.setattr(memory.jax, "devices", lambda: [_FakeDevice(dict(bytes_in_use=5))])
  assert memory.peak_bytes() is None and memory.bytes_in_use() == 5


def _rec(kernel, seconds, nbytes, flops, context=16384):
  return dict(model="m", context=context, batch=8, kernel=kernel, seconds=seconds,
              bytes=nbytes, flops=flops)


def test_finalize_roofline_and_speedup():
  recs = [_rec("dense-a", 2e-3, 8e9, 1e9), _rec("dense-b", 1e-3, 8e9, 1e9),
          _rec("kivi", 5e-4, 2e9, 1e9), _rec("palu", 2e-3, 4e9, 8e12),
          _rec("broken", None, 1e9, 1e9), _rec("kivi", 1e-3, 1e9, 1e9, context=4096)]
  mm = 1e15
  bw = bench.finalize(recs, mm)
  assert bw == pytest.approx(8e12)  # the best dense bandwidth of the call
  dense_b, kivi, palu, broken, lone = recs[1:]
  assert dense_b["pct_roofline"] == pytest.approx(100.0) and dense_b["bound"] == "memory"
  assert kivi["roofline_us"] == pytest.approx(2e9 / 8e12 * 1e6)
  assert kivi["pct_roofline"] == pytest.approx(100 * 250 / 500)
  assert kivi["speedup_vs_dense"] == pytest.approx(2.0)
  assert kivi["achieved_TBps"] == pytest.approx(4.0)
  assert palu["bound"] == "compute" and palu["roofline_us"] == pytest.approx(8e12 / mm * 1e6)
  assert palu["speedup_vs_dense"] == pytest.approx(0.5)
  assert "us" not in broken
  assert lone["speedup_vs_dense"] is None  # no dense kernel at that context
  # Negative control: without a dense kernel there is no roofline, and nothing is added.
  only = [_rec("kivi", 5e-4, 2e9, 1e9)]
  assert bench.finalize(only, mm) is None and "us" not in only[0]
