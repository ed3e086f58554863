"""Quantizer, bit-packing and Hadamard tests against float64 numpy / pure-Python references."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels import quant
from kvlowrank.methods.palu import hadamard

NP_SD = {"float16": np.float16, "float32": np.float32}


def ref_quantize(x, bits, axis, group, sd):
  """float64 numpy version of the module-doc formula → (x_hat, scale per element, tie mask)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  xg = x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))
  mn, mx = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
  qmax = 2 ** bits - 1
  s = ((mx - mn) / qmax).astype(NP_SD[sd]).astype(np.float64)
  z = mn.astype(NP_SD[sd]).astype(np.float64)
  u = (xg - z) / np.where(s > 0, s, 1.0)
  code = np.where(s > 0, np.clip(np.round(u), 0, qmax), 0)
  # Elements whose fractional part is within 1e-3 of 0.5 may round differently in fp32.
  tie = (np.abs(u - np.floor(u) - 0.5) < 1e-3) & (s > 0)
  back = lambda a: np.moveaxis(np.broadcast_to(a, xg.shape).reshape(x.shape), -1, axis)
  # fp32 dequantization (code * s + z) rounds relative to the magnitude of its terms.
  mag = np.abs(z) + code * s
  return back(code * s + z), back(s), back(tie), back(mag)


def assert_close_to_ref(ours, ref, step, tie, mag, atol=1e-6):
  diff = np.abs(np.asarray(ours, np.float64) - ref)
  strict = diff <= atol + 4e-7 * mag
  assert np.all(strict | tie), f"max diff off-tie {diff[~tie].max()}"
  assert np.all(diff[tie] <= step[tie] + atol)


CASES = [  # (shape, axis, group)
    ((3, 64, 48), -1, 16),        # per-token groups of 16 channels
    ((2, 64, 3, 40), 1, 32),      # keys [B,T,K,H]: per-channel over groups of 32 tokens
    ((5, 37), -1, None),          # whole axis, length not a multiple of any block
    ((4, 24, 6), 0, 2),
]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,axis,group", CASES)
def test_matches_float64_reference_and_bound(bits, shape, axis, group):
  rng = np.random.default_rng(bits * 100 + len(shape))
  x = rng.standard_normal(shape).astype(np.float32) * 3.0
  x[..., 0] += 40.0  # an outlier channel, like KIVI's key channels
  for sd in ("float32", "float16"):
    qt = quant.quantize(jnp.asarray(x), bits=bits, axis=axis, group_size=group, scale_dtype=sd)
    xh = np.asarray(quant.dequantize(qt), np.float64)
    ref, step, tie, mag = ref_quantize(x, bits, axis, group or x.shape[axis], sd)
    assert_close_to_ref(xh, ref, step, tie, mag)
    assert tie.mean() < 0.05  # the tie excuse covers few elements (expected ~0.2%)
    if sd == "float32":
      # Analytic bound: half a quantization step per element.
      err = np.abs(xh - x.astype(np.float64))
      assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-5), err.max()
  # fake_quant is the same computation without packing.
  fq = quant.fake_quant(jnp.asarray(x), bits=bits, axis=axis, group_size=group)
  np.testing.assert_array_equal(np.asarray(fq), np.asarray(quant.dequantize(
      quant.quantize(jnp.asarray(x), bits=bits, axis=axis, group_size=group))))


def test_negative_control_bound_fails_on_corrupted_codes():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((4, 64)).astype(np.float32)
  qt = quant.quantize(jnp.asarray(x), bits=4, axis=-1, group_size=32, scale_dtype="float32")
  ref, step, tie, mag = ref_quantize(x, 4, -1, 32, "float32")
  bad = qt.codes.at[1, 2].set(qt.codes[1, 2] ^ jnp.uint8(0x10))  # flip one bit of code 5
  xh = np.asarray(quant.dequantize(dataclasses.replace(qt, codes=bad)), np.float64)
  assert_close_to_ref(np.asarray(quant.dequantize(qt), np.float64), ref, step, tie, mag)
  with pytest.raises(AssertionError):
    assert_close_to_ref(xh, ref, step, tie, mag)


