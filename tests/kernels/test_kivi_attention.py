"""CPU checks of the KIVI decode-attention reference, quantizers and XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank_kernels.decode_attention import shapes as dshapes
from kvlowrank_kernels.kivi_attention import kivi_attention, shapes
from kvlowrank_kernels.kivi_attention.packing import (dequantize_keys, dequantize_values,
                                                      quantize_keys, quantize_values)
from kvlowrank_kernels.kivi_attention.reference import kivi_attention_reference

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


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
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
