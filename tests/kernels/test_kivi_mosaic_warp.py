"""KIVI Mosaic GPU kernel with warp-level products (`mosaic_kivi_warp`) and its layout.

CPU (CI): the relayout `mosaic_layout.to_mosaic` is lossless (dequantized equal to the planar
cache, `from_mosaic` its exact inverse), its words are the packing module's 2-bit words and
its maps are permutations; every thread's m16n8k16 A fragments, rebuilt from the words with
the kernel's arithmetic (`mosaic_dequant.code_pairs_numpy`) and the PTX fragment formula
written out here, reproduce the planar cache's keys and values; the layout and `plan` reject
what the kernel cannot take; the kernel lowers for CUDA. GPU (`-m gpu`): seeded inputs with
ragged lengths against the float32 reference, every partial finite, bitwise reruns, the
dispatcher on a KiviMosaic cache and on planar inputs, a negative control.
"""

import dataclasses
import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from closeness import assert_close, assert_splits_bitwise_equal  # noqa: E402  (tests/kernels)
from kivi_cases import PLAN_REJECTS, SHAPES, assert_plan_rejects, case  # noqa: E402
from kvlowrank_kernels.common import triton_backend  # noqa: E402
from kvlowrank_kernels.kivi import kivi_attention  # noqa: E402
from kvlowrank_kernels.kivi import (  # noqa: E402
    mosaic_dequant, mosaic_kivi_warp, mosaic_layout, planar)
from kvlowrank_kernels.kivi.reference import kivi_attention_reference  # noqa: E402
from kvlowrank_kernels.quant import packing  # noqa: E402

F32 = jnp.float32


def _quantized(dtype, seed=0, shape=(2, 256, 3, 128)):
  k = jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16)
  v = jax.random.normal(jax.random.key(seed + 1), shape).astype(jnp.bfloat16)
  return (planar.quantize_keys(k, 2, 32, jnp.dtype(dtype)),
          planar.quantize_values(v, 2, 32, jnp.dtype(dtype)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_relayout_is_lossless(dtype):
  kq, vq = _quantized(dtype)
  cache = mosaic_layout.to_mosaic(kq, vq)
  assert cache.kc.dtype == jnp.uint32 and cache.ks.dtype == jnp.dtype(dtype)
  assert cache.capacity == 256 and cache.kc.shape == (2, 3, 2, 4, 256)
  # Same bytes as the planar cache: codes 2 bits, scale/zero unchanged in number.
  assert cache.kc.size * 4 == kq.codes.size and cache.ks.size == 2 * kq.scale.size
  kf, vf = mosaic_layout.dequantize_mosaic(cache)
  np.testing.assert_array_equal(np.asarray(kf), np.asarray(planar.dequantize_keys(kq, 128)))
  np.testing.assert_array_equal(np.asarray(vf), np.asarray(planar.dequantize_values(vq, 128)))
  # from_mosaic is the exact inverse: the planar arrays come back bit for bit.
  back_k, back_v = mosaic_layout.from_mosaic(cache)
  for want, got in ((kq, back_k), (vq, back_v)):
    assert (got.bits, got.group) == (want.bits, want.group)
    for field in ("codes", "scale", "zero"):
      a, b = np.asarray(getattr(want, field)), np.asarray(getattr(got, field))
      assert a.dtype == b.dtype and np.array_equal(a, b), field
  # Negative control: one flipped code bit changes exactly one element.
  bad = dataclasses.replace(cache, kc=cache.kc.at[0, 0, 0, 1, 22].set(cache.kc[0, 0, 0, 1, 22]
                                                                        ^ 1))
  kb, _ = mosaic_layout.dequantize_mosaic(bad)
  assert int((np.asarray(kb) != np.asarray(kf)).sum()) == 1


def test_words_are_the_packing_modules_2bit_words():
  """A word's slot k, element e sits at bits 2 k + 16 e: its 16 codes in (e, k) order are an
  LSB-first 2-bit stream, which is `packing.pack_words(.., 2)`; the relayout's words equal
  that formula applied to the planar codes gathered by `code_maps` (numpy)."""
  rng = np.random.default_rng(0)
  stream = rng.integers(0, 4, (64, 16))
  want = (stream.astype(np.uint64) << (2 * np.arange(16, dtype=np.uint64))).sum(-1)
  np.testing.assert_array_equal(np.asarray(packing.pack_words(jnp.asarray(stream), 2))[:, 0],
                                want.astype(np.uint32))
  kq, vq = _quantized("float16", seed=3, shape=(1, 128, 1, 128))
  cache = mosaic_layout.to_mosaic(kq, vq)
  (kt, kd), (vt, vd) = mosaic_layout.code_maps()
  shift = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint64)
  for codes, rows, cols, words in ((planar.key_codes(kq), kt, kd, cache.kc),
                                   (planar.value_codes(vq), vt, vd, cache.vc)):
    c = np.asarray(codes)[0, 0][rows, cols].astype(np.uint64)         # [1024, 8, 2]
    formula = (c << shift).sum((-2, -1)).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(words).reshape(1024), formula)
    # Negative control: (k, e) order instead of (e, k) (bits 4 k + 2 e).
    swapped = (c << (4 * np.arange(8)[:, None] + 2 * np.arange(2)).astype(np.uint64)).sum(
        (-2, -1)).astype(np.uint32)
    assert not np.array_equal(np.asarray(words).reshape(1024), swapped)


