"""GPU checks of the Triton GEAR decode kernel (`kvlowrank_kernels.gear`) against its float32
reference, on Llama-3-like shapes (K = 8, N = 32, H = 128, 2-bit KIVI with G = 64, chunks of
64, ranks 4 / 2, 2 key and 3 value outlier slots), ragged q_len / w_len / n_pchunks, every
variant; partial buffers NaN-poisoned, two runs bitwise identical. With no residual operands
the GEAR entry runs the KIVI kernel's code: its output equals `kivi_attention_triton`'s
bitwise. Run on the device machine with `pytest -m gpu`.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kvlowrank_kernels.common import triton_backend  # noqa: E402
from kvlowrank_kernels.gear import gear_attention, shapes  # noqa: E402
from kvlowrank_kernels.gear.reference import gear_attention_reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_backend.available(), reason="needs a GPU with jax-triton"),
]

F32 = jnp.float32
GS = shapes.GearShape
SHAPES = (
    GS(shapes.backbone(batch=4, capacity=4096, window=64, n_heads=32, n_kv_heads=8)),
    GS(shapes.backbone(batch=8, capacity=8192, window=64, n_heads=32, n_kv_heads=8,
                       scale_dtype=None)),
)
LENGTHS = {  # (q_len, w_len, n_pchunks) per batch row
    4: ([4096, 64, 2240, 0], [64, 1, 0, 37], [60, 1, 20, 0]),
    8: ([8192, 64, 4160, 0, 8192, 1024, 7168, 128],
        [64, 1, 0, 37, 63, 20, 5, 64], [100, 1, 65, 0, 0, 16, 112, 2]),
}


def _inputs(idx, variant, seed):
  shape = SHAPES[idx]
  q_len, w_len, npc = (np.asarray(x, np.int32) for x in LENGTHS[shape.batch])
  return shapes.make_inputs(shape, jax.random.key(seed), q_len=q_len, w_len=w_len,
                            n_pchunks=npc, variant=variant)


@pytest.mark.parametrize("variant", shapes.VARIANTS)
@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(block_s=32, num_splits=7),
                                  dict(max_registers=168)])
def test_gear_triton_matches_reference(idx, variant, opts):
  args, groups = _inputs(idx, variant, 10 + idx)
  run = lambda: gear_attention(*args, **groups, implementation="triton", out_dtype=F32,
                               poison=True, return_partials=True, **opts)
  out, lse, (po, pl) = run()
  assert not np.isnan(np.asarray(po)).any() and not np.isnan(np.asarray(pl)).any()
  ref, ref_lse = gear_attention_reference(*args, **groups, out_dtype=F32)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=5e-3, rtol=1e-3)
  again = run()
  assert np.array_equal(np.asarray(out), np.asarray(again[0])), "not bitwise deterministic"
  # Negative control: the residual terms are visible at this tolerance.
  plain, _ = gear_attention_reference(*args, out_dtype=F32)
  assert not np.allclose(np.asarray(out), np.asarray(plain), atol=1e-2, rtol=1e-2)


def test_flags_off_is_the_kivi_kernel():
  from kvlowrank_kernels.gear.triton_gear import gear_attention_triton
  from kvlowrank_kernels.kivi.triton_kivi import kivi_attention_triton
  args, _ = _inputs(0, "gear", 3)
  opts = dict(block_s=64, num_warps=2, num_stages=4, target_programs=1584, out_dtype=F32)
  a = gear_attention_triton(*args, **opts)
  b = kivi_attention_triton(*args, **opts)
  for x, y in zip(a, b):
    assert np.array_equal(np.asarray(x), np.asarray(y))


_CAP_SCRIPT = """
import jax, numpy as np
from kvlowrank_kernels.gear import gear_attention, shapes
shape = shapes.GearShape(shapes.backbone(batch=2, capacity=1024, window=64, n_heads=32,
                                         n_kv_heads=8))
args, groups = shapes.make_inputs(shape, jax.random.key(0), variant="gear-l")
for cap in (0, 200):
  out, _ = gear_attention(*args, **groups, implementation="triton", max_registers=cap)
  np.asarray(out)
"""


def test_register_cap_reaches_the_ptx(tmp_path):
  """`max_registers` (jax-triton 0.3.1 has no such option) ends up as the PTX's `.maxnreg`."""
  env = dict(os.environ, JAX_TRITON_DUMP_DIR=str(tmp_path))
  subprocess.run([sys.executable, "-c", _CAP_SCRIPT], env=env, check=True, timeout=600)
  ptx = [p.read_text() for p in tmp_path.rglob("*.ptx")]
  assert len(ptx) == 2, [str(p) for p in tmp_path.rglob("*")]
  assert sum(".maxnreg 200" in t for t in ptx) == 1
  assert sum(".maxnreg" not in t for t in ptx) == 1  # negative control: the uncapped build
