"""`triton_backend.launch(..., max_registers=n)`: the register cap reaches Triton's options
(`maxnreg`) through the wrapper around jax-triton's kernel builder, only for launches that
carry the constexpr MAXNREG > 0. A fake jax-triton stands in for the real one (CPU); the GPU
check that the cap reaches the compiled PTX is in `tests/test_gear_kernel_gpu.py`."""

import sys
import types

import pytest

from kvlowrank_kernels.common import triton_backend


class _Backend:
  def __init__(self, device, compute_capability):
    self.target = (device, compute_capability)

  def parse_options(self, opts):
    return dict(opts)


@pytest.fixture(name="fake_triton_lib")
def _fake_triton_lib(monkeypatch):
  calls = []

  def get_or_create(backend_init_func, platform, fn, *, metaparams, **kwargs):
    calls.append((platform, fn, kwargs))
    return backend_init_func(0, 90).parse_options({"num_warps": 2}), metaparams

  lib = types.SimpleNamespace(get_or_create_triton_kernel=get_or_create)
  monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_lib=lib))
  monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", lib)
  triton_backend._install_register_cap.cache_clear()  # pylint: disable=protected-access
  triton_backend._install_register_cap()  # pylint: disable=protected-access
  yield lib, calls
  triton_backend._install_register_cap.cache_clear()  # pylint: disable=protected-access


def test_cap_reaches_the_options(fake_triton_lib):
  lib, calls = fake_triton_lib
  opts, meta = lib.get_or_create_triton_kernel(_Backend, "CUDA", "fn", num_warps=2,
                                               metaparams={"MAXNREG": 200, "H": 128})
  assert opts == {"num_warps": 2, "maxnreg": 200}
  assert meta == {"MAXNREG": 200, "H": 128}
  assert calls == [("CUDA", "fn", {"num_warps": 2})]


@pytest.mark.parametrize("meta", [{"MAXNREG": 0}, {"H": 128}])
def test_no_cap_leaves_the_options(fake_triton_lib, meta):
  lib, _ = fake_triton_lib
  opts, _ = lib.get_or_create_triton_kernel(_Backend, "CUDA", "fn", metaparams=meta)
  assert opts == {"num_warps": 2}  # negative control: no maxnreg without a cap


def test_bad_cap_is_one_line():
  with pytest.raises(ValueError, match="max_registers must be 0 or in"):
    triton_backend.launch(None, out_shapes=[], grid=(1,), num_warps=2, num_stages=1,
                          max_registers=300)