def test_maps_are_permutations():
  """Every planar element of a block is stored exactly once (what a cache writing this layout
  directly relies on); the returned arrays are copies."""
  (kt, kd), (vt, vd) = mosaic_layout.code_maps()
  for t, d in ((kt, kd), (vt, vd)):
    assert t.shape == d.shape == (1024, 8, 2)
    assert np.array_equal(np.sort((t * 128 + d).ravel()), np.arange(128 * 128))
  (kg, kx), (vx, vg) = mosaic_layout.scale_maps()
  assert kg.shape == (4, 8, 4, 2, 2)
  assert np.array_equal(np.sort((kg * 128 + kx).ravel()), np.arange(4 * 128))
  assert np.array_equal(np.sort((vx * 4 + vg).ravel()), np.arange(128 * 4))
  kt[...] = 0
  assert mosaic_layout.code_maps()[0][0].max() == 127
  # Each key word's 16 codes lie in one 32-token key group (its warp's): one scale row.
  (kt, _), _ = mosaic_layout.code_maps()
  assert np.array_equal(kt.reshape(1024, 16).min(1) // 32, kt.reshape(1024, 16).max(1) // 32)


def test_layout_rejects():
  k = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  kq = planar.quantize_keys(k, 2, 32, jnp.float16)
  vq = planar.quantize_values(k, 2, 32, jnp.float16)
  with pytest.raises(ValueError, match="multiple of 128"):
    mosaic_layout.to_mosaic(kq, vq)
  k = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="keys must be 2-bit with groups of 32"):
    mosaic_layout.to_mosaic(planar.quantize_keys(k, 4, 32, jnp.float16),
                            planar.quantize_values(k, 2, 32, jnp.float16))
  with pytest.raises(ValueError, match="values must be 2-bit with groups of 32"):
    mosaic_layout.to_mosaic(planar.quantize_keys(k, 2, 32, jnp.float16),
                            planar.quantize_values(k, 2, 16, jnp.float16))
  with pytest.raises(ValueError, match="float16 or bfloat16"):
    mosaic_layout.to_mosaic(planar.quantize_keys(k, 2, 32, F32),
                            planar.quantize_values(k, 2, 32, F32))
  with pytest.raises(ValueError, match="head dim must be 128"):
    mosaic_layout.to_mosaic(planar.quantize_keys(k[..., :64], 2, 32, jnp.float16),
                            planar.quantize_values(k[..., :64], 2, 32, jnp.float16))
  cache = mosaic_layout.to_mosaic(planar.quantize_keys(k, 2, 32, jnp.float16),
                                  planar.quantize_values(k, 2, 32, jnp.float16))
  with pytest.raises(ValueError, match="KiviMosaic.vs shape"):
    mosaic_layout.check_mosaic(dataclasses.replace(cache, vs=cache.vs[:, :, :, :2]))
  with pytest.raises(ValueError, match="KiviMosaic.kc must be uint32"):
    mosaic_layout.check_mosaic(dataclasses.replace(cache, kc=cache.kc.astype(jnp.int32)))
  assert mosaic_layout.check_mosaic(cache) == "float16"


