"""The Triton GEAR kernel under Triton's CPU interpreter, against its jnp reference.

`python tests/kernels/gear_interpret_checks.py NAME` sets TRITON_INTERPRET=1 before importing
the kernels and runs check NAME (`test_gear_kernel.py` runs each in a subprocess; skipped
without triton/torch). Tiny ragged shapes: q_len 0 / one chunk / full, prefill covering 0,
some or all chunks, windows full / 1 / 0, one and several splits.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import closeness  # noqa: E402
from triton_interpret import interpreted_launch  # noqa: E402

F32 = jnp.float32


def _cases(shape, seed):
  """(q_len, w_len, n_pchunks) rows: full / one chunk / mid; prefill none / all / some."""
  nb, s, w = shape.chunk, shape.capacity, shape.window
  c = s // nb
  q_len = np.asarray([s, nb][:shape.batch], np.int32)
  w_len = np.asarray([w, 1][:shape.batch], np.int32)
  yield q_len, w_len, np.asarray([c // 2, 0], np.int32)
  yield np.asarray([(c - 1) * nb, 0], np.int32), np.asarray([0, w], np.int32), np.asarray(
      [c - 1, 0], np.int32)
  del seed


def check_gear():
  """Every test shape x variant (GEAR, GEAR-L, outlier-only, and no residual = KIVI) x ragged
  lengths x two tilings; then negative controls (one chunk's key factor dropped, one key
  outlier moved) that must break the agreement."""
  from kvlowrank_kernels.gear import shapes as gs  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.gear.reference import gear_attention_reference  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.gear.triton_gear import gear_attention_triton  # pylint: disable=import-outside-toplevel
  for i, shape in enumerate(gs.TEST_SHAPES):
    for j, (q_len, w_len, npc) in enumerate(_cases(shape, i)):
      for variant in gs.VARIANTS + ("none",):
        args, groups = gs.make_inputs(shape, jax.random.key(10 * i + j), q_len=q_len,
                                      w_len=w_len, n_pchunks=npc,
                                      variant="gear" if variant == "none" else variant)
        if variant == "none":
          groups = dict(lowrank=None, sparse_k=None, sparse_v=None)
        ref, ref_lse = gear_attention_reference(*args, **groups, out_dtype=F32)
        tilings = (dict(), dict(num_splits=3, block_s=32))
        for opts in tilings if variant in ("gear", "gear-l") else tilings[:1]:
          with interpreted_launch():
            out, lse = gear_attention_triton(*args, **groups, out_dtype=F32, poison=True,
                                             **opts)
          tag = f"gear[{i}] case {j} {variant} {opts}"
          err = closeness.assert_close(out, ref, 1e-2, 1e-2, f"{tag} out")
          closeness.assert_close(lse, ref_lse, 5e-3, 1e-3, f"{tag} lse")
          print(f"{tag}: max err {err:.3g}")
  # Negative controls on shape 0, every sequence full, all chunks streaming.
  shape = gs.TEST_SHAPES[0]
  args, groups = gs.make_inputs(shape, jax.random.key(99), n_pchunks=np.zeros(2, np.int32))
  ref, _ = gear_attention_reference(*args, **groups, out_dtype=F32)
  lr, sk = groups["lowrank"], groups["sparse_k"]
  bad = [("key factor of chunk 1 dropped",
          dict(groups, lowrank=dataclasses.replace(lr, b_k=lr.b_k.at[:, :, 1].set(0)))),
         ("key outlier slots moved by one token",
          dict(groups, sparse_k=dataclasses.replace(
              sk, idx=((sk.idx.astype(jnp.int32) + 1) % shape.chunk).astype(jnp.uint8))))]
  for what, g in bad:
    with interpreted_launch():
      out, _ = gear_attention_triton(*args, **g, out_dtype=F32)
    closeness.assert_differs(out, ref, 1e-2, 1e-2, what, f"gear: {what} went unnoticed")


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items()
          if name.startswith("check_") and callable(fn)}

if __name__ == "__main__":
  if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
    sys.exit(f"usage: gear_interpret_checks.py {{{'|'.join(CHECKS)}}}")
  CHECKS[sys.argv[1]]()
