"""The fused KIVI decode update (`kivi.triton_update`; `triton_update_planar` for the planar
layout) on the GPU against the cache's jnp update.

Seeded warp- and planar-layout caches (`kivi_update_cases`) prefilled to ragged lengths, then decode
steps through both, each jitted and evolving its own state: the store's codes and scales and
the lengths must be equal, the ring and staged keys within one bf16 ulp. Llama-3-like heads
(K = 8) and the default window R = 128, fp16 and bf16 scales; the steps cross a block
completion (the ring takes the staged keys), key and value store blocks, a row short of R
tokens, a padding row and a row at capacity. A negative control: one perturbed key element
must change the store. The CPU twin: `interpret_checks.check_kivi_update`.
"""

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kivi_update_cases as kc  # noqa: E402  (tests/kernels, on sys.path)
from kvlowrank_kernels.common import triton_backend  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not triton_backend.available(),
                                                  reason="needs a GPU with jax-triton")]

STARTS = (126, 5, 255, 190, 1023, 300)


_ref = jax.jit(lambda c, inp, pos: c._decode_update(inp, pos))  # pylint: disable=W0212
# The cache's own fused path (what `update` runs on a GPU), donated as the decode loop does.
_run = jax.jit(lambda c, inp, pos: c._fused_decode_update(inp, pos),  # pylint: disable=W0212
               donate_argnums=0)


# (layout, key bits, value bits, group): the warp layout (`triton_update`) and the planar one
# (`triton_update_planar`): KIVI-4, KIVI-2 off Hopper, mixed widths with groups of 64
LAYOUTS = [("warp", 2, 2, 32), ("planar", 4, 4, 32), ("planar", 2, 2, 32),
           ("planar", 4, 2, 64)]


@pytest.mark.parametrize("layout,bits,v_bits,group", LAYOUTS)
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_fused_update_equals_jnp_update(scale_dtype, layout, bits, v_bits, group):
  ref = kc.prefilled(1, starts=STARTS, kv_heads=8, residual=128, capacity=1024,
                     scale_dtype=scale_dtype, layout=layout, bits=bits, v_bits=v_bits,
                     group=group)
  # what `update` would run on this GPU without the reference pin
  unpinned = dataclasses.replace(ref, implementation=None)
  assert unpinned.update_implementation() == ("triton", None)
  got = jax.tree.map(jnp.copy, ref)
  for step in range(5):
    pos = kc.step_positions(ref, pad_rows=(5,) if step == 2 else ())
    inp = kc.inputs(300 + step, pos[:, None], kv_heads=8)
    ref = _ref(ref, inp, jnp.asarray(pos))
    got = _run(got, inp, jnp.asarray(pos))
    kc.compare(got, ref, f"{layout} {bits}/{v_bits} {scale_dtype} step {step}")


@pytest.mark.parametrize("layout,bits,v_bits,group", LAYOUTS[:2])
def test_fused_update_notices_a_perturbed_key(layout, bits, v_bits, group):
  ref = kc.prefilled(2, starts=STARTS, kv_heads=8, residual=128, capacity=1024, layout=layout,
                     bits=bits, v_bits=v_bits, group=group)
  pos = kc.step_positions(ref)
  inp = kc.inputs(400, pos[:, None], kv_heads=8)
  want = _ref(ref, inp, jnp.asarray(pos))
  bad = dataclasses.replace(inp, k=inp.k.at[3, 0, 6, 100].add(5.0))
  got = _run(jax.tree.map(jnp.copy, ref), bad, jnp.asarray(pos))
  with pytest.raises(AssertionError, match="store.k"):
    kc.compare(got, want, "perturbed key")
  assert np.asarray(got.lens).tolist() == np.asarray(want.lens).tolist()
