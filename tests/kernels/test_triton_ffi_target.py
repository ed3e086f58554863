"""`triton_backend.retarget_to_ffi`: the custom call jax-triton 0.3.1 emits (legacy
`triton_kernel_call`, api_version 2, the compressed kernel proto as its backend_config string)
becomes a call of jaxlib's typed-FFI handler `triton_kernel_call_ffi` (the same bytes under
`opaque` in `mhlo.backend_config`, as `mlir.custom_call` writes a dictionary config), which XLA
may record in its CUDA graphs. A stand-in primitive lowered the way jax-triton lowers stands
in for a kernel (CPU: lowering only, nothing runs); the GPU
test that the launches land in XLA's command buffers is `test_triton_ffi_target_gpu.py`."""

import zlib

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from kvlowrank_kernels.common import triton_backend

PROTO = zlib.compress(b"\x00kernel proto \xff\x10 bytes")  # not valid UTF-8, as the real one


def _primitive(retarget: bool):
  prim = Primitive(f"fake_triton_call_{retarget}")
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

  def lowering(ctx, x):
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=PROTO,
                                operand_output_aliases={0: 0})
    results = rule(ctx, x)
    return triton_backend.retarget_to_ffi(results) if retarget else results

  mlir.register_lowering(prim, lowering)
  return prim


def _stablehlo(retarget: bool) -> str:
  prim = _primitive(retarget)
  return jax.jit(lambda x: prim.bind(x * 2.0) + 1.0).lower(jnp.ones((4,))).as_text()


def _custom_call_line(text: str) -> str:
  (line,) = [l for l in text.splitlines() if "custom_call" in l]
  return line


def test_retargeted_call():
  line = _custom_call_line(_stablehlo(True))
  assert "@triton_kernel_call_ffi(" in line
  assert "api_version" not in line  # 1, the default, which MLIR does not print
  assert 'backend_config = ""' in line and "mhlo.backend_config = {opaque = " in line
  assert "output_operand_aliases" in line  # the aliasing survives
  # the opaque bytes are the proto, byte for byte (MLIR prints non-ASCII bytes as \XX)
  printed = "".join(chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\{b:02X}"
                    for b in PROTO)
  assert f'opaque = "{printed}"' in line


def test_same_form_as_a_dictionary_config():
  """The retargeted op prints as `mlir.custom_call` builds a dictionary-config call."""
  prim = Primitive("fake_dict_call")
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

  def lowering(ctx, x):
    from jax._src.interpreters.mlir import custom_call  # pylint: disable=import-outside-toplevel
    from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
    result = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
    return custom_call("triton_kernel_call_ffi", result_types=[result], operands=[x],
                       backend_config={"opaque": ir.StringAttr.get(PROTO)},
                       operand_layouts=[[0]], result_layouts=[[0]],
                       operand_output_aliases={0: 0}).results

  mlir.register_lowering(prim, lowering)
  built = _custom_call_line(jax.jit(lambda x: prim.bind(x * 2.0) + 1.0).lower(
      jnp.ones((4,))).as_text())
  assert built.split("custom_call")[1] == _custom_call_line(_stablehlo(True)).split(
      "custom_call")[1]


def test_negative_control_legacy_call():
  line = _custom_call_line(_stablehlo(False))
  assert "@triton_kernel_call(" in line and "triton_kernel_call_ffi" not in line
  assert "api_version = 2" in line
  assert "backend_config = \"" in line


def test_rejects_a_dict_config():
  prim = Primitive("fake_ffi_call")
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

  def lowering(ctx, x):
    return triton_backend.retarget_to_ffi(jax.ffi.ffi_lowering("x", api_version=4)(ctx, x))

  mlir.register_lowering(prim, lowering)
  with pytest.raises(TypeError, match="expected a legacy call"):
    jax.jit(prim.bind).lower(jnp.ones((4,)))


def test_no_handler_without_a_gpu_plugin():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU jaxlib may register the handler")
  assert not triton_backend.ffi_handler_registered()
