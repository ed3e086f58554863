"""CPU checks of the Palu latent-attention reference, bit packing, quantizer and XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank.model.rope import apply_rope
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels.dense import shapes as dshapes
from kvlowrank_kernels.palu import bitpack, palu_attention, shapes
from kvlowrank_kernels.palu.packed import (dequantize_latent, latent_f32,
                                                        quantize_latent)
from kvlowrank_kernels.palu.reference import palu_attention_reference

F32 = jnp.float32


@jax.jit
def ref_fn(q, hk, hv, b_k, k_bias, lens):
  return palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias, out_dtype=F32)


@jax.jit
def xla_fn(q, hk, hv, b_k, k_bias, lens):
  return palu_attention(q, hk, hv, b_k, lens, k_bias=k_bias, implementation="xla",
                          out_dtype=F32)


def oracle(q, hk, hv, b_k, k_bias, lens, shape, pos_shift=0):
  return _oracle(q, hk, hv, b_k, k_bias, lens, shape, pos_shift)


@jax.jit(static_argnums=(6, 7))
def _oracle(q, hk, hv, b_k, k_bias, lens, shape, pos_shift):
  """Materialize keys (latent @ B_k + bias, kvlowrank RoPE) and per-head value latents,
  then run kvlowrank's dense model attention."""
  keys = jnp.einsum("bsgr,grc->bsgc", latent_f32(hk), b_k.astype(F32),
                    precision=jax.lax.Precision.HIGHEST)
  if k_bias is not None:
    keys = keys + k_bias
  b, s = keys.shape[:2]
  keys = keys.reshape(b, s, shape.n_kv_heads, shape.head_dim)
  spec = ModelSpec(vocab_size=2, dim=shape.n_heads * shape.head_dim, n_layers=1,
                   n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
                   head_dim=shape.head_dim, ffn_dim=2, rope_theta=10000.0)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  keys = apply_rope(keys, pos + pos_shift, spec)
  vals = latent_f32(hv)[:, :, np.arange(shape.n_kv_heads) // shape.kv_per_group]
  out, lse = dot_product_attention(q[:, None].astype(F32), keys, vals, (lens - 1)[:, None], pos,
                                   pos < lens[:, None], out_dtype=F32)
  return out[:, 0], lse[:, 0]


def case(idx):
  shape = shapes.TEST_SHAPES[idx]
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(idx))
  return shape, shapes.make_inputs(shape, jax.random.key(idx), lengths=lens)


@pytest.mark.parametrize("idx", range(len(shapes.TEST_SHAPES)))
def test_reference_matches_materialized_dense_attention(idx):
  shape, (q, hk, hv, b_k, k_bias, lens) = case(idx)
  out, lse = ref_fn(q, hk, hv, b_k, k_bias, lens)
  ref, ref_lse = oracle(q, hk, hv, b_k, k_bias, lens, shape)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-4)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_negative_control_rope_positions_off_by_one():
  shape, (q, hk, hv, b_k, k_bias, lens) = case(0)
  out, _ = ref_fn(q, hk, hv, b_k, k_bias, lens)
  shifted, _ = oracle(q, hk, hv, b_k, k_bias, lens, shape, pos_shift=1)
  assert not np.allclose(out, shifted, atol=1e-3)


@pytest.mark.parametrize("idx", [0, 2])
def test_xla_path_matches_reference(idx):
  _, (q, hk, hv, b_k, k_bias, lens) = case(idx)
  out, lse = xla_fn(q, hk, hv, b_k, k_bias, lens)
  ref, ref_lse = ref_fn(q, hk, hv, b_k, k_bias, lens)
  np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, ref_lse, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("bits", bitpack.SUPPORTED_BITS)
def test_bitpack_round_trip_and_layout(bits):
  rng = np.random.default_rng(bits)
  codes = jnp.asarray(rng.integers(0, 1 << bits, size=(3, 5, 32)), jnp.int32)
  packed = bitpack.pack_codes(codes, bits)
  assert packed.shape == (3, 5, 32 * bits // 8) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(bitpack.unpack_codes(packed, bits, 32), codes)
  # Layout spot check, computed independently: channel c = w * ppb + k at bits k * bits of
  # byte w (3-bit: low-2-bit plane then high-bit plane).
  c = np.asarray(codes[0, 0])
  if bits == 3:
    lo = [sum(int(c[4 * w + k] & 3) << (2 * k) for k in range(4)) for w in range(8)]
    hi = [sum(int(c[8 * w + k] >> 2) << k for k in range(8)) for w in range(4)]
    expect = lo + hi
  else:
    ppb = 8 // bits
    expect = [sum(int(c[ppb * w + k]) << (bits * k) for k in range(ppb)) for w in range(32 // ppb)]
  np.testing.assert_array_equal(np.asarray(packed[0, 0]), expect)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_latent_error_is_half_a_step(bits):
  x = jax.random.normal(jax.random.key(bits), (2, 7, 3, 48), F32)
  p = quantize_latent(x, bits, scale_dtype=F32)
  err = jnp.abs(dequantize_latent(p) - x)
  assert bool(jnp.all(err <= p.scale[..., None] * 0.5 + 1e-5))
  # Negative control: a wrong bit width must not decode to the same latent.
  wrong = bitpack.unpack_codes(bitpack.pack_codes(bitpack.unpack_codes(p.codes, bits, 48),
                                                  bits), bits, 48)
  assert bool(jnp.all(wrong == bitpack.unpack_codes(p.codes, bits, 48)))
  with pytest.raises(ValueError, match="bytes"):
    bitpack.unpack_codes(p.codes, bits + 1 if bits < 4 else 2, 48)


def test_shape_errors_name_the_argument():
  _, (q, hk, hv, b_k, k_bias, lens) = case(0)
  with pytest.raises(ValueError, match="k_bias"):
    palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias[:, :4])
  with pytest.raises(ValueError, match="b_k"):
    palu_attention_reference(q, hk, hv, b_k[:, :8], lens)
