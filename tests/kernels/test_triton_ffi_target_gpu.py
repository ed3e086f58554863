"""On the GPU: `triton_backend.launch` lowers to jaxlib's typed-FFI Triton handler, XLA records
the launches in its command buffers (CUDA graphs) with the fusions between them, and the
outputs equal the jnp reference. Negative control: jax-triton's own lowering (the legacy
`triton_kernel_call`) leaves the launches outside any command buffer. The thunk sequence is
read from XLA's dump of the compile (`xla_dump_to` as a per-compile option)."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.common import triton_backend

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _affine(x_ptr, o_ptr, N: tl.constexpr):
  i = tl.arange(0, N)
  tl.store(o_ptr + i, tl.load(x_ptr + i) * 1.5 + 1.0)


def _launch(x):
  return triton_backend.launch(_affine, x, out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                               grid=(1,), num_warps=1, num_stages=1, inits=False,
                               N=x.shape[0])[0]


def _chain(x):
  """Three launches with fusions between them: 7 commands, above XLA's minimum graph (5)."""
  y = _launch(x * 2.0)
  w = _launch(jnp.sin(y))
  return _launch(jnp.cos(w) + x) * 3.0


def _top_level_thunks(dump: pathlib.Path) -> list[str]:
  """The kinds of the top-level thunks after XLA's thunk passes (command buffers formed)."""
  (path,) = [p for p in dump.glob("*.thunk_sequence_after_thunk_passes.txt")
             if "_chain" in p.name] or [p for p in dump.glob("*.thunk_sequence.txt")
                                         if "_chain" in p.name]
  return re.findall(r"^\d+: (k\w+)", path.read_text(), flags=re.MULTILINE)


def _compile(tmp_path, name, n):
  """n differs between the tests: JAX caches a jaxpr's lowering, whichever rule was current."""
  x = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
  dump = tmp_path / name
  compiled = jax.jit(_chain).lower(x).compile(compiler_options={"xla_dump_to": str(dump)})
  g = lambda a: a * 1.5 + 1.0
  want = g(jnp.cos(g(jnp.sin(g(x * 2.0)))) + x) * 3.0
  np.testing.assert_allclose(np.asarray(compiled(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
  return compiled.as_text(), _top_level_thunks(dump)


def test_launches_in_command_buffers(tmp_path):
  if not triton_backend.ffi_handler_registered():
    pytest.skip("this jaxlib registers no triton_kernel_call_ffi")
  hlo, thunks = _compile(tmp_path, "ffi", 128)
  assert hlo.count('custom_call_target="triton_kernel_call_ffi"') == 3
  assert "kCommandBuffer" in thunks and "kCustomCall" not in thunks, thunks


def test_negative_control_legacy_lowering(tmp_path):
  from jax.interpreters import mlir  # pylint: disable=import-outside-toplevel
  from jax_triton import triton_lib  # pylint: disable=import-outside-toplevel
  triton_backend._install_ffi_lowering()  # pylint: disable=protected-access
  mlir.register_lowering(triton_lib.triton_kernel_call_p, triton_backend.legacy_cuda_lowering(),
                         platform="cuda")
  try:
    hlo, thunks = _compile(tmp_path, "legacy", 256)
  finally:
    triton_backend._install_ffi_lowering.cache_clear()  # pylint: disable=protected-access
    triton_backend._install_ffi_lowering()  # pylint: disable=protected-access
  assert hlo.count('custom_call_target="triton_kernel_call"') == 3
  assert thunks.count("kCustomCall") == 3, thunks
