"""GPU checks of the decode-attention kernels against their float32 references.

Run on the device machine with `pytest -m gpu`. Every kernel runs on fresh
seeded random inputs with ragged lengths (1, full, non-multiples of every tile),
its split-K partial buffers pre-filled with NaN (so an unwritten element fails),
twice (results must be bitwise identical), against the plain-jnp reference.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from closeness import assert_close  # noqa: E402  (tests/kernels, on sys.path)
from kvlowrank_kernels.dense import decode_attention, kernel_fit  # noqa: E402
from kvlowrank_kernels.dense import shapes as dshapes  # noqa: E402
from kvlowrank_kernels.common import triton_backend  # noqa: E402
from kvlowrank_kernels.dense.reference import decode_attention_reference  # noqa: E402
from kvlowrank_kernels.kivi import shapes as kshapes  # noqa: E402
from kvlowrank_kernels.kivi.reference import kivi_attention_reference  # noqa: E402
from kvlowrank_kernels.palu import shapes as lshapes  # noqa: E402
from kvlowrank_kernels.palu.reference import (  # noqa: E402
    palu_attention_reference, rope_inv_freq)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_backend.available(), reason="needs a GPU with jax-triton"),
]

F32 = jnp.float32


def assert_partials_written(partials, what):
  o, lse = (np.asarray(x) for x in partials)
  assert not np.isnan(o).any(), f"{what}: unwritten partial outputs"
  assert not np.isnan(lse).any(), f"{what}: unwritten partial lse"


def assert_deterministic(run, what):
  a, b = run(), run()
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True), f"{what}: not bitwise"


# ----------------------------------------------------------------------------- dense

@pytest.mark.parametrize("idx", range(len(dshapes.TEST_SHAPES)))
@pytest.mark.parametrize("opts", [dict(block_s=16), dict(block_s=64, num_splits=3),
                                  dict(block_s=128, num_splits=1, num_warps=8)])
def test_dense_triton(idx, opts):
  from kvlowrank_kernels.dense.triton_decode import decode_attention_triton
  shape = dshapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(100 + idx)
  q, k, v, lens = dshapes.make_inputs(shape, jax.random.key(100 + idx),
                                      lengths=dshapes.ragged_lengths(shape.batch,
                                                                     shape.capacity, rng))
  run = lambda: decode_attention_triton(q, k, v, lens, out_dtype=F32, poison=True,
                                        return_partials=True, **opts)
  out, lse, partials = run()
  assert_partials_written(partials, "dense")
  ref, ref_lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  assert_close(out, ref, 1e-2, 1e-2, "dense out")
  assert_close(lse, ref_lse, 1e-3, 1e-3, "dense lse")
  assert_deterministic(run, "dense")


@pytest.mark.parametrize("idx", range(len(dshapes.TEST_SHAPES)))
@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_dense_library_paths(idx, impl):
  shape = dshapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(200 + idx)
  q, k, v, lens = dshapes.make_inputs(shape, jax.random.key(200 + idx),
                                      lengths=dshapes.ragged_lengths(shape.batch,
                                                                     shape.capacity, rng))
  if impl == "cudnn" and (why := kernel_fit(q, k, v, lens, "cudnn")) is not None:
    assert shape.v_head_dim != shape.head_dim, why   # the only test shape cuDNN refuses
    with pytest.raises(ValueError, match="v head dim"):
      decode_attention(q, k, v, lens, implementation="cudnn")
    return
  out, lse = decode_attention(q, k, v, lens, implementation=impl, out_dtype=F32)
  ref, ref_lse = decode_attention_reference(q, k, v, lens, out_dtype=F32)
  assert_close(out, ref, 1e-2, 1e-2, f"{impl} out")
  assert_close(lse, ref_lse, 1e-2, 1e-2, f"{impl} lse")


@pytest.mark.parametrize("idx", range(len(dshapes.TEST_SHAPES)))
def test_dense_default_follows_kernel_fit(idx):
  """implementation=None runs the Triton kernel on bf16 inputs (bitwise its result) and the
  fp32 reference on fp32 inputs (kernel_fit refuses them: TF32 MMAs)."""
  from kvlowrank_kernels.dense.triton_decode import decode_attention_triton
  shape = dshapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(400 + idx)
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, rng)
  q, k, v, lens = dshapes.make_inputs(shape, jax.random.key(400 + idx), lengths=lens)
  assert kernel_fit(q, k, v, lens) is None
  out, lse = decode_attention(q, k, v, lens, out_dtype=F32)
  want, want_lse = decode_attention_triton(q, k, v, lens, out_dtype=F32)
  assert np.array_equal(np.asarray(out), np.asarray(want))
  assert np.array_equal(np.asarray(lse), np.asarray(want_lse))
  q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
  assert kernel_fit(q32, k32, v32, lens) is not None
  out, _ = decode_attention(q32, k32, v32, lens, out_dtype=F32)
  ref, _ = decode_attention_reference(q32, k32, v32, lens, out_dtype=F32)
  assert np.array_equal(np.asarray(out), np.asarray(ref))


# ----------------------------------------------------------------------------- Palu

def _palu_case(idx, seed):
  shape = lshapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(seed)
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, rng)
  return shape, lshapes.make_inputs(shape, jax.random.key(seed), lengths=lens)


@pytest.mark.parametrize("idx", range(len(lshapes.TEST_SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(block_s=16, num_splits=5),
                                  dict(block_s=64, num_splits=1, num_stages=1),
                                  dict(block_s=32, num_warps=4, num_stages=2)])
def test_palu_triton(idx, opts):
  from kvlowrank_kernels.palu.triton_palu_launch import palu_attention_triton
  shape, (q, hk, hv, b_k, k_bias, lens) = _palu_case(idx, 300 + idx)
  if opts.get("block_s", 32) < 32 and (shape.k_bits != 16 or shape.v_bits != 16):
    with pytest.raises(ValueError, match="block_s"):
      palu_attention_triton(q, hk, hv, b_k, lens, rope_inv_freq(shape.head_dim), **opts)
    return
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  variants = [dict(opts)]
  if shape.n_heads == shape.n_kv_heads:  # also check the reconstruction path on MHA
    variants.append(dict(opts, absorb=False))
  variants += [dict(v, trans=True) for v in variants if v.get("block_s", 128) <= 32]
  if shape.kv_per_group > 1:  # one KV head per program (group latent read per head)
    variants.append(dict(opts, heads_per_program=1))
  ref, ref_lse = palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias, out_dtype=F32)
  for o in variants:
    run = lambda o=o: palu_attention_triton(q, hk, hv, b_k, lens, inv, k_bias=k_bias,
                                            out_dtype=F32, poison=True, return_partials=True,
                                            **o)
    out, lse, partials = run()
    assert_partials_written(partials, f"latent {o}")
    assert_close(out, ref, 2e-2, 2e-2, f"latent out {o}")
    assert_close(lse, ref_lse, 2e-2, 2e-3, f"latent lse {o}")
    assert_deterministic(run, f"latent {o}")


@pytest.mark.parametrize("idx", [i for i, s in enumerate(lshapes.TEST_SHAPES)
                                 if s.k_bits == s.v_bits == 16])
@pytest.mark.parametrize("opts", [dict(), dict(block_s=32, num_warps=4, num_stages=2)])
def test_palu_triton_fp16_latents(idx, opts):
  """fp16 latents run in fp16: close to the float32 reference on the same fp16 latents and
  at least twice as close as the same latents rounded to bf16 (the negative control: what
  the kernel computed before it kept fp16)."""
  from kvlowrank_kernels.palu.triton_palu_launch import palu_attention_triton
  shape, (q, hk, hv, b_k, k_bias, lens) = _palu_case(idx, 320 + idx)
  hk, hv = hk.astype(jnp.float16), hv.astype(jnp.float16)
  # Inputs with more mantissa than bf16 keeps (the test data are bf16 values otherwise).
  hk = hk + (hk * 2.0 ** -9).astype(jnp.float16)
  hv = hv + (hv * 2.0 ** -9).astype(jnp.float16)
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  ref, ref_lse = palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias, out_dtype=F32)
  run = lambda hk=hk, hv=hv: palu_attention_triton(  # noqa: E731
      q, hk, hv, b_k, lens, inv, k_bias=k_bias, out_dtype=F32, poison=True,
      return_partials=True, **opts)
  out, lse, partials = run()
  assert_partials_written(partials, f"latent fp16 {opts}")
  err = assert_close(out, ref, 2e-2, 2e-2, f"latent fp16 out {opts}")
  assert_close(lse, ref_lse, 2e-2, 2e-3, f"latent fp16 lse {opts}")
  assert_deterministic(run, f"latent fp16 {opts}")
  rounded = run(hk.astype(jnp.bfloat16), hv.astype(jnp.bfloat16))[0]
  err_bf16 = float(np.abs(np.asarray(rounded, np.float64) - np.asarray(ref, np.float64)).max())
  assert err < 0.5 * err_bf16, (err, err_bf16)


def test_palu_triton_constant_latent_slices():
  """Constant (token, group) slices quantize to scale 0 and code 0 (the one quantizer's rule);
  the kernel's folded dequantization must still give the zero point there."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.palu.packed import quantize_latent
  from kvlowrank_kernels.palu.triton_palu_launch import palu_attention_triton
  shape = lshapes.TEST_SHAPES[4]  # 2-bit keys, 4-bit values
  raw = dataclasses.replace(shape, k_bits=16, v_bits=16)
  lens = dshapes.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(390))
  q, hk, hv, b_k, _, lens = lshapes.make_inputs(raw, jax.random.key(390), lengths=lens)
  hk = quantize_latent(hk.at[:, 3::7].set(0.75), shape.k_bits)
  hv = quantize_latent(hv.at[:, 5::9].set(-0.5), shape.v_bits)
  assert not np.asarray(hk.scale[:, 3::7]).any() and not np.asarray(hv.scale[:, 5::9]).any()
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  ref, ref_lse = palu_attention_reference(q, hk, hv, b_k, lens, out_dtype=F32)
  out, lse, partials = palu_attention_triton(q, hk, hv, b_k, lens, inv, out_dtype=F32,
                                             poison=True, return_partials=True)
  assert_partials_written(partials, "palu constant slices")
  assert_close(out, ref, 2e-2, 2e-2, "palu constant slices out")
  assert_close(lse, ref_lse, 2e-2, 2e-3, "palu constant slices lse")


