"""Session-wide test hygiene.

Every XLA:CPU executable maps its code into the process (a few mappings per compiled
kernel), and JAX keeps every executable it compiled in its caches. One pytest process runs
the whole CPU suite: measured 2026-11-25, the process reached Linux's default
vm.max_map_count (65530 mappings) about three quarters of the way through, and the next
compilation segfaulted. Clearing JAX's caches after each test module frees those mappings
(a module's compiled functions are rarely reused by the next one)."""

import gc
import os
import shutil
import tempfile

# CPU runs only: on a machine with an NVIDIA GPU the XLA flags below would also apply to the
# GPU backend's generated kernels that the GPU tests exercise (the compilation cache below is
# CPU only as well). Everything here is set before JAX starts; subprocesses (the parallel
# worker, launchers, the notebook) inherit it.
_CPU_ONLY = not os.path.exists("/dev/nvidiactl")

# Most of this suite's time is XLA:CPU compiling small programs.
# * --xla_backend_optimization_level=0: most of a compile was LLVM's optimisation passes.
#   The same HLO and the same runtime GEMM kernels; only the generated loops are less
#   optimised (their floating-point results may differ in the last bits, within every
#   test's tolerance). Measured 2026-11-26 on the 2-core box: the whole suite 10 min 44 s
#   instead of 17 min 17 s.
# * --xla_cpu_use_fusion_emitters=false: XLA:CPU's fusion emitters (MLIR pipelines per
#   fusion) then took most of the remaining compile time; the older loop emitters generate
#   the same fusions' loops directly in LLVM IR (the same HLO after fusion, the same runtime
#   GEMM/XNNPACK kernels). Measured 2026-11-29 on the 2-core box, A/B back to back (-n 0):
#   test_evict 105 s -> 57 s, test_xquant_cache 62 s -> 37 s, test_api 112 s -> 113 s (its
#   generation loops gain nothing); the whole suite passed with it (960 passed, 12 skipped).
# A flag the user already set in XLA_FLAGS is left as given.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
  if _CPU_ONLY and _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Many test modules compile the same programs (a method's generation loop on stories260K,
# SmolLM2's forward, ...), and the fixture below clears JAX's in-memory caches after each
# module. A persistent compilation cache shared by the run's workers (and the subprocesses
# they start) compiles each of them once. Measured 2026-11-27 on the 2-core box with a
# cold cache: test_api + test_drift + test_evict 134 s instead of 152 s; the whole CPU
# suite in clean-clone CI runs 11:08, 10:59 and 12:00 with it, 11:35 and 11:47 without
# (within run-to-run variance). The
# folder is one per pytest run: the process that imports this first (xdist's controller)
# names it, its workers and their subprocesses inherit the variable, and it removes the
# folder when the run ends. A cache folder set by the user is left alone. CPU only.
_CACHE_DIR = None
if _CPU_ONLY and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = os.path.join(tempfile.gettempdir(), f"kvlowrank-jax-cache-{os.getpid()}")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  """`-m gpu` spreads each file's tests over the workers (xdist's `--dist load`).

  pyproject.toml's addopts give the CPU suite a test file per worker, so that a module's
  fixtures and compiled programs serve all its tests. The GPU suite's time is in a few files
  of slow tests (17 greedy generations of 1-3 min each in `test_decode_path_gpu.py`), which
  one worker would run one after another: `pytest -m gpu -n 6` then overran a 10-minute call
  on an H100 (2026-11-28). An explicit `--dist` other than loadfile is left alone."""
  if (getattr(config.option, "markexpr", "") == "gpu"
      and getattr(config.option, "dist", "no") == "loadfile"):
    config.option.dist = "load"


def pytest_sessionfinish(session):
  """The run's compilation cache goes with the run (removed by the process that named it,
  not by xdist's workers, which have `workerinput`)."""
  if _CACHE_DIR is not None and not hasattr(session.config, "workerinput"):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
  yield
  jax.clear_caches()
  gc.collect()


def pytest_collection_modifyitems(config, items):
  """The files that hold a `slow` test run first, then the rest by number of tests.

  pyproject.toml's `--no-loadscope-reorder` makes xdist's loadfile scheduler hand out the
  files in this order (its default order is by number of tests only). The slow files are
  long single units (test_parallel.py: one 4-device subprocess of ~2 min; the notebook and
  launcher subprocesses): started first, they overlap the many short files instead of
  finishing alone at the end of the run, with one worker idle."""
  if not hasattr(config, "workerinput"):   # xdist's workers collect; others keep file order
    return
  files: dict = {}
  for item in items:
    files.setdefault(item.nodeid.split("::")[0], []).append(item)
  key = lambda f: (not any(i.get_closest_marker("slow") for i in files[f]), -len(files[f]))
  items[:] = [i for f in sorted(files, key=key) for i in files[f]]