def test_zero_range_guard_and_jit():
  x = jnp.concatenate([jnp.full((2, 8), 1.2345), jnp.arange(16.0).reshape(2, 8)], axis=1)
  qt = jax.jit(lambda a: quant.quantize(a, bits=2, axis=-1, group_size=8))(x)
  xh = quant.dequantize(qt)
  assert np.all(np.isfinite(np.asarray(xh)))
  assert np.asarray(qt.scale)[:, 0].tolist() == [0.0, 0.0]
  np.testing.assert_array_equal(np.asarray(xh[:, :8]), np.float32(np.float16(1.2345)))
  eager = quant.quantize(x, bits=2, axis=-1, group_size=8)
  for a, b in zip(jax.tree.leaves(qt), jax.tree.leaves(eager)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def bitstream_words(codes, bits, block):
  """Pure-Python reference of an LSB-first stream of `bits`-bit codes, padded to `block`."""
  codes = list(codes) + [0] * (-len(codes) % block)
  value = sum(int(c) << (i * bits) for i, c in enumerate(codes))
  n_words = len(codes) * bits // 32
  return [(value >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)]


def planar_bytes(codes, bits, cw):
  """Pure-Python reference of the documented byte-planar rule (bits 1/2/4/8): byte
  s*cw + w holds code s*ppb*cw + k*cw + w at bits [k*bits, (k+1)*bits)."""
  ppb = 8 // bits
  out = [0] * (len(codes) * bits // 8)
  for c, v in enumerate(codes):
    s, r = divmod(c, ppb * cw)
    k, w = divmod(r, cw)
    out[s * cw + w] |= int(v) << (k * bits)
  return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_layout_sizes_and_round_trip(bits):
  """As uint32 words, 2/4/8-bit rows are one LSB-first stream (KIVI's layout) and 3-bit
  rows a 2-bit stream of the low bits then a 1-bit stream of the high bits; rows are
  padded to whole words (32 codes for 3 bits)."""
  rng = np.random.default_rng(bits)
  per_word = {2: 16, 3: 32, 4: 8, 8: 4}
  for n in (5, 32, 33, 130):
    codes = rng.integers(0, 2 ** bits, size=(3, n))
    words = np.asarray(quant.packing.pack_words(jnp.asarray(codes), bits))
    padded = math.ceil(n / per_word[bits]) * per_word[bits]
    assert words.shape == (3, padded * bits // 32)
    assert words.dtype == np.uint32
    for row in range(3):
      if bits == 3:
        want = (bitstream_words(codes[row] & 3, 2, 32) + bitstream_words(codes[row] >> 2, 1, 32))
      else:
        want = bitstream_words(codes[row], bits, per_word[bits])
      assert words[row].tolist() == want
    np.testing.assert_array_equal(
        np.asarray(quant.packing.unpack_words(jnp.asarray(words), bits, n)), codes)
    packed = np.asarray(quant.pack(jnp.asarray(codes), bits))
    assert packed.dtype == np.uint8 and packed.shape == (3, padded * bits // 8)
    np.testing.assert_array_equal(np.asarray(quant.unpack(jnp.asarray(packed), bits, n)), codes)


@pytest.mark.parametrize("bits,cw", [(1, 8), (2, 1), (2, 32), (4, 16), (8, 4)])
def test_planar_plane_width(bits, cw):
  """Plane width cw: `(byte >> k*bits) & mask` of a [.., cw] byte tile is one contiguous
  chunk of cw codes; the layout equals the per-byte formula and round-trips."""
  from kvlowrank_kernels.quant import packing  # pylint: disable=import-outside-toplevel
  n = 2 * packing.row_block(bits, cw)
  codes = np.random.default_rng(cw).integers(0, 2 ** bits, size=(2, n))
  packed = np.asarray(packing.pack(jnp.asarray(codes), bits, cw))
  for row in range(2):
    assert packed[row].tolist() == planar_bytes(codes[row], bits, cw)
  np.testing.assert_array_equal(np.asarray(packing.unpack(jnp.asarray(packed), bits, n, cw)),
                                codes)
  # the plane of slot k of segment 0 is codes [k*cw, (k+1)*cw)
  plane = (packed[:, :cw] >> bits) & ((1 << bits) - 1)
  if 8 // bits > 1:
    np.testing.assert_array_equal(plane, codes[:, cw:2 * cw])
  # negative control: cw=1 packing of the same codes is a different byte order (8-bit
  # codes are one per byte, where the plane width changes nothing)
  if cw > 1 and bits < 8:
    assert not np.array_equal(np.asarray(packing.pack(jnp.asarray(codes), bits, 1)), packed)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_qtensor_nbytes_exact(bits):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64, 4, 128)), jnp.float32)
  qt = quant.quantize(x, bits=bits, axis=1, group_size=32)
  n_codes = 2 * 64 * 4 * 128
  assert qt.codes.size * 8 == n_codes * bits  # dense: exactly `bits` bits per code
  scales = 2 * 2 * 4 * 128
  assert qt.nbytes() == n_codes * bits // 8 + 2 * scales * 2  # fp16 scale + zero
  assert qt.nbytes() == quant.quantized_nbytes(x.shape, bits=bits, axis=1, group_size=32)
  assert qt.scale.shape == (2, 2, 4, 128) and qt.scale.dtype == jnp.float16
  qt32 = quant.quantize(x, bits=bits, axis=-1, group_size=64, scale_dtype=jnp.float32)
  assert qt32.nbytes() == n_codes * bits // 8 + 2 * (n_codes // 64) * 4


def test_errors_name_the_field():
  x = jnp.ones((4, 6))
  with pytest.raises(ValueError, match="bits"):
    quant.quantize(x, bits=5, axis=-1)
  with pytest.raises(ValueError, match="bits"):
    quant.quantize(x, bits=True, axis=-1)
  with pytest.raises(ValueError, match="group_size"):
    quant.quantize(x, bits=2, axis=-1, group_size=4)
  with pytest.raises(ValueError, match="group_size"):
    quant.quantize(x, bits=2, axis=-1, group_size=0)
  with pytest.raises(ValueError, match="axis"):
    quant.quantize(x, bits=2, axis=2)
  with pytest.raises(ValueError, match="scale_dtype"):
    quant.quantize(x, bits=2, axis=-1, scale_dtype=jnp.int8)
  with pytest.raises(ValueError, match="floating"):
    quant.quantize(jnp.ones((4, 6), jnp.int32), bits=2, axis=-1)
  with pytest.raises(ValueError, match="bytes"):
    quant.unpack(jnp.zeros((2,), jnp.uint8), 3, 32)


HAD_SIZES = [1, 2, 4, 12, 20, 24, 28, 36, 64, 96, 160, 224, 416]


@pytest.mark.parametrize("n", HAD_SIZES)
def test_hadamard_orthonormal_and_transform(n):
  h = np.asarray(hadamard.hadamard_matrix(n), np.float64)
  np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
  np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-6)
  x = np.random.default_rng(n).standard_normal((3, n, 5)).astype(np.float32)
  y = np.asarray(hadamard.hadamard_transform(jnp.asarray(x), axis=1), np.float64)
  np.testing.assert_allclose(y, np.einsum("anb,nm->amb", x.astype(np.float64), h), atol=1e-5)
  back = hadamard.hadamard_transform(jnp.asarray(y, jnp.float32), axis=1, inverse=True)
  np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)
  if n > 2:  # the rotation mixes every channel: not the identity
    assert np.abs(y - x).max() > 0.1


def test_hadamard_sylvester_formula_and_paley_negative_control():
  n = 32
  i = np.arange(n)
  parity = np.array([[bin(a & b).count("1") % 2 for b in i] for a in i])
  h = np.asarray(hadamard.hadamard_matrix(n), np.float64) * np.sqrt(n)
  np.testing.assert_allclose(h, (-1.0) ** parity, atol=1e-6)
  # Paley I matrices are not symmetric: x @ H and x @ H^T differ, so the
  # transform-equals-matrix-product check above can detect a transposed factor.
  h = np.asarray(hadamard.hadamard_matrix(12), np.float64)
  x = np.random.default_rng(0).standard_normal((4, 12))
  assert np.abs(x @ h - x @ h.T).max() > 0.1
  assert hadamard.hadamard_factors(96) == (8, 12)
  assert hadamard.hadamard_factors(224) == (8, 28)


@pytest.mark.parametrize("n", [0, 3, 6, 10, 52])
def test_hadamard_unsupported_sizes(n):
  with pytest.raises(ValueError, match="Hadamard size"):
    hadamard.hadamard_matrix(n)