def test_palu_triton_negative_control():
  """A corrupted key latent at a valid slot must break agreement with the clean reference."""
  from kvlowrank_kernels.palu.triton_palu_launch import palu_attention_triton
  shape, (q, hk, hv, b_k, k_bias, lens) = _palu_case(0, 399)
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  ref, _ = palu_attention_reference(q, hk, hv, b_k, lens, k_bias=k_bias, out_dtype=F32)
  # Batch row 1 attends its full capacity (row 0 has length 1, where any score gives p = 1).
  bad_hk = hk.at[1, 0].set(hk[1, 0] * 40.0)
  out, _ = palu_attention_triton(q, bad_hk, hv, b_k, lens, inv, k_bias=k_bias, out_dtype=F32)
  with pytest.raises(AssertionError):
    assert_close(out, ref, 2e-2, 2e-2, "corrupted latent")


# ----------------------------------------------------------------------------- KIVI

def _kivi_case(idx, seed):
  shape = kshapes.TEST_SHAPES[idx]
  rng = np.random.default_rng(seed)
  q_len = dshapes.ragged_lengths(shape.batch, shape.capacity, rng)
  w_len = np.asarray([shape.window, 1, 0][:shape.batch], np.int32)
  return kshapes.make_inputs(shape, jax.random.key(seed), q_len=q_len, w_len=w_len)