def _a_fragment(lane):
  """(row, column) of the 8 16-bit elements a thread holds of an m16 x k16 A operand, in
  register order a0..a3 (PTX ISA, mma.m16n8k16 .f16/.bf16), element e inner."""
  r, q = lane // 4, lane % 4
  return [(r + 8 * rh, 2 * q + 8 * jh + e) for jh in range(2) for rh in range(2)
          for e in range(2)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("what", ["keys", "values"])
def test_warp_fragments_rebuild_the_cache(dtype, what):
  """The codes as the kernel makes them (`code_pairs_numpy`), times the scale and plus the
  zero point each fragment element reads, reassemble the planar cache's dequantized block
  (rounded once to the 16-bit type)."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(1, 128, 1, 128)) * 3 + 1, jnp.bfloat16)
  sdt = jnp.dtype(dtype)
  kq = planar.quantize_keys(x, 2, 32, sdt)
  vq = planar.quantize_values(x, 2, 32, sdt)
  cache = mosaic_layout.to_mosaic(kq, vq)
  if what == "keys":
    want = np.asarray(planar.dequantize_keys(kq, 128)[0, :, 0])          # [token, channel]
    words = np.asarray(cache.kc[0, 0, 0]).reshape(2, 128, 4)               # [m, tau, u]
    sc = np.asarray(cache.ks[0, 0, 0].astype(F32)).reshape(4, 8, 4, 2, 2, 2)
  else:
    want = np.asarray(planar.dequantize_values(vq, 128)[0, :, 0]).T      # [channel, token]
    words = np.asarray(cache.vc[0, 0, 0]).reshape(128, 8)                  # [tau, u]
    sc = np.asarray(cache.vs[0, 0, 0].astype(F32)).reshape(4, 8, 4, 2, 2, 2)
  want = np.asarray(jnp.asarray(want).astype(sdt).astype(F32))

  def scaled(word, s_pairs, z_pairs):  # [8 slots, 2 elements]
    return mosaic_dequant.code_pairs_numpy(np.uint32(word), dtype) * s_pairs + z_pairs

  def assemble(order):
    got = np.full((128, 128), np.nan)
    for tau in range(128):
      w, lane = divmod(tau, 32)
      frag = [_a_fragment(lane)[i] for i in order]
      if what == "keys":  # tile (m, k-step kk): tokens 32 w + 16 m, channels 16 kk
        for m in range(2):
          s = sc[w, :, lane % 4]                                   # [r, jj, sz, e]
          for u in range(4):
            ks = [(u % 2) * 8 + k for k in range(8)]               # pair columns j
            vals = scaled(words[m, tau, u], np.stack([s[j // 2, j % 2, 0] for j in ks]),
                          np.stack([s[j // 2, j % 2, 1] for j in ks]))
            for k, j in enumerate(ks):
              kk, reg = j // 2, 2 * (j % 2) + u // 2                # a0..a3 = (rh, jh)
              row, col = frag[2 * reg]
              got[32 * w + 16 * m + row, 16 * kk + col: 16 * kk + col + 2] = vals[k]
      else:  # tile (channel tile t, k-step kk): channels 16 t, tokens 32 w + 16 kk
        for u in range(8):
          kk, gq = divmod(u, 4)
          chunk = sc[w, u, lane % 4]                               # [jh, sz, e]
          vals = scaled(words[tau, u], np.stack([chunk[(k % 4) // 2, 0] for k in range(8)]),
                        np.stack([chunk[(k % 4) // 2, 1] for k in range(8)]))
          for k in range(8):
            t, reg = 2 * gq + k // 4, k % 4
            row, col = frag[2 * reg]
            got[16 * t + row, 32 * w + 16 * kk + col: 32 * w + 16 * kk + col + 2] = vals[k]
    return np.asarray(jnp.asarray(got, F32).astype(sdt).astype(F32))

  np.testing.assert_allclose(assemble(range(8)), want, rtol=0, atol=0)
  # Negative control: registers a1 and a2 swapped (rows + 8 <-> columns + 8).
  assert not np.allclose(assemble([0, 1, 4, 5, 2, 3, 6, 7]), want)


def test_code_pairs_are_exact():
  """The kernel's lop3 + packed FMA give every code of a word exactly, in fp16 and bf16
  (random codes in every slot and element); misaligned words do not (negative control)."""
  rng = np.random.default_rng(9)
  codes = rng.integers(0, 4, (256, 8, 2))
  shift = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint64)
  words = (codes.astype(np.uint64) << shift).sum((-2, -1)).astype(np.uint32)
  for dtype in ("float16", "bfloat16"):
    np.testing.assert_array_equal(mosaic_dequant.code_pairs_numpy(words, dtype), codes)
  assert not np.array_equal(mosaic_dequant.code_pairs_numpy(words >> np.uint32(2), "float16"),
                            codes)


def test_key_magic_pairs_give_the_codes():
  """The key path's lop3 alone (`word_magic`) gives MAGIC + c / magic_factor(k) exactly, so
  (x - MAGIC) * f is every code, in fp16 and bf16; and the key product's algebra, in float64:
  sum_j (q_j f_j s_j) x_j - MAGIC sum_j q_j f_j s_j = sum_j q_j s_j c_j. Negative control: x
  taken as the code (no offset removed) is far off."""
  rng = np.random.default_rng(11)
  codes = rng.integers(0, 4, (256, 8, 2))
  shift = (2 * np.arange(8)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint64)
  words = (codes.astype(np.uint64) << shift).sum((-2, -1)).astype(np.uint32)
  for dtype in ("float16", "bfloat16"):
    x = mosaic_dequant.magic_pairs_numpy(words, dtype).astype(np.float64)
    f = np.array([mosaic_dequant.magic_factor(k, dtype) for k in range(8)])[:, None]
    np.testing.assert_array_equal((x - mosaic_dequant.MAGIC) * f, codes)
    assert f.max() <= 1 and f.min() >= 2.0 ** -8
    q, s = rng.normal(size=(8, 2)), rng.uniform(0.01, 1, (8, 2))
    b = q * f * s
    got = (b * x).sum((-2, -1)) - mosaic_dequant.MAGIC * b.sum()
    want = (q * s * codes).sum((-2, -1))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert not np.allclose((b * x).sum((-2, -1)), want)


@pytest.mark.parametrize("change, match", PLAN_REJECTS)
def test_plan_rejects(change, match):
  assert_plan_rejects(mosaic_kivi_warp.plan, change, match)


def test_plan_defaults_and_cache_check():
  p = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), warpgroups=3)
  assert p["stages"] % 3 == 0 and p["np"] == 8 and (3 * p["regs"] + 40) * 128 <= 65536
  assert "skip" not in p and "fold" not in p
  p2 = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128))
  assert p2["w"] == 2 and p2["stages"] % 2 == 0 and p2["regs"] <= 232
  # two blocks per step where the ring holds both (the GPU cases run both kinds)
  assert p2["group"] == 2 and p["group"] == 2
  assert mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), stages=2)["group"] == 1
  # persistent CTAs: at most one per multiprocessor, two q slots where a CTA runs several
  p3 = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), num_splits=4, ctas=5)
  assert p3["items"] == 8 * 8 * 4 and p3["ctas"] == 5 and p3["q_slots"] == 2
  p4 = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), num_splits=4, persistent=False)
  assert p4["ctas"] == p4["items"] == 256 and p4["q_slots"] == 1
  assert mosaic_kivi_warp.plan((1, 32, 128), (1, 8, 128), num_splits=1)["q_slots"] == 1
  with pytest.raises(ValueError, match="ctas"):
    mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), persistent=False, ctas=4)
  # an extension's shared memory is asked per q slot: with two (several items per CTA) a
  # large one leaves room for fewer ring slots than with one
  big = lambda w, st, np_, q_slots: q_slots * 60_000
  one = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), extra_smem=big, num_splits=4,
                              persistent=False)
  two = mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), extra_smem=big, num_splits=4, ctas=5)
  assert (one["q_slots"], two["q_slots"]) == (1, 2) and two["stages"] < one["stages"] == 8
  with pytest.raises(TypeError):  # the removed knobs
    mosaic_kivi_warp.plan((8, 32, 128), (8, 8, 128), dequant="fma")
  _, (q, kq, vq, kw, vw, ql, wl) = case(0, 1)
  cache = mosaic_layout.to_mosaic(kq, vq)
  bad = dataclasses.replace(cache, ks=cache.ks.astype(F32), vs=cache.vs.astype(F32))
  with pytest.raises(ValueError, match="float16 or bfloat16"):
    mosaic_kivi_warp.kivi_attention_mosaic_warp(q, bad, kw, vw, ql, wl)


@pytest.mark.parametrize("b, kh, ns, n_cta", [(3, 2, 3, 4), (7, 32, 4, 132), (2, 8, 1, 16),
                                             (5, 3, 2, 30)])
def test_persistent_items_cover_every_split_once(b, kh, ns, n_cta):
  """`mosaic_ring.item_geometry` over every CTA's items (pid + j n_cta): each (pair, split)
  exactly once, with `splitk.split_bounds`' tokens, in the (B K, splits) grid's order; the
  CTAs' item counts differ by at most one. Negative control: n_cta CTAs striding by
  n_cta - 1 run some items twice."""
  from kvlowrank_kernels.common import splitk  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import mosaic_ring  # pylint: disable=import-outside-toplevel
  lengths = np.random.default_rng(b * 100 + ns).integers(0, 5000, b)
  lengths[:2] = (0, 1280)  # an empty sequence, and one of whole blocks
  lengths = jnp.asarray(lengths, jnp.int32)
  items = b * kh * ns

  def cover(stride):
    seen, counts = {}, []
    for pid in range(n_cta):
      count = (items - pid + stride - 1) // stride
      counts.append(count)
      for j in range(count):
        pair, sid, bb, head, start, end, nbl = (int(v) for v in mosaic_ring.item_geometry(
            jnp.int32(j), pid=jnp.int32(pid), n_cta=stride, ns=ns, kh=kh, lengths=lengths))
        assert (bb, head) == divmod(pair, kh) and pid + j * stride == sid * b * kh + pair
        seen[(pair, sid)] = seen.get((pair, sid), 0) + 1
        want = splitk.split_bounds(lengths[bb], ns, sid, mosaic_layout.BLOCK)
        assert (start, end, nbl) == tuple(int(v) for v in want), (pair, sid)
    return seen, counts

  seen, counts = cover(n_cta)
  assert sorted(seen) == [(pr, sd) for pr in range(b * kh) for sd in range(ns)]
  assert set(seen.values()) == {1} and max(counts) - min(counts) <= 1
  bad, _ = cover(n_cta - 1)
  assert max(bad.values()) > 1


@functools.lru_cache(maxsize=None)
def _lowering_inputs(idx):
  """One shape's operands in the warp layout, built once for every knob set lowered on it."""
  _, (q, kq, vq, kw, vw, ql, wl) = case(idx, 20 + idx)
  return q, mosaic_layout.to_mosaic(kq, vq), kw, vw, ql, wl


@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=2),
                                  dict(warpgroups=2, num_splits=2),
                                  dict(num_splits=3, ctas=2), dict(persistent=False),
                                  dict(warpgroups=1, stages=2, num_splits=2, ctas=3)])
