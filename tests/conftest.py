"""Session-wide test hygiene.

Every XLA:CPU executable maps its code into the process (a few mappings per compiled
kernel), and JAX keeps every executable it compiled in its caches. One pytest process runs
the whole CPU suite: measured 2026-11-25, the process reached Linux's default
vm.max_map_count (65530 mappings) about three quarters of the way through, and the next
compilation segfaulted. Clearing JAX's caches after each test module frees those mappings
(a module's compiled functions are rarely reused by the next one)."""

import gc
import os

# Most of this suite's time is XLA:CPU compiling small programs, and most of a compile is
# LLVM's optimisation passes. Tests run with the backend's optimisations off: the same HLO
# and the same runtime GEMM kernels, only the generated loops are less optimised (their
# floating-point results may differ in the last bits, within every test's tolerance).
# Measured 2026-11-26 on the 2-core box: the whole suite 10 min 44 s instead of 17 min 17 s.
# Set before JAX starts; subprocesses (the parallel worker, launchers, the notebook) inherit
# it. Not on a machine with an NVIDIA GPU, where the flag would also apply to the GPU
# backend's generated kernels that the GPU tests exercise.
if ("xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    and not os.path.exists("/dev/nvidiactl")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
  yield
  jax.clear_caches()
  gc.collect()
