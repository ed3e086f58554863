"""CPU checks of the dense decode-attention reference, XLA path, dispatcher and split-K combine."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank_kernels.common import splitk
from kvlowrank_kernels.common import triton_backend
from kvlowrank_kernels.dense import decode_attention, kernel_fit, resolve_implementation
from kvlowrank_kernels.dense import shapes
from kvlowrank_kernels.dense.reference import decode_attention_reference

F32 = jnp.float32


def dense_oracle(q, k, v, lengths):
  """kvlowrank's model attention over the slot cache: decode token at position len - 1."""
  b, s = k.shape[:2]
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  out, lse = dot_product_attention(q[:, None].astype(F32), k.astype(F32), v.astype(F32),
                                   (lengths - 1)[:, None], k_pos, k_pos < lengths[:, None],
                                   out_dtype=F32)
  return out[:, 0], lse[:, 0]


def case(idx, dtype=F32):
  shape = shapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(idx)
  lens = shapes.ragged_lengths(shape.batch, shape.capacity, rng)
  return shapes.make_inputs(shape, jax.random.key(idx), dtype=dtype, lengths=lens)


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
def test_reference_matches_model_attention(idx):
  q, k, v, lens = case(idx)
  assert int(lens.min()) == 1  # ragged lengths include 1
  out, lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  ref, ref_lse = dense_oracle(q, k, v, lens)
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
def test_xla_path_matches_reference(idx):
  q, k, v, lens = case(idx, jnp.bfloat16)
  out, lse = decode_attention(q, k, v, lens, implementation="xla", out_dtype=F32)
  ref, ref_lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  np.testing.assert_allclose(out, ref, atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_negative_control_wrong_gqa_mapping():
  """Interleaving KV heads (n % K instead of n // (N/K)) must be caught."""
  q, k, v, lens = case(1)  # 8 query heads on 2 KV heads
  ref, _ = dense_oracle(q, k, v, lens)
  kk = k.shape[2]
  perm = np.arange(q.shape[1]).reshape(q.shape[1] // kk, kk).T.reshape(-1)
  wrong, _ = decode_attention_reference(q[:, perm], k, v, lens, out_dtype=F32)
  assert not np.allclose(np.asarray(wrong)[:, np.argsort(perm)], ref, atol=1e-3)


def test_zero_length_gives_zero_and_neg_inf():
  q, k, v, _ = case(0)
  lens = jnp.asarray([0, 5, 0], jnp.int32)
  out, lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  assert np.all(np.asarray(out)[[0, 2]] == 0) and np.all(np.isneginf(np.asarray(lse)[[0, 2]]))
  assert np.all(np.isfinite(np.asarray(lse)[1]))


def test_split_combine_equals_full_attention():
  """Chunked partials merged by `combine_partials` equal attention over all keys."""
  q, k, v, lens = case(0)
  s = k.shape[1]
  bounds = [0, 40, 41, 170, s]
  outs, lses = [], []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    chunk_len = jnp.clip(lens - lo, 0, hi - lo)
    o, l = decode_attention_reference(q, k[:, lo:hi], v[:, lo:hi], chunk_len, out_dtype=F32)
    outs.append(o)
    lses.append(l)
  out, lse = splitk.combine_partials(jnp.stack(outs, -2), jnp.stack(lses, -1))
  ref, ref_lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-6, rtol=2e-6)


def test_choose_num_splits():
  assert splitk.choose_num_splits(1024, 65536, 64) == 1
  assert splitk.choose_num_splits(32, 4096, 64) == 16
  assert splitk.choose_num_splits(8, 100, 64) == 1
  assert splitk.choose_num_splits(8, 100000, 64, requested=7) == 7
  with pytest.raises(ValueError, match="num_splits"):
    splitk.choose_num_splits(8, 1000, 64, requested=0)


def test_wave_balanced_splits():
  """One program per SM: the split count minimises waves x (tiles per chunk + overhead), and
  is never worse than the old programs-target rule on that cost (brute force check)."""
  def cost(par, tiles, n, slots=132):
    return -(-par * n // slots) * (-(-tiles // n) + 2)
  assert splitk.wave_balanced_splits(32, 16384, 64, 132) == 4   # 128 CTAs: one wave
  assert splitk.wave_balanced_splits(128, 16384, 64, 132) == 1
  assert splitk.wave_balanced_splits(4, 16384, 64, 132) == 32   # 128 CTAs of 8 tiles
  assert splitk.wave_balanced_splits(8, 100, 64, 132) == 1      # fewer tiles than min_tiles
  for par in (1, 4, 16, 32, 96, 128, 256, 512):
    for cap in (4096, 16384, 65536):
      tiles = cap // 64
      n = splitk.wave_balanced_splits(par, cap, 64, 132)
      assert cost(par, tiles, n) == min(cost(par, tiles, m) for m in range(1, tiles // 4 + 1))
      old = splitk.choose_num_splits(par, cap, 64, target=264)
      assert cost(par, tiles, n) <= cost(par, tiles, old)
  # negative control: the old rule's 288 programs (three waves) cost more than 128 (one)
  assert cost(32, 256, splitk.choose_num_splits(32, 16384, 64, target=264)) > cost(32, 256, 4)


def test_dispatcher_falls_back_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only behaviour")
  assert resolve_implementation() == "reference"
  q, k, v, lens = case(2)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out, _ = decode_attention(q, k, v, lens, implementation="triton", out_dtype=F32)
  assert any("unavailable" in str(x.message) for x in w)
  ref, _ = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  np.testing.assert_array_equal(out, ref)
  with pytest.raises(ValueError, match="implementation"):
    decode_attention(q, k, v, lens, implementation="cuda")


def test_shape_errors_name_the_argument():
  q, k, v, lens = case(0)
  with pytest.raises(ValueError, match="lengths"):
    decode_attention_reference(q, k, v, lens[:2])
  with pytest.raises(ValueError, match="v shape"):
    decode_attention_reference(q, k, v[:, :5], lens)


def _spec(b=2, s=64, n=8, kh=2, h=64, hv=None, dtype=jnp.bfloat16, v_dtype=None):
  """Abstract (q, k, v, lengths): kernel_fit reads shapes and dtypes only."""
  sds = jax.ShapeDtypeStruct
  return (sds((b, n, h), dtype), sds((b, s, kh, h), dtype),
          sds((b, s, kh, h if hv is None else hv), v_dtype or dtype), sds((b,), jnp.int32))


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
def test_kernel_fit_takes_the_test_shapes(idx):
  """bf16 and fp16 caches of every test shape fit the Triton kernel; cuDNN takes them
  unless V's head dim differs from K's (shape 2); fp32 K/V fit neither."""
  q, k, v, lens = case(idx, jnp.bfloat16)
  shape = shapes.TEST_SHAPES[idx]
  assert kernel_fit(q, k, v, lens) is None
  assert kernel_fit(q, k.astype(jnp.float16), v.astype(jnp.float16), lens) is None
  cudnn = kernel_fit(q, k, v, lens, "cudnn")
  if shape.v_head_dim == shape.head_dim:
    assert cudnn is None
  else:
    assert "v head dim" in cudnn
  for impl in ("triton", "cudnn"):   # negative control: fp32 K/V
    assert "k is float32" in kernel_fit(q, k.astype(F32), v.astype(F32), lens, impl)


@pytest.mark.parametrize("kw,triton_why,cudnn_why", [
    (dict(h=128), None, None),
    (dict(h=256), None, "<= 128"),
    (dict(h=48), "head dim must be a power of 2", None),      # 48 = 6 x 8: cuDNN takes it
    (dict(h=8), "head dim must be a power of 2 >= 16", None),
    (dict(h=60), "head dim must be a power of 2", "multiple of 8"),
    (dict(h=64, hv=32), None, "v head dim == k head dim"),
    (dict(h=64, hv=24), "value head dim", "v head dim == k head dim"),
    (dict(h=64, dtype=jnp.float16), None, None),
    (dict(h=64, v_dtype=jnp.float32), "v is float32", "v is float32"),
    (dict(h=64, v_dtype=jnp.float16), None, "v dtype == k dtype"),
    (dict(h=64, dtype=jnp.float32), "k is float32", "k is float32"),
    (dict(b=1, s=1 << 21, kh=8, h=128), "int32 indexing", None),
    (dict(b=1, s=(1 << 21) - 1, kh=8, h=128), None, None),
])
def test_kernel_fit_reasons(kw, triton_why, cudnn_why):
  """Each refusal is one line naming the field; the boundary cases (int32 indexing, powers of
  two, cuDNN's head-dim bound) fall on the right side."""
  args = _spec(**kw)
  for impl, why in (("triton", triton_why), ("cudnn", cudnn_why)):
    got = kernel_fit(*args, implementation=impl)
    if why is None:
      assert got is None, (impl, got)
    else:
      assert got is not None and why in got and "\n" not in got, (impl, got)


def test_kernel_fit_shape_errors_and_bad_implementation():
  q, k, v, lens = _spec()
  assert "lengths" in kernel_fit(q, k, v, jax.ShapeDtypeStruct((3,), jnp.int32))
  assert "v shape" in kernel_fit(q, k, jax.ShapeDtypeStruct((2, 63, 2, 64), jnp.bfloat16), lens)
  with pytest.raises(ValueError, match="implementation"):
    kernel_fit(q, k, v, lens, "xla")


def test_kernel_fit_agrees_with_the_triton_plan():
  """kernel_fit's Triton verdict is the kernel's own: `triton_decode.plan` raises exactly
  when kernel_fit refuses the shapes (bf16 K/V)."""
  pytest.importorskip("triton")
  from kvlowrank_kernels.dense import triton_decode  # pylint: disable=import-outside-toplevel
  for h in (8, 16, 24, 32, 64, 96, 128, 256):
    for hv in (16, 48, h):
      q, k, v, lens = _spec(h=h, hv=hv)
      why = kernel_fit(q, k, v, lens)
      try:
        triton_decode.plan(q.shape, k.shape, v.shape)
      except ValueError as e:
        assert why == str(e), (h, hv)
      else:
        assert why is None, (h, hv, why)


def test_dispatcher_default_follows_kernel_fit(monkeypatch):
  """With a GPU and jax-triton (simulated), None runs "triton" on inputs that fit it, and
  "reference" on fp32 K/V or head dims it does not take, unless Triton knobs are passed;
  a named implementation is never overridden."""
  monkeypatch.setattr(triton_backend, "available", lambda: True)
  monkeypatch.setattr(triton_backend, "gpu_available", lambda: True)
  fit, fp32, odd = _spec(), _spec(dtype=F32), _spec(h=48)
  assert resolve_implementation(None, args=fit) == "triton"
  assert resolve_implementation(None, args=fp32) == "reference"
  assert resolve_implementation(None, args=odd) == "reference"
  assert resolve_implementation(None, args=fp32, options={"block_s": 16}) == "triton"
  assert resolve_implementation(None) == "triton"
  assert resolve_implementation("triton", args=fp32) == "triton"
  assert resolve_implementation("cudnn", args=odd) == "cudnn"