def test_mosaic_kivi_warp_lowers_for_cuda(idx, opts):
  q, cache, kw, vw, ql, wl = _lowering_inputs(idx)
  f = jax.jit(lambda *a: mosaic_kivi_warp.kivi_attention_mosaic_warp(*a, **opts))
  text = f.trace(q, cache, kw, vw, ql, wl).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(SHAPES)))
@pytest.mark.parametrize("opts", [dict(), dict(warpgroups=1, stages=1),
                                  dict(warpgroups=1, stages=4, num_splits=1),
                                  dict(warpgroups=2, stages=2, num_splits=3),
                                  dict(warpgroups=1, stages=2, num_splits=3),
                                  dict(warpgroups=2), dict(warpgroups=3, stages=3,
                                                           num_splits=2),
                                  # persistent CTAs, several items each (warp-split and
                                  # warpgroup producers), and one CTA per split
                                  dict(num_splits=3, ctas=2), dict(ctas=3),
                                  dict(warpgroups=1, stages=2, num_splits=4, ctas=3),
                                  dict(warpgroups=3, stages=3, num_splits=2, ctas=4),
                                  dict(persistent=False)])
def test_mosaic_kivi_warp_matches_reference(idx, opts):
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  shape, (q, kq, vq, kw, vw, ql, wl) = case(idx, 700 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq)
  ref, ref_lse = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  run = jax.jit(lambda *a: mosaic_kivi_warp.kivi_attention_mosaic_warp(
      *a, out_dtype=F32, return_partials=True, **opts))
  out, lse, (o_p, lse_p) = run(q, cache, kw, vw, ql, wl)
  assert np.isfinite(np.asarray(o_p)).all(), "non-finite partial outputs"
  assert not np.isnan(np.asarray(lse_p)).any(), "NaN partial lse"
  assert_close(out, ref, 2e-2, 2e-2, f"out {shape} {opts}")
  assert_close(lse, ref_lse, 2e-2, 2e-3, f"lse {opts}")
  again = run(q, cache, kw, vw, ql, wl)
  assert np.array_equal(np.asarray(out), np.asarray(again[0])), "not bitwise deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("idx", [0, 1])
