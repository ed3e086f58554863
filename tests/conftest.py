"""Session-wide test hygiene.

Every XLA:CPU executable maps its code into the process (a few mappings per compiled
kernel), and JAX keeps every executable it compiled in its caches. One pytest process runs
the whole CPU suite: measured 2026-11-25, the process reached Linux's default
vm.max_map_count (65530 mappings) about three quarters of the way through, and the next
compilation segfaulted. Clearing JAX's caches after each test module frees those mappings
(a module's compiled functions are rarely reused by the next one)."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
  yield
  jax.clear_caches()
  gc.collect()