@pytest.mark.parametrize("idx", range(len(kshapes.TEST_SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(num_splits=5, block_w=16),
                                  dict(block_s=64, num_splits=1, num_stages=4),
                                  dict(block_s=16, min_rows=16, num_warps=4),
                                  dict(fast=False)])
def test_kivi_triton(idx, opts):
  """Inline-PTX (default) and plain (fast=False) dequantization, every tiling path."""
  from kvlowrank_kernels.kivi.triton_kivi import kivi_attention_triton
  args = _kivi_case(idx, 500 + idx)
  run = lambda: kivi_attention_triton(*args, out_dtype=F32, poison=True, return_partials=True,
                                      **opts)
  out, lse, partials = run()
  assert_partials_written(partials, "kivi")
  ref, ref_lse = kivi_attention_reference(*args, out_dtype=F32)
  assert_close(out, ref, 5e-3, 5e-3, f"kivi out {opts}")
  assert_close(lse, ref_lse, 2e-3, 1e-3, f"kivi lse {opts}")
  assert_deterministic(run, "kivi")


def test_kivi_triton_negative_control():
  """Dropping the window, or one corrupted key-group scale, must break agreement."""
  from kvlowrank_kernels.kivi.planar import KiviKeys
  from kvlowrank_kernels.kivi.triton_kivi import kivi_attention_triton
  shape = kshapes.TEST_SHAPES[0]
  args = kshapes.make_inputs(shape, jax.random.key(599))
  ref, _ = kivi_attention_reference(*args, out_dtype=F32)
  no_window = args[:6] + (jnp.zeros_like(args[6]),)
  out, _ = kivi_attention_triton(*no_window, out_dtype=F32)
  with pytest.raises(AssertionError):
    assert_close(out, ref, 5e-3, 5e-3, "kivi without window")
  q, keys, *rest = args
  bad = KiviKeys(codes=keys.codes, scale=keys.scale.at[1, :, 2].multiply(8.0), zero=keys.zero,
                 bits=keys.bits, group=keys.group)
  out, _ = kivi_attention_triton(q, bad, *rest, out_dtype=F32)
  with pytest.raises(AssertionError):
    assert_close(out, ref, 5e-3, 5e-3, "kivi corrupted key scale")
