"""CPU checks of the Palu latent-attention reference, PackedLatent (packing + quantizer),
`triton_fit` and the XLA path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank.model.rope import apply_rope
from kvlowrank.spec import ModelSpec
from kvlowrank_kernels.dense import shapes as dshapes
from kvlowrank_kernels.palu import palu_attention, shapes, triton_fit
from kvlowrank_kernels.palu.packed import (PackedLatent, dequantize_latent, latent_f32,
                                           quantize_latent)
from kvlowrank_kernels.quant import packing
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


def _layout_bytes(c, bits):
  """The bytes the Triton kernel reads for one unpadded row of codes c (pure Python): code
  w * ppb + k at bits k * bits of byte w; 3-bit: the low-2-bit plane (R / 4 bytes), then the
  high-bit plane (R / 8 bytes)."""
  def plane(v, b):
    ppb = 8 // b
    return [sum(int(v[ppb * w + k]) << (b * k) for k in range(ppb)) for w in range(len(v) // ppb)]
  if bits == 3:
    return plane([x & 3 for x in c], 2) + plane([x >> 2 for x in c], 1)
  return plane(c, bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [96, 48, 37])
def test_packed_latent_round_trip(bits, dim):
  """Codes + scale/zero -> PackedLatent (`quant.packing` rows of any dim, zero-padded) ->
  dequantize_latent == code * scale + zero (float64 numpy); unpadded 2/3/4-bit rows hold the
  layout the Triton kernel reads; one corrupted byte changes 1..ppb values (negative control)."""
  rng = np.random.default_rng(10 * bits + dim)
  codes = rng.integers(0, 1 << bits, size=(2, 3, 2, dim))
  scale = rng.uniform(0.01, 1.0, size=(2, 3, 2)).astype(np.float32)
  zero = rng.standard_normal((2, 3, 2)).astype(np.float32)
  p = PackedLatent(codes=packing.pack(jnp.asarray(codes), bits), scale=jnp.asarray(scale),
                   zero=jnp.asarray(zero), bits=bits, dim=dim)
  assert p.shape == (2, 3, 2, dim) and p.codes.dtype == jnp.uint8
  assert p.codes.shape[-1] == packing.packed_bytes(dim, bits) >= dim * bits // 8
  assert p.nbytes() == p.codes.size + 2 * 4 * scale.size
  want = codes * scale[..., None].astype(np.float64) + zero[..., None]
  got = np.asarray(dequantize_latent(p), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  padded = packing.padded_length(dim, bits)
  tail = packing.unpack(p.codes, bits, padded)[..., dim:]
  assert not np.asarray(tail).any(), "padding codes must be zero"
  if bits != 8 and dim % packing.row_block(bits) == 0:
    np.testing.assert_array_equal(np.asarray(p.codes[1, 2, 1]),
                                  _layout_bytes(list(codes[1, 2, 1]), bits))
  bad = p.codes.at[0, 1, 1, 2].set(p.codes[0, 1, 1, 2] ^ jnp.uint8(0xFF))
  changed = np.asarray(dequantize_latent(dataclasses.replace(p, codes=bad))) != got
  assert 1 <= changed[0, 1, 1].sum() <= 8 and changed.sum() == changed[0, 1, 1].sum()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [64, 48])
def test_quantize_latent_error_is_half_a_step(bits, dim):
  x = jax.random.normal(jax.random.key(bits), (2, 7, 3, dim), F32)
  x = x.at[1, 2, 0].set(1.5)  # a constant slice: scale 0, reconstructed exactly
  p = quantize_latent(x, bits, scale_dtype=F32)
  assert p.codes.shape == (2, 7, 3, packing.packed_bytes(dim, bits))
  assert p.scale.shape == (2, 7, 3) and p.scale.dtype == F32
  x64 = np.asarray(x, np.float64)
  step = (x64.max(-1) - x64.min(-1)) / (2 ** bits - 1)
  np.testing.assert_allclose(np.asarray(p.scale), step, rtol=1e-6)
  err = np.abs(np.asarray(dequantize_latent(p), np.float64) - x64)
  assert np.all(err <= step[..., None] * 0.5 * (1 + 1e-5) + 1e-6), err.max()
  assert float(p.scale[1, 2, 0]) == 0.0 and np.all(err[1, 2, 0] == 0.0)
  assert quantize_latent(x.astype(jnp.bfloat16), bits).scale.dtype == jnp.bfloat16
  # Negative control: zeroed codes of one slice break the bound there.
  bad = dataclasses.replace(p, codes=p.codes.at[0, 3, 1].set(0))
  err_bad = np.abs(np.asarray(dequantize_latent(bad), np.float64) - x64)
  assert not np.all(err_bad[0, 3, 1] <= step[0, 3, 1] * 0.5 * (1 + 1e-5) + 1e-6)


def test_packed_latent_errors_name_the_field():
  p = quantize_latent(jnp.ones((1, 2, 1, 48), F32), 3)
  with pytest.raises(ValueError, match="PackedLatent.bits"):
    PackedLatent(codes=p.codes, scale=p.scale, zero=p.zero, bits=5, dim=48)
  with pytest.raises(ValueError, match="PackedLatent.codes"):
    PackedLatent(codes=p.codes[..., :18], scale=p.scale, zero=p.zero, bits=3, dim=48)
  with pytest.raises(ValueError, match="PackedLatent.scale"):
    PackedLatent(codes=p.codes, scale=p.scale[:, :1], zero=p.zero, bits=3, dim=48)
  with pytest.raises(ValueError, match="latent must be"):
    quantize_latent(jnp.ones((2, 48), F32), 3)
  with pytest.raises(ValueError, match="bits"):
    quantize_latent(jnp.ones((1, 2, 1, 48), F32), 1)


def test_triton_fit():
  """The Triton kernel takes every test shape (bf16/fp16, packed 2/3/4-bit, bias) and refuses
  padded packed rows, 8-bit codes and head dims it cannot tile, each with one line."""
  for idx in range(len(shapes.TEST_SHAPES)):
    _, (q, hk, hv, b_k, k_bias, lens) = case(idx)
    assert triton_fit(q, hk, hv, b_k, lens, k_bias) is None, idx
    assert triton_fit(q, latent_f32(hk).astype(jnp.float16), hv, b_k, lens, k_bias) is None
  _, (q, hk, hv, b_k, k_bias, lens) = case(1)  # rk 64, rv 48
  hv96 = jnp.concatenate([hv, hv], -1)
  assert triton_fit(q, hk, quantize_latent(hv96, 3), b_k, lens) is None
  for bad_hv, why in ((quantize_latent(hv, 3), "multiple of 32 at 3 bits"),
                      (quantize_latent(hv96, 8), "2, 3 or 4 bits"),
                      (quantize_latent(hv96[..., :80], 2), "power-of-two pieces")):
    msg = triton_fit(q, hk, bad_hv, b_k, lens)
    assert msg is not None and why in msg and "\n" not in msg, (why, msg)
  q48 = jnp.zeros(q.shape[:2] + (48,), q.dtype)
  b_k48 = jnp.zeros(b_k.shape[:2] + (4 * 48,), b_k.dtype)
  assert "power of 2" in triton_fit(q48, hk, hv, b_k48, lens)
  assert "lengths" in triton_fit(q, hk, hv, b_k, lens[:1])


def test_shape_errors_name_the_argument():
  _, (q, hk, hv, b_k, k_bias, lens) = case(0)
  with pytest.raises(ValueError, match="k_bias"):
    palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias[:, :4])
  with pytest.raises(ValueError, match="b_k"):
    palu_attention_reference(q, hk, hv, b_k[:, :8], lens)