@pytest.mark.parametrize("knobs", [dict(), dict(warpgroups=1, stages=4),
                                   dict(warpgroups=1, stages=1)])
def test_persistent_partials_equal_one_cta_per_split(idx, knobs):
  """Two persistent CTAs, each running 9-12 items (ragged: empty items after full ones,
  where the producer runs ahead to the next-but-one item's q), give every split's partial
  bitwise equal to one CTA per split with the same warpgroups and ring. Negative control:
  the same comparison sees a one-ulp change of one partial."""
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  _, (q, kq, vq, kw, vw, ql, wl) = case(idx, 700 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq)

  def partials(**more):
    f = jax.jit(lambda *a: mosaic_kivi_warp.kivi_attention_mosaic_warp(
        *a, out_dtype=F32, return_partials=True, num_splits=3, **knobs, **more))
    _, _, (o_p, lse_p) = f(q, cache, kw, vw, ql, wl)
    return np.asarray(o_p), np.asarray(lse_p)

  assert_splits_bitwise_equal(partials(ctas=2), partials(persistent=False))


@pytest.mark.gpu
def test_mosaic_kivi_warp_dispatcher_and_negative_control():
  """The dispatcher runs the warp kernel on a KiviMosaic cache as stored (bitwise the
  kernel's result) and on planar inputs (relaid out per call: the same result); a corrupted
  scale/zero row must break the agreement with the reference."""
  if not triton_backend.gpu_available():
    pytest.skip("needs a GPU")
  _, (q, kq, vq, kw, vw, ql, wl) = case(0, 750)
  ref, _ = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  cache = mosaic_layout.to_mosaic(kq, vq)
  direct, _ = mosaic_kivi_warp.kivi_attention_mosaic_warp(q, cache, kw, vw, ql, wl,
                                                          out_dtype=F32)
  for keys, values in ((cache, None), (kq, vq)):
    out, _ = kivi_attention(q, keys, values, kw, vw, ql, wl, out_dtype=F32,
                            implementation="mosaic")
    assert_close(out, ref, 2e-2, 2e-2, f"dispatcher ({type(keys).__name__})")
    assert np.array_equal(np.asarray(out), np.asarray(direct))
  row = int(np.argmax(np.asarray(ql)))
  for what in ("ks", "vs"):  # the scale/zero rows of the first block, times 9
    bad = dataclasses.replace(cache, **{what: getattr(cache, what).at[row, 0, 0].multiply(9.0)})
    out, _ = kivi_attention(q, bad, None, kw, vw, ql, wl, out_dtype=F32,
                            implementation="mosaic")
    with pytest.raises(AssertionError):
      assert_close(out, ref, 2e-2, 2e-2, f"corrupted {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(SHAPES)))
def test_fused_window_matches_xla_window(idx):
  """The epilogue in one Triton launch (`triton_window`, the default where it fits) against
  the XLA window + merge and the float32 reference; windows it does not take (37, 5 tokens)
  run the XLA one, and asking for "fused" there is an error naming the window."""
  if not triton_backend.available():
    pytest.skip("needs a GPU with jax-triton")
  from kvlowrank_kernels.kivi.triton_window import window_fit  # pylint: disable=C0415
  shape, (q, kq, vq, kw, vw, ql, wl) = case(idx, 800 + idx)
  cache = mosaic_layout.to_mosaic(kq, vq)
  run = jax.jit(lambda *a, impl=None: mosaic_kivi_warp.kivi_attention_mosaic_warp(
      *a, out_dtype=F32, window_implementation=impl), static_argnames="impl")
  xla, xla_lse = run(q, cache, kw, vw, ql, wl, impl="xla")
  default, _ = run(q, cache, kw, vw, ql, wl)
  if window_fit(kw, 128) is not None:
    assert np.array_equal(np.asarray(default), np.asarray(xla))
    with pytest.raises(ValueError, match="window of"):
      run(q, cache, kw, vw, ql, wl, impl="fused")
    return
  fused, fused_lse = run(q, cache, kw, vw, ql, wl, impl="fused")
  assert np.array_equal(np.asarray(default), np.asarray(fused))
  ref, ref_lse = kivi_attention_reference(q, kq, vq, kw, vw, ql, wl, out_dtype=F32)
  assert_close(fused, xla, 5e-3, 5e-3, f"fused vs xla window {shape}")
  assert_close(fused_lse, xla_lse, 1e-3, 1e-4, "fused vs xla lse")
  assert_close(fused, ref, 2e-2, 2e-2, f"fused window vs reference {shape}")
  bad = vw.at[int(np.argmax(np.asarray(wl))), 0].multiply(30.0)
  with pytest.raises(AssertionError):
    assert_close(run(q, cache, kw, bad, ql, wl, impl="fused")[0], xla, 5e-3, 5e-3, "bad v")
