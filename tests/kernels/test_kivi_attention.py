"""CPU checks of the KIVI decode-attention reference, planar packing, quantizers and XLA path."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank_kernels.dense import shapes as dshapes
from kvlowrank_kernels.kivi import kivi_attention, shapes
from kvlowrank_kernels.kivi import planar as packing
from kvlowrank_kernels.kivi.planar import (KiviKeys, KiviValues, dequantize_keys,
                                                      dequantize_values, quantize_keys,
                                                      quantize_values)
from kvlowrank_kernels.kivi.reference import kivi_attention_reference

F32 = jnp.float32


def case(idx):
  shape = shapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(idx)
  q_len = dshapes.ragged_lengths(shape.batch, shape.capacity, rng)
  w_len = np.asarray([shape.window, 1, 0][:shape.batch], np.int32)
  return shape, shapes.make_inputs(shape, jax.random.key(idx), q_len=q_len, w_len=w_len)


ref_fn = jax.jit(lambda *a: kivi_attention_reference(*a, out_dtype=F32))
xla_fn = jax.jit(lambda *a: kivi_attention(*a, implementation="xla", out_dtype=F32))


def oracle(shape, *args, drop_window=False):
  return _oracle(shape, drop_window, *args)


@jax.jit(static_argnums=(0, 1))
def _oracle(shape, drop_window, q, keys, values, k_win, v_win, q_len, w_len):
  """Dense model attention over [dequantized prefix ; window] with a validity mask."""
  h = shape.head_dim
  k = jnp.concatenate([dequantize_keys(keys, h), k_win.astype(F32)], axis=1)
  v = jnp.concatenate([dequantize_values(values, h), v_win.astype(F32)], axis=1)
  s, w = shape.capacity, shape.window
  b = q.shape[0]
  valid = jnp.concatenate([jnp.arange(s)[None] < q_len[:, None],
                           (jnp.arange(w)[None] < w_len[:, None]) & (not drop_window)], axis=1)
  pos = jnp.broadcast_to(jnp.arange(s + w, dtype=jnp.int32), (b, s + w))
  out, lse = dot_product_attention(q[:, None].astype(F32), k, v,
                                   jnp.full((b, 1), s + w, jnp.int32), pos, valid, out_dtype=F32)
  return out[:, 0], lse[:, 0]


@pytest.mark.parametrize("idx", range(3))  # MHA / GQA 4 / GQA 8, 2/4-bit (CPU time budget)
def test_reference_matches_dense_attention_over_segments(idx):
  shape, args = case(idx)
  out, lse = ref_fn(*args)
  ref, ref_lse = oracle(shape, *args)
  np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-6, rtol=2e-6)


def test_negative_control_window_dropped():
  shape, args = case(0)
  out, _ = ref_fn(*args)
  ref, _ = oracle(shape, *args, drop_window=True)
  assert not np.allclose(out, ref, atol=1e-3)


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
def test_xla_path_matches_reference(idx):
  _, args = case(idx)
  out, lse = xla_fn(*args)
  ref, ref_lse = ref_fn(*args)
  np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", [2, 4])
def test_quantizers_group_structure_and_error(bits):
  x = jax.random.normal(jax.random.key(bits), (2, 64, 3, 32), F32)
  kq = quantize_keys(x, bits, 16, scale_dtype=F32)
  assert kq.scale.shape == (2, 3, 4, 32)  # per channel, one pair per 16 tokens
  kerr = jnp.abs(dequantize_keys(kq, 32) - x)
  kstep = jnp.repeat(jnp.transpose(kq.scale, (0, 2, 1, 3)), 16, axis=1)
  assert bool(jnp.all(kerr <= kstep * 0.5 + 1e-5))
  vq = quantize_values(x, bits, 8, scale_dtype=F32)
  assert vq.scale.shape == (2, 3, 64, 4)  # per token, one pair per 8 channels
  verr = jnp.abs(dequantize_values(vq, 32) - x)
  vstep = jnp.repeat(jnp.transpose(vq.scale, (0, 2, 1, 3)), 8, axis=3)
  assert bool(jnp.all(verr <= vstep * 0.5 + 1e-5))
  with pytest.raises(ValueError, match="key group"):
    quantize_keys(x[:, :60], bits, 16)
  # Negative control: a scale one step too small must break the half-step bound.
  bad = KiviKeys(codes=kq.codes, scale=kq.scale * 0.75, zero=kq.zero, bits=bits, group=16)
  assert not bool(jnp.all(jnp.abs(dequantize_keys(bad, 32) - x) <= kstep * 0.5 + 1e-5))


def test_planar_layout_bytes_by_hand():
  """Docstring example: bits 2, H 8, CW 2: byte w holds channels w, 2 + w, 4 + w, 6 + w."""
  codes = jnp.asarray([0, 1, 2, 3, 3, 2, 1, 0], jnp.int32)
  packed = np.asarray(packing.pack_planar(codes, 2, 2))
  assert packed.tolist() == [0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6]
  # 4 bits, H 8, CW 2: two segments of 4 channels; byte s * 2 + w = c[4s + w] | c[4s + 2 + w] << 4.
  codes4 = jnp.asarray([1, 2, 3, 4, 5, 6, 7, 8], jnp.int32)
  packed4 = np.asarray(packing.pack_planar(codes4, 4, 2))
  assert packed4.tolist() == [1 | 3 << 4, 2 | 4 << 4, 5 | 7 << 4, 6 | 8 << 4]
  # Plane k of a segment's bytes is one contiguous channel chunk (what the kernel relies on).
  rng = np.random.default_rng(0)
  c = rng.integers(0, 4, (5, 128))
  b = np.asarray(packing.pack_planar(jnp.asarray(c), 2, 32))
  for k in range(4):
    np.testing.assert_array_equal((b >> (2 * k)) & 3, c[:, 32 * k:32 * (k + 1)])


@pytest.mark.parametrize("bits,h,group", [(1, 64, None), (2, 128, None), (4, 128, None),
                                          (2, 128, 32), (2, 64, 16), (4, 32, 8)])
def test_planar_round_trip(bits, h, group):
  cw = packing.plane_width(h, bits, group)
  assert h % (cw * 8 // bits) == 0 and (group is None or group % cw == 0)
  c = np.random.default_rng(bits * h).integers(0, 1 << bits, (3, 7, h))
  packed = packing.pack_planar(jnp.asarray(c), bits, cw)
  assert packed.shape == (3, 7, h * bits // 8) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(packing.unpack_planar(packed, bits, cw), c)
  bad = packed.at[0, 0, 0].add(1)  # negative control: one flipped code must show
  assert not np.array_equal(packing.unpack_planar(bad, bits, cw), c)


def test_value_token_blocks():
  """Value rows are stored in transposed blocks of VALUE_BLOCK tokens (token-major K dim)."""
  vb = packing.VALUE_BLOCK
  rows = jnp.arange(2 * vb * 3, dtype=jnp.int32).reshape(2 * vb, 3)  # token t, byte r
  blocked = packing.block_tokens(rows)
  mem = np.asarray(blocked).reshape(2, 3, vb)  # [block, byte, token in block]
  assert mem[1, 2, 5] == rows[vb + 5, 2]
  np.testing.assert_array_equal(packing.unblock_tokens(blocked), rows)
  x = jax.random.normal(jax.random.key(3), (1, 2 * vb, 1, 64), F32)
  vq = quantize_values(x, 2, 32)
  cw = vq.plane_width
  np.testing.assert_array_equal(  # quantize_values stores blocked planar rows
      packing.block_tokens(packing.pack_planar(packing.unpack_planar(
          packing.unblock_tokens(vq.codes), 2, cw), 2, cw)), vq.codes)


def test_public_fields_and_clear_errors():
  x = jax.random.normal(jax.random.key(4), (1, 64, 2, 128), jnp.bfloat16)
  kq, vq = quantize_keys(x, 2, 32), quantize_values(x, 2, 32)
  assert isinstance(kq, KiviKeys) and isinstance(vq, KiviValues)
  assert (kq.codes.shape, kq.scale.shape, kq.scale.dtype) == ((1, 2, 64, 32), (1, 2, 2, 128),
                                                              jnp.bfloat16)
  assert (vq.codes.shape, vq.zero.shape, vq.bits, vq.group) == ((1, 2, 64, 32), (1, 2, 64, 4),
                                                                2, 32)
  assert (kq.plane_width, vq.plane_width, kq.head_dim) == (32, 32, 128)
  with pytest.raises(ValueError, match="bits"):
    quantize_keys(x, 3, 32)
  with pytest.raises(ValueError, match="value capacity"):
    quantize_values(x[:, :48], 2, 16)
  with pytest.raises(ValueError, match="value group"):
    quantize_values(x, 2, 48)
  with pytest.raises(ValueError, match="head_dim=64"):
    dequantize_keys(kq, 64)


def test_triton_plan_constraints():
  """The Triton planner (importable without a GPU) refuses shapes the kernel cannot do."""
  pytest.importorskip("triton")
  plan = importlib.import_module("kvlowrank_kernels.kivi.triton_kivi").plan
  x = jax.random.normal(jax.random.key(5), (1, 64, 1, 64), jnp.bfloat16)
  kq, vq = quantize_keys(x, 4, 32), quantize_values(x, 2, 8)  # value planes of 8 channels
  with pytest.raises(ValueError, match="values.plane_width"):
    plan((1, 4, 64), kq, vq, 16)
  with pytest.raises(ValueError, match="keys.bits"):
    plan((1, 4, 64), quantize_keys(x, 1, 32), quantize_values(x, 2, 16), 16)
  with pytest.raises(ValueError, match="block_s"):
    plan((1, 4, 64), kq, quantize_values(x, 2, 16), 16, block_s=24)
  v16 = quantize_values(x, 2, 16)
  short = KiviValues(codes=v16.codes[:, :, :48], scale=v16.scale[:, :, :48],
                     zero=v16.zero[:, :, :48], bits=2, group=16)
  with pytest.raises(ValueError, match="values.codes capacity"):
    plan((1, 4, 64), quantize_keys(x[:, :48], 4, 16), short, 16)
  p = plan((1, 4, 64), kq, v16, 16, block_s=64, num_splits=1)
  assert p["grid"] == (1, 2) and p["constexprs"]["QP"] == 4 and p["constexprs"]["VCW"] == 16
