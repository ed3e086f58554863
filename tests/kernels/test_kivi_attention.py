"""CPU checks of the KIVI decode-attention reference, planar packing, quantizers, the XLA
path, the dispatcher (planar and KiviMosaic caches) and the kernels' fit checks."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.model.attention import dot_product_attention
from kvlowrank_kernels.dense import shapes as dshapes
from kvlowrank_kernels.kivi import (kivi_attention, mosaic_fit, mosaic_layout, planar,
                                    resolve_implementation, shapes, triton_fit, triton_plan)
from kvlowrank_kernels.kivi.planar import (KiviKeys, KiviValues, dequantize_keys,
                                           dequantize_values, quantize_keys, quantize_values)
from kvlowrank_kernels.kivi.reference import kivi_attention_reference
from kvlowrank_kernels.quant import packing

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


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantizers_group_structure_and_error(bits):
  x = jax.random.normal(jax.random.key(bits), (2, 64, 3, 32), F32)
  kq = quantize_keys(x, bits, 16, scale_dtype=F32)
  assert kq.scale.shape == (2, 3, 4, 32)  # per channel, one pair per 16 tokens
  assert kq.codes.shape == (2, 3, 64, 32 * bits // 8) and kq.head_dim == 32
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


def test_constant_groups_store_scale_zero():
  """The one quantizer stores scale 0 and codes 0 for a constant group: it dequantizes to its
  zero point (the group's value)."""
  x = jax.random.normal(jax.random.key(7), (1, 64, 2, 32), F32)
  x = x.at[:, :16, 1, 5].set(2.5)           # key group 0 of head 1, channel 5: constant
  x = x.at[:, 40, 0, 8:16].set(-1.25)       # value group 1 of token 40, head 0: constant
  kq, vq = quantize_keys(x, 2, 16, scale_dtype=F32), quantize_values(x, 2, 8, scale_dtype=F32)
  assert float(kq.scale[0, 1, 0, 5]) == 0.0 and float(vq.scale[0, 0, 40, 1]) == 0.0
  assert np.all(np.asarray(planar.key_codes(kq))[0, 1, :16, 5] == 0)
  np.testing.assert_array_equal(dequantize_keys(kq, 32)[0, :16, 1, 5], 2.5)
  np.testing.assert_array_equal(dequantize_values(vq, 32)[0, 40, 0, 8:16], -1.25)
  assert float(kq.scale[0, 1, 0, 4]) > 0.0  # negative control: a random group's scale


def _planar_rule(codes, bits, cw):
  """numpy transcription of the planar rule (module docstring): byte s CW + w holds, at bits
  [k b, (k + 1) b), the code of channel s ppb CW + k CW + w."""
  ppb = 8 // bits
  n = codes.shape[-1]
  out = np.zeros(codes.shape[:-1] + (n * bits // 8,), np.int64)
  for c in range(n):
    s, r = divmod(c, ppb * cw)
    k, w = divmod(r, cw)
    out[..., s * cw + w] |= codes[..., c].astype(np.int64) << (k * bits)
  return out


def test_planar_layout_bytes_by_hand():
  """Docstring example (bits 2, H 16, CW 2): byte 2 s + w holds channels 8 s + w, + 2, + 4,
  + 6; 4 bits; 3 bits = the 2-bit row of the low bits, then the 1-bit row of the high bits."""
  codes = jnp.asarray([0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2, 3, 3, 0, 0], jnp.int32)
  assert np.asarray(packing.pack(codes, 2, 2)).tolist() == [
      0 | 2 << 2 | 3 << 4 | 1 << 6, 1 | 3 << 2 | 2 << 4 | 0 << 6,
      1 | 2 << 2 | 3 << 4 | 0 << 6, 1 | 2 << 2 | 3 << 4 | 0 << 6]
  # 4 bits, H 8, CW 2: two segments of 4 channels; byte s * 2 + w = c[4s + w] | c[4s + 2 + w] << 4.
  codes4 = jnp.asarray([1, 2, 3, 4, 5, 6, 7, 8], jnp.int32)
  assert np.asarray(packing.pack(codes4, 4, 2)).tolist() == [1 | 3 << 4, 2 | 4 << 4,
                                                             5 | 7 << 4, 6 | 8 << 4]
  # 3 bits, H 32, CW 4 (what planar picks): 8 bytes of low 2-bit planes, 4 of high bits.
  rng = np.random.default_rng(1)
  c3 = rng.integers(0, 8, (3, 32))
  assert planar.plane_width(32, 3) == 4
  got = np.asarray(packing.pack(jnp.asarray(c3), 3, 4))
  np.testing.assert_array_equal(got, np.concatenate([_planar_rule(c3 & 3, 2, 4),
                                                     _planar_rule(c3 >> 2, 1, 4)], -1))
  # Plane k of a segment's bytes is one contiguous channel chunk (what the kernel relies on).
  c = rng.integers(0, 4, (5, 128))
  b = np.asarray(packing.pack(jnp.asarray(c), 2, 32))
  for k in range(4):
    np.testing.assert_array_equal((b >> (2 * k)) & 3, c[:, 32 * k:32 * (k + 1)])


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_packing_module_is_the_planar_layout(bits):
  """The one packing module writes the planar bytes the Triton kernel reads, at every plane
  width (the rule transcribed in numpy); a row with the wrong plane width does not."""
  c = np.random.default_rng(bits).integers(0, 1 << bits, (4, 256))
  for cw in (1, 2, 4, 8, 16, 32):
    np.testing.assert_array_equal(packing.pack(jnp.asarray(c), bits, cw),
                                  _planar_rule(c, bits, cw), err_msg=f"cw={cw}")
  assert not np.array_equal(packing.pack(jnp.asarray(c), bits, 8), _planar_rule(c, bits, 16))


@pytest.mark.parametrize("bits,h,group", [(2, 128, None), (3, 64, None), (4, 128, None),
                                          (8, 64, None), (2, 128, 32), (2, 64, 16),
                                          (4, 32, 8), (3, 128, 32), (8, 32, 8)])
def test_planar_round_trip(bits, h, group):
  cw = planar.plane_width(h, bits, group)
  assert h % (cw * 8 // (1 if bits == 3 else bits)) == 0
  assert group is None or group % cw == 0
  c = np.random.default_rng(bits * h).integers(0, 1 << bits, (3, 7, 32, h))
  rows = packing.pack(jnp.asarray(c), bits, cw)
  assert rows.shape == (3, 7, 32, h * bits // 8) and rows.dtype == jnp.uint8
  gv = group or h
  kq = KiviKeys(codes=rows, scale=jnp.zeros((3, 7, 1, h)), zero=None, bits=bits, group=32)
  vq = KiviValues(codes=planar.block_tokens(rows), scale=jnp.zeros((3, 7, 32, h // gv)),
                  zero=None, bits=bits, group=gv)
  assert kq.head_dim == vq.head_dim == h
  np.testing.assert_array_equal(planar.key_codes(kq) if group is None else
                                planar.value_codes(vq), c)
  bad = dataclasses.replace(kq, codes=rows.at[0, 0, 0, 0].add(1))  # one flipped code
  assert not np.array_equal(planar.key_codes(bad), c)


def test_value_token_blocks():
  """Value rows are stored in transposed blocks of VALUE_BLOCK tokens (token-major K dim)."""
  vb = planar.VALUE_BLOCK
  rows = jnp.arange(2 * vb * 3, dtype=jnp.int32).reshape(2 * vb, 3)  # token t, byte r
  blocked = planar.block_tokens(rows)
  mem = np.asarray(blocked).reshape(2, 3, vb)  # [block, byte, token in block]
  assert mem[1, 2, 5] == rows[vb + 5, 2]
  np.testing.assert_array_equal(planar.unblock_tokens(blocked), rows)
  x = jax.random.normal(jax.random.key(3), (1, 2 * vb, 1, 64), F32)
  vq = quantize_values(x, 2, 32)
  np.testing.assert_array_equal(  # quantize_values stores blocked planar rows
      planar.block_tokens(packing.pack(planar.value_codes(vq), 2, vq.plane_width)), vq.codes)


def test_public_fields_and_clear_errors():
  x = jax.random.normal(jax.random.key(4), (1, 64, 2, 128), jnp.bfloat16)
  kq, vq = quantize_keys(x, 2, 32), quantize_values(x, 2, 32)
  assert isinstance(kq, KiviKeys) and isinstance(vq, KiviValues)
  assert (kq.codes.shape, kq.scale.shape, kq.scale.dtype) == ((1, 2, 64, 32), (1, 2, 2, 128),
                                                              jnp.bfloat16)
  assert (vq.codes.shape, vq.zero.shape, vq.bits, vq.group) == ((1, 2, 64, 32), (1, 2, 64, 4),
                                                                2, 32)
  assert (kq.plane_width, vq.plane_width, kq.head_dim) == (32, 32, 128)
  k3 = quantize_keys(x, 3, 32)
  assert (k3.codes.shape, k3.head_dim, k3.plane_width) == ((1, 2, 64, 48), 128, 16)
  with pytest.raises(ValueError, match="bits must be one of"):
    quantize_keys(x, 5, 32)
  with pytest.raises(ValueError, match="bits must be one of"):
    quantize_values(x, 1, 32)
  with pytest.raises(ValueError, match="not a multiple of 4"):
    quantize_keys(x[..., :6], 2, 32)
  # A small head dim: the packing module pads the rows (16 codes at 2 bits), H from the scales.
  k8 = quantize_keys(x[..., :8], 2, 32, F32)
  assert (k8.codes.shape[-1], k8.head_dim) == (4, 8)
  np.testing.assert_allclose(dequantize_keys(k8, 8), x[..., :8].astype(F32),
                             atol=float(jnp.max(k8.scale)))
  with pytest.raises(ValueError, match="keys.codes rows have 8 bytes, expected 4"):
    dequantize_keys(dataclasses.replace(k8, codes=jnp.pad(k8.codes, ((0, 0),) * 3 + ((0, 4),))),
                    8)
  with pytest.raises(ValueError, match="value capacity"):
    quantize_values(x[:, :48], 2, 16)
  with pytest.raises(ValueError, match="value group"):
    quantize_values(x, 2, 48)
  with pytest.raises(ValueError, match="keys.scale holds 128 channels, expected head_dim=64"):
    dequantize_keys(kq, 64)


def test_triton_plan_constraints():
  """The Triton planner (`triton_plan`, no Triton needed) refuses shapes the kernel cannot do."""
  plan = triton_plan.plan
  x = jax.random.normal(jax.random.key(5), (1, 64, 1, 64), jnp.bfloat16)
  kq, vq = quantize_keys(x, 4, 32), quantize_values(x, 2, 8)  # value planes of 8 channels
  with pytest.raises(ValueError, match="values.plane_width"):
    plan((1, 4, 64), kq, vq, 16)
  for bits in (3, 8):  # the planar layout holds them, the kernel reads 2 and 4 bits
    with pytest.raises(ValueError, match=f"keys.bits must be 2 or 4, got {bits}"):
      plan((1, 4, 64), quantize_keys(x, bits, 32), quantize_values(x, 2, 16), 16)
    with pytest.raises(ValueError, match=f"values.bits must be 2 or 4, got {bits}"):
      plan((1, 4, 64), kq, quantize_values(x, bits, 16), 16)
  with pytest.raises(ValueError, match="block_s"):
    plan((1, 4, 64), kq, quantize_values(x, 2, 16), 16, block_s=24)
  v16 = quantize_values(x, 2, 16)
  short = KiviValues(codes=v16.codes[:, :, :48], scale=v16.scale[:, :, :48],
                     zero=v16.zero[:, :, :48], bits=2, group=16)
  with pytest.raises(ValueError, match="values.codes capacity"):
    plan((1, 4, 64), quantize_keys(x[:, :48], 4, 16), short, 16)
  p = plan((1, 4, 64), kq, v16, 16, block_s=64, num_splits=1)
  assert p["grid"] == (1, 2) and p["constexprs"]["QP"] == 4 and p["constexprs"]["VCW"] == 16
  assert "SKIP" not in p["constexprs"]


def _mosaic_case(seed=0, scale_dtype=jnp.float16, batch=2, capacity=256):
  """A warp-layout-sized problem (2-bit, groups of 32, H = 128), planar and KiviMosaic."""
  shape = shapes.KiviShape(batch=batch, capacity=capacity, window=16, n_heads=8,
                           n_kv_heads=2, scale_dtype=jnp.dtype(scale_dtype).name)
  q_len = np.asarray([capacity - 37, capacity][:batch], np.int32)
  args = shapes.make_inputs(shape, jax.random.key(seed), q_len=q_len)
  return args, mosaic_layout.to_mosaic(args[1], args[2])


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_dispatcher_reads_a_kivi_mosaic_cache(impl):
  """reference/xla on a KiviMosaic cache give the planar cache's result bit for bit (the
  relayout is lossless); a corrupted cache scale must change it (negative control)."""
  (q, kq, vq, kw, vw, ql, wl), cache = _mosaic_case()
  run = jax.jit(lambda k, v: kivi_attention(q, k, v, kw, vw, ql, wl, implementation=impl,
                                            out_dtype=F32))
  want, want_lse = run(kq, vq)
  got, got_lse = run(cache, None)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_lse, want_lse)
  ref, _ = ref_fn(q, kq, vq, kw, vw, ql, wl)
  np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
  bad = dataclasses.replace(cache, ks=cache.ks.at[1, 0, 0].multiply(9.0))
  assert not np.allclose(run(bad, None)[0], want, atol=1e-3)


def test_dispatcher_refuses_bad_cache_arguments():
  (q, kq, vq, kw, vw, ql, wl), cache = _mosaic_case(1)
  with pytest.raises(ValueError, match="'triton' cannot read a KiviMosaic"):
    kivi_attention(q, cache, None, kw, vw, ql, wl, implementation="triton")
  with pytest.raises(ValueError, match="values must be None"):
    kivi_attention(q, cache, vq, kw, vw, ql, wl, implementation="reference")
  with pytest.raises(ValueError, match="must be KiviKeys and KiviValues"):
    kivi_attention(q, kq, None, kw, vw, ql, wl, implementation="reference")
  with pytest.raises(ValueError, match="implementation must be"):
    kivi_attention(q, kq, vq, kw, vw, ql, wl, implementation="wgmma")
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['kernel'\]"):  # gone
    kivi_attention(q, kq, vq, kw, vw, ql, wl, implementation="mosaic", kernel="warp")
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['skip'\]"):  # gone
    kivi_attention(q, kq, vq, kw, vw, ql, wl, implementation="triton", skip=1)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \['block_s'\]"):
    kivi_attention(q, cache, None, kw, vw, ql, wl, implementation="mosaic", block_s=32)
  with pytest.raises(ValueError, match="missing w_len"):
    kivi_attention(q, cache, k_win=kw, v_win=vw, q_len=ql, implementation="reference")
  # Keyword form with values omitted (a cache that holds both), as the library calls it.
  out, _ = kivi_attention(q, keys=cache, k_win=kw, v_win=vw, q_len=ql, w_len=wl,
                          implementation="reference", out_dtype=F32)
  want, _ = kivi_attention(q, kq, vq, kw, vw, ql, wl, implementation="reference",
                           out_dtype=F32)
  np.testing.assert_array_equal(out, want)


def test_default_implementation_for_each_cache():
  """None: "mosaic" for a KiviMosaic cache on a Hopper GPU, "triton" for planar inputs on a
  GPU with jax-triton, else "reference" (this CPU); a named kernel falls back with a warning."""
  assert resolve_implementation(None, mosaic_cache=True) == "reference"
  assert resolve_implementation(None) == "reference"
  (q, _, _, kw, vw, ql, wl), cache = _mosaic_case(2)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, _ = kivi_attention(q, cache, None, kw, vw, ql, wl, implementation="mosaic",
                            out_dtype=F32)
  assert any("running 'reference'" in str(w.message) for w in caught)
  want, _ = kivi_attention(q, cache, None, kw, vw, ql, wl, out_dtype=F32)
  np.testing.assert_array_equal(out, want)


def test_mosaic_fit():
  (q, kq, vq, *_), cache = _mosaic_case(3)
  assert mosaic_fit(q.shape, cache) is None
  assert mosaic_fit(q.shape, (kq, vq)) is None
  assert "head dim must be 128" in mosaic_fit((2, 8, 64), cache)
  assert "at most 16 query heads" in mosaic_fit((2, 34, 128), cache)
  assert "cache batch 2 != q batch 3" in mosaic_fit((3, 8, 128), cache)
  x = jax.random.normal(jax.random.key(4), (2, 256, 2, 128), jnp.bfloat16)
  k4 = quantize_keys(x, 4, 32, jnp.float16)
  assert "keys must be 2-bit with groups of 32" in mosaic_fit(q.shape, (k4, vq))
  assert "multiple of 128" in mosaic_fit(q.shape, (quantize_keys(x[:, :224], 2, 32),
                                                   quantize_values(x[:, :224], 2, 32)))
  f32 = dataclasses.replace(cache, ks=cache.ks.astype(F32), vs=cache.vs.astype(F32))
  assert "float16 or bfloat16" in mosaic_fit(q.shape, f32)
  for why in (mosaic_fit((2, 8, 64), cache), mosaic_fit(q.shape, (k4, vq))):
    assert "\n" not in why


def test_triton_fit():
  _, (q, kq, vq, kw, *_) = case(0)
  assert triton_fit(q.shape, kq, vq, kw.shape[1]) is None
  x = jax.random.normal(jax.random.key(6), (3, 320, 4, 64), jnp.bfloat16)
  assert "keys.bits must be 2 or 4, got 3" in triton_fit(q.shape, quantize_keys(x, 3, 32), vq,
                                                         kw.shape[1])
  assert "values.plane_width" in triton_fit(q.shape, kq, quantize_values(x, 2, 8),
                                            kw.shape[1])
  _, cache = _mosaic_case(5)
  assert "KiviMosaic" in triton_fit((2, 8, 128), cache, None, 16)
