"""kvlowrank_kernels.common.rope: the one RoPE frequency function and angle formula, against
float64 formulas written out here (the plain theta^(-2i/H) and the Llama-3 scaling as
published by Meta / Hugging Face), with negative controls."""

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.common.rope import inv_frequencies, rope_angles

LLAMA31 = types.SimpleNamespace(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)


def plain_inv_freq(h, theta):
  """w_i = 1 / theta^(2i / H), i = 0 .. H/2 - 1 (float64)."""
  return np.array([1.0 / theta ** (2 * i / h) for i in range(h // 2)], np.float64)


def llama3_scaled(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
  """Llama-3 RoPE scaling, one frequency at a time, as published (Meta's llama3
  `apply_scaling`; HF `_compute_llama3_parameters` is the vectorised form): wavelengths
  below old_context_len / high_freq_factor keep their frequency, those above
  old_context_len / low_freq_factor divide it by `factor`, the rest interpolate with
  smooth = (old_context_len / wavelen - low) / (high - low)."""
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      out.append(freq)
    elif wavelen > low_freq_wavelen:
      out.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor
                                                                - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out, np.float64)


@pytest.mark.parametrize("h,theta", [(64, 10000.0), (128, 500000.0), (32, 1e6), (2, 10.0)])
def test_plain_frequencies(h, theta):
  got = inv_frequencies(h, theta)
  assert got.dtype == np.float64 and got.shape == (h // 2,)
  np.testing.assert_allclose(got, plain_inv_freq(h, theta), rtol=1e-15, atol=0)
  # Negative control: the other common exponent convention, i / H (no factor 2), differs.
  wrong = np.array([1.0 / theta ** (i / h) for i in range(h // 2)])
  if h > 2:
    assert not np.allclose(got, wrong, rtol=1e-6)


@pytest.mark.parametrize("h,theta,scaling", [
    (128, 500000.0, LLAMA31),                              # Llama-3.1/3.2 (8B, 1B, 3B)
    (64, 500000.0, types.SimpleNamespace(factor=32.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)),
    (128, 10000.0, types.SimpleNamespace(factor=4.0, low_freq_factor=2.0,
                                         high_freq_factor=8.0,
                                         original_max_position_embeddings=2048)),
])
def test_llama3_scaling_matches_published_formula(h, theta, scaling):
  got = inv_frequencies(h, theta, scaling)
  base = plain_inv_freq(h, theta)
  want = llama3_scaled(base, scaling.factor, scaling.low_freq_factor,
                       scaling.high_freq_factor, scaling.original_max_position_embeddings)
  np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
  # All three regimes occur: kept, divided by factor, interpolated.
  kept = np.isclose(got, base, rtol=1e-14)
  divided = np.isclose(got, base / scaling.factor, rtol=1e-14)
  assert kept.any() and divided.any() and (~kept & ~divided).any()
  # Negative controls: swapping the two wavelength factors, or dropping the smoothing
  # (a hard switch at the low-frequency wavelength), changes the frequencies.
  swapped = llama3_scaled(base, scaling.factor, scaling.high_freq_factor,
                          scaling.low_freq_factor, scaling.original_max_position_embeddings)
  assert not np.allclose(got, swapped, rtol=1e-6)
  wavelen = 2 * math.pi / base
  hard = np.where(wavelen > scaling.original_max_position_embeddings / scaling.low_freq_factor,
                  base / scaling.factor, base)
  assert not np.allclose(got, hard, rtol=1e-6)


def test_scaling_accepts_the_model_spec_object():
  """Any object with the four attributes: the library's `RopeScaling` gives what the
  SimpleNamespace gives, and the model's RoPE frequencies equal these."""
  # pylint: disable=import-outside-toplevel
  from kvlowrank.model.rope import inv_frequencies as model_inv
  from kvlowrank.spec import ModelSpec, RopeScaling
  rs = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
  np.testing.assert_array_equal(inv_frequencies(128, 500000.0, rs),
                                inv_frequencies(128, 500000.0, LLAMA31))
  for scaling in (None, rs):
    spec = ModelSpec(vocab_size=8, dim=256, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=128,
                     ffn_dim=8, rope_theta=500000.0, rope_scaling=scaling)
    np.testing.assert_array_equal(model_inv(spec), inv_frequencies(128, 500000.0, scaling))


def test_rope_angles_are_float32_products():
  """fl32(t · fl32(w)) for every position and frequency, any leading shape; negative
  control: the product with the unrounded float64 w differs at large positions."""
  w = inv_frequencies(128, 500000.0, LLAMA31)
  pos = np.array([0, 1, 2, 7, 1000, 8191, 65535, 131071], np.int64)
  got = np.asarray(rope_angles(w, pos))
  assert got.dtype == np.float32 and got.shape == (pos.size, 64)
  want = pos.astype(np.float32)[:, None] * w.astype(np.float32)[None, :]
  np.testing.assert_array_equal(got, want)
  got2 = np.asarray(rope_angles(w, jnp.asarray(pos.reshape(2, 4), jnp.int32)))
  np.testing.assert_array_equal(got2, want.reshape(2, 4, 64))
  from64 = (pos[:, None] * w[None, :]).astype(np.float32)
  assert np.any(from64 != got)


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="head_dim"):
    inv_frequencies(63, 10000.0)
  with pytest.raises(ValueError, match="head_dim"):
    inv_frequencies(0, 10000.0)
  with pytest.raises(ValueError, match="theta"):
    inv_frequencies(64, 0.0)
  with pytest.raises(ValueError, match="original_max_position_embeddings"):
    inv_frequencies(64, 10000.0, types.SimpleNamespace(factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0))
  with pytest.raises(ValueError, match="high_freq_factor"):
    inv_frequencies(64, 10000.0, types.SimpleNamespace(
        factor=8.0, low_freq_factor=2.0, high_freq_factor=2.0,
        original_max_position_embeddings=8192))
