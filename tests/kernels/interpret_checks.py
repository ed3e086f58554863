"""Kernel-vs-reference checks run under Triton's CPU interpreter (one check per process).

`python tests/kernels/interpret_checks.py NAME` sets TRITON_INTERPRET=1 *before*
importing the kernel modules (Triton decides at decoration time), runs check
NAME and exits non-zero on a mismatch. `test_triton_interpret.py` runs every
check in a subprocess; it skips where Triton or torch is not installed (CI).
Shapes are small and ragged (lengths 1, full, non-multiples of the tiles); the
GPU tests (`-m gpu`) repeat these on the device with larger shapes.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import closeness  # noqa: E402
from triton_interpret import interpreted_launch  # noqa: E402

F32 = jnp.float32


def assert_close(out, ref, atol, rtol, what):
  print(f"{what}: max err {closeness.assert_close(out, ref, atol, rtol, what):.3g}")


def check_dense():
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.dense.reference import decode_attention_reference  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.dense.triton_decode import decode_attention_triton  # pylint: disable=import-outside-toplevel
  for i, shape in enumerate(ds.TEST_SHAPES[:2]):
    lens = ds.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(i))
    args = ds.make_inputs(shape, jax.random.key(i), lengths=lens)
    with interpreted_launch():
      out, lse = decode_attention_triton(*args, out_dtype=F32, block_s=16, poison=True)
    ref, ref_lse = decode_attention_reference(*args, out_dtype=F32)
    assert_close(out, ref, 1e-2, 1e-2, f"dense[{i}] out")
    assert_close(lse, ref_lse, 1e-2, 1e-3, f"dense[{i}] lse")


def check_kivi():
  """Every KIVI test shape (2/4-bit K and V, GQA 1/4/8, H = 64/128, 1-8 value groups, key groups
  8-64), ragged lengths (1, full, non-tile-multiples), windows full/1/0, several tilings;
  then a negative control (one corrupted key scale must break the agreement)."""
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import shapes as ks  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi.planar import KiviKeys  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi.reference import kivi_attention_reference  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi.triton_kivi import kivi_attention_triton  # pylint: disable=import-outside-toplevel
  options = (dict(), dict(block_s=64, num_splits=2), dict(block_s=16, num_splits=5, block_w=16))
  for i, shape in enumerate(ks.TEST_SHAPES):
    q_len = ds.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(500 + i))
    w_len = np.asarray([shape.window, 1, 0][:shape.batch], np.int32)
    args = ks.make_inputs(shape, jax.random.key(500 + i), q_len=q_len, w_len=w_len)
    ref, ref_lse = kivi_attention_reference(*args, out_dtype=F32)
    for opts in options[:2] if i else options:
      with interpreted_launch():
        out, lse = kivi_attention_triton(*args, out_dtype=F32, poison=True, **opts)
      assert_close(out, ref, 5e-3, 5e-3, f"kivi[{i}] {opts} out")
      assert_close(lse, ref_lse, 2e-3, 1e-3, f"kivi[{i}] {opts} lse")
  # Negative control: batch row 1 attends its full capacity; scale one key group's scales.
  shape = ks.TEST_SHAPES[0]
  args = ks.make_inputs(shape, jax.random.key(599))
  q, keys, *rest = args
  bad = KiviKeys(codes=keys.codes, scale=keys.scale.at[1, :, 2].multiply(8.0), zero=keys.zero,
                 bits=keys.bits, group=keys.group)
  ref, _ = kivi_attention_reference(*args, out_dtype=F32)
  with interpreted_launch():
    out, _ = kivi_attention_triton(q, bad, *rest, out_dtype=F32)
  closeness.assert_differs(out, ref, 5e-3, 5e-3, "kivi corrupted key scale",
                           "kivi: a corrupted key scale went unnoticed")


def check_palu():
  """Every Palu test shape (MHA absorbed / GQA reconstruction paths, bias, bf16, fp16 and
  2/3/4-bit `PackedLatent` latents from the one quantizer and packing module), ragged lengths,
  several tilings; then latents with constant token slices (the quantizer's scale-0 rule) and
  a negative control (one corrupted key latent must break the agreement)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.palu import shapes as ls  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.palu.packed import quantize_latent  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.palu.reference import (  # pylint: disable=import-outside-toplevel
      palu_attention_reference, rope_inv_freq)
  from kvlowrank_kernels.palu.triton_palu_launch import palu_attention_triton  # pylint: disable=import-outside-toplevel
  for i, shape in enumerate(ls.TEST_SHAPES):
    lens = ds.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(300 + i))
    q, hk, hv, b_k, bias, lens = ls.make_inputs(shape, jax.random.key(300 + i), lengths=lens)
    inv = rope_inv_freq(shape.head_dim, 10000.0)
    variants = [dict(), dict(block_s=32, num_warps=4, num_stages=2)]
    if shape.kv_per_group > 1:
      variants.append(dict(block_s=32, heads_per_program=1))
    if i < 3:  # token tiles along the MMA N dimension (MHA absorbed, MHA with bias, GQA)
      variants.append(dict(block_s=32, trans=True))
    latents = [("", hk, hv)]
    if shape.k_bits == shape.v_bits == 16:  # also fp16 latents (computed in fp16)
      latents.append(("fp16 ", hk.astype(jnp.float16), hv.astype(jnp.float16)))
    for tag, lk, lv in latents:
      ref, ref_lse = palu_attention_reference(q, lk, lv, b_k, lens, inv_freq=inv,
                                              k_bias=bias, out_dtype=F32)
      for o in variants:
        with interpreted_launch():
          out, lse = palu_attention_triton(q, lk, lv, b_k, lens, inv, k_bias=bias,
                                           out_dtype=F32, poison=True, **o)
        assert_close(out, ref, 2e-2, 2e-2, f"palu[{i}] {tag}{o} out")
        assert_close(lse, ref_lse, 2e-2, 1e-3, f"palu[{i}] {tag}{o} lse")
  # Constant token slices quantize to scale 0 and code 0 (dequantized: the zero point).
  shape = ls.TEST_SHAPES[4]  # 2-bit keys, 4-bit values
  q, hk, hv, b_k, bias, lens = ls.make_inputs(shape, jax.random.key(390))
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  raw = ls.make_inputs(dataclasses.replace(shape, k_bits=16, v_bits=16), jax.random.key(390))
  hk = quantize_latent(raw[1].at[:, 3::7].set(0.75), shape.k_bits)
  hv = quantize_latent(raw[2].at[:, 5::9].set(-0.5), shape.v_bits)
  assert not np.asarray(hk.scale[:, 3::7]).any() and not np.asarray(hv.scale[:, 5::9]).any()
  ref, ref_lse = palu_attention_reference(q, hk, hv, b_k, lens, inv_freq=inv, out_dtype=F32)
  with interpreted_launch():
    out, lse = palu_attention_triton(q, hk, hv, b_k, lens, inv, out_dtype=F32, poison=True,
                                     block_s=32)
  assert_close(out, ref, 2e-2, 2e-2, "palu constant slices out")
  assert_close(lse, ref_lse, 2e-2, 1e-3, "palu constant slices lse")
  # Negative control: batch row 1 attends its full capacity; scale one key latent slot.
  shape = ls.TEST_SHAPES[0]
  q, hk, hv, b_k, bias, lens = ls.make_inputs(shape, jax.random.key(399))
  inv = rope_inv_freq(shape.head_dim, 10000.0)
  ref, _ = palu_attention_reference(q, hk, hv, b_k, lens, inv_freq=inv, k_bias=bias,
                                    out_dtype=F32)
  with interpreted_launch():
    out, _ = palu_attention_triton(q, hk.at[1, 0].multiply(40.0), hv, b_k, lens, inv,
                                   k_bias=bias, out_dtype=F32, block_s=32)
  closeness.assert_differs(out, ref, 2e-2, 2e-2, "palu corrupted key latent",
                           "palu: a corrupted key latent went unnoticed")


def _xq_rows(seed, b, s, c, bits, axis, group):
  """Packed XQuant rows [B, S, C] of seeded normal data (`quant.packing` words)."""
  from kvlowrank_kernels.quant import quantize_codes  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.quant.packing import pack_words  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.xquant.reference import PackedRows  # pylint: disable=import-outside-toplevel
  x = jax.random.normal(jax.random.key(seed), (b, s, c), F32)
  codes, sc, zr = quantize_codes(x, bits=bits, axis=-1 if axis == "token" else 1,
                                 group_size=group)
  return PackedRows(codes=pack_words(codes, bits), scale=sc, zero=zr, bits=bits, axis=axis,
                    group=group)


def check_xquant():
  """XQuant kernels (kvlowrank_kernels.xquant): the GEMM-shaped fused decode kernel
  on the X path (MHA, shared rows) and the latent path (GQA, K per channel, V per token) at
  2/3/4 bits with ragged lengths (1, full, non-multiples of BLOCK_M) and 1 or many splits,
  both mainloop paths (compact one-step-ahead loads where `fast_path` holds, per-element
  dequant otherwise), fewer V than K slots, fp32 weights (exact algebra: tight bound) and
  bf16 weights (bf16 MMA operands); the plain dequant-matmul
  kernel at every bit width and both axes. Every partial is NaN-poisoned first."""
  from kvlowrank_kernels.xquant import reference as ref  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.xquant import triton_dm, triton_remat  # pylint: disable=import-outside-toplevel
  theta = 10000.0
  # (name, shared, B, S, lens, N, KH, H, C, k (bits, axis, group), v (bits, axis, group), tuning)
  cases = [
      ("x2", True, 3, 80, [80, 1, 45], 4, 4, 16, 64, (2, "token", 32), None,
       dict(block_m=32, block_k=32)),
      ("x3", True, 2, 64, [33, 64], 2, 2, 32, 96, (3, "token", 96), None,
       dict(block_m=16, block_k=32, num_splits=1)),
      ("x4", True, 2, 48, [47, 17], 4, 4, 16, 64, (4, "token", 16), None,
       dict(block_m=16, block_k=64, num_splits=2)),
      ("lat2", False, 3, 96, [88, 1, 50], 8, 2, 16, 32, (2, "channel", 32), (2, "token", 16),
       dict(block_m=32, block_k=16)),
      ("lat3", False, 2, 64, [64, 23], 8, 2, 16, 32, (3, "channel", 16), (3, "token", 32),
       dict(block_m=32, block_k=32, num_splits=1)),
      ("lat4", False, 2, 64, [40, 9], 4, 1, 32, 64, (4, "channel", 64), (4, "token", 64),
       dict(block_m=16, block_k=32)),
  ]
  for (name, shared, b, s, lens, n, kh, h, c, kq, vq, tuning) in cases:
    kr = _xq_rows(11, b, s, c, *kq)
    # The V latent store may hold fewer slots than the K one (whole token groups).
    vr = None if shared else _xq_rows(12, b, s - (8 if name == "lat2" else 0), c, *vq)
    keys = jax.random.split(jax.random.key(13), 5)
    wk = 0.3 * jax.random.normal(keys[0], (c, kh * h), F32)
    wv = 0.3 * jax.random.normal(keys[1], (c, kh * h), F32)
    bk = jax.random.normal(keys[2], (kh * h,), F32)
    bv = jax.random.normal(keys[3], (kh * h,), F32)
    q = jax.random.normal(keys[4], (b, n, h), F32)
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = jnp.asarray(np.arange(s)[:, None] * inv[None, :], F32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    lens = jnp.asarray(lens, jnp.int32)
    # fp32 weights: fp32 products (EXACT), so only summation order differs; bf16 weights:
    # every MMA operand rounded to bf16 (a few 2^-9 relative errors per score).
    for wdt, tol, lse_tol in ((F32, 2e-5, 1e-5), (jnp.bfloat16, 3e-2, 0.1))[:2 if name in (
        "x2", "lat4") else 1]:
      args = (q, kr, vr, wk.astype(wdt), wv.astype(wdt), bk, bv, cos, sin, lens)
      want, want_lse = ref.remat_decode_attention(
          q, kr, vr, wk.astype(wdt).astype(F32), wv.astype(wdt).astype(F32), bk, bv, cos, sin,
          lens, n_kv_heads=kh, return_lse=True)
      with interpreted_launch():
        got, lse = triton_remat.remat_decode_attention(*args, n_kv_heads=kh, return_lse=True,
                                                       poison=True, **tuning)
      scale = float(jnp.max(jnp.abs(want)))
      tag = f"xquant fused {name} w={jnp.dtype(wdt).name}"
      assert_close(got, want, tol * scale, tol, f"{tag} out")
      assert_close(lse, want_lse, lse_tol, 0, f"{tag} lse")
  # Plain dequant-matmul: ragged M and N tiles, every width and both axes.
  for bits, axis, group in ((2, "token", 32), (3, "token", 64), (4, "channel", 16),
                            (8, "channel", 32), (3, "channel", 8)):
    m, c, nn = 96 if axis == "channel" else 70, 64, 48
    rows = _xq_rows(20 + bits, 1, m, c, bits, axis, group)
    w = jax.random.normal(jax.random.key(30 + bits), (c, nn), F32)
    a = (rows.codes[0], rows.scale[0], rows.zero[0], w)
    want = ref.dequant_matmul(*a, bits=bits, axis=axis, group=group)
    with interpreted_launch():
      got = triton_dm.dequant_matmul(*a, bits=bits, axis=axis, group=group, block_m=32,
                                     block_n=32, block_k=16, poison=True)
    assert_close(got, want, 1e-4 * float(jnp.max(jnp.abs(want))), 1e-4,
                 f"xquant dequant_matmul {bits}b {axis}")


def check_rotated():
  """Ragged-head rotated-cache kernel (kvlowrank_kernels.rotated): every test shape (GQA 1/4/8,
  per-head widths 16-64, tile widths a power of two or not), ragged lengths (1, full,
  non-tile-multiples, 0), several chunkings and head-group widths, equal-cost chunks, every
  launch order, bf16 and fp16; every partial NaN-poisoned first. Then a negative control (one
  corrupted key slot of one head must break the agreement)."""
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import shapes as rs  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import to_heads  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated.reference import ragged_attention_reference  # pylint: disable=C0415
  from kvlowrank_kernels.rotated.triton_ragged import ragged_attention_triton  # pylint: disable=C0415
  options = (dict(block_s=16),
             dict(block_s=16, chunk_tokens=32, schedule="static", group_width=16),
             dict(block_s=16, target_chunks=20, group_width=16),
             dict(block_s=32, target_chunks=5, schedule="lpt", group_width=64),
             dict(block_s=16, num_stages=1, group_width=128))
  for i, shape in enumerate(rs.TEST_SHAPES):
    lens = ds.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(700 + i))
    if i == 0:
      lens[0] = 0  # an empty row: output 0, lse -inf
    if i == 1:
      lens[0] = shape.capacity + 50  # past the capacity: every slot, nothing read beyond
    w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
    for dt in (jnp.bfloat16, jnp.float16)[:2 if i == 0 else 1]:
      args = rs.make_inputs(shape, jax.random.key(700 + i), dtype=dt, lengths=lens)
      ref, ref_lse = ragged_attention_reference(*args, out_dtype=F32, **w)
      for opts in options:
        with interpreted_launch():
          out, lse = ragged_attention_triton(*args, out_dtype=F32, poison=True, **w, **opts)
        tag = f"rotated[{i}] {jnp.dtype(dt).name} {opts}"
        assert_close(out, ref, 1e-2, 1e-2, f"{tag} out")
        assert_close(lse, ref_lse, 1e-2, 1e-3, f"{tag} lse")
      # The per-head layout the cache asks for (`heads_width`), zero-padded past each v_h.
      width = max(shape.v_widths) + 16
      with interpreted_launch():
        heads, _ = ragged_attention_triton(*args, out_dtype=F32, block_s=16, heads_width=width,
                                           **w)
      assert_close(heads, to_heads(ref, shape.v_widths, width), 1e-2, 1e-2,
                   f"rotated[{i}] heads_width={width}")
  # Negative control: head 1's key at slot 3 of row 1 (attended) scaled.
  shape = rs.TEST_SHAPES[0]
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  q, k, v, lens = rs.make_inputs(shape, jax.random.key(799))
  ref, _ = ragged_attention_reference(q, k, v, lens, out_dtype=F32, **w)
  ko = shape.k_widths[0]
  with interpreted_launch():
    out, _ = ragged_attention_triton(q, k.at[1, 3, ko:ko + shape.k_widths[1]].multiply(40.0), v,
                                     lens, out_dtype=F32, block_s=16, **w)
  closeness.assert_differs(out, ref, 1e-2, 1e-2, "rotated corrupted key slot",
                           "rotated: a corrupted key slot went unnoticed")


def check_rotated_epilogue():
  """The ragged kernels' records and combine as Triton launches (`triton_records`,
  `triton_combine`) vs their jnp references (`triton_ragged.records`, `combine_heads`): records
  bit for bit over every `TEST_SHAPES` shape and chunking, with ragged lengths, ties, empty rows
  and lengths past the capacity; the combine on seeded partials with empty chunks and an
  empty row, packed and per-head layouts, float32 and bf16 outputs. Negative controls: one
  length off by one changes the records; one chunk's LSE dropped moves the combine."""
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import shapes as rs  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import triton_combine, triton_records  # pylint: disable=C0415
  from kvlowrank_kernels.rotated.triton_plan import plan  # pylint: disable=C0415
  from kvlowrank_kernels.rotated.triton_ragged import combine_heads, records  # pylint: disable=C0415
  options = (dict(block_s=16), dict(block_s=16, target_chunks=20, group_width=16),
             dict(block_s=32, target_chunks=5, group_width=64), dict(block_s=16, chunk_tokens=32))
  rng = np.random.default_rng(1100)
  # The last shape sorts hundreds of row tasks (NP = 512, the counting ranks' scale).
  many = rs.RaggedShape(batch=6, capacity=4000, groups=4, k_widths=(32, 16, 48),
                        v_widths=(16, 48, 32), head_dim=64)
  for i, shape in enumerate(rs.TEST_SHAPES + (many,)):
    if shape is many:
      options = (dict(block_s=16, target_chunks=1500, group_width=16),)
    q_shape = (shape.batch, shape.groups, sum(shape.k_widths))
    cases = [ds.ragged_lengths(shape.batch, shape.capacity, np.random.default_rng(1100 + i)),
             np.full((shape.batch,), shape.capacity, np.int32)]        # ties everywhere
    cases.append(cases[0].copy())
    cases[2][0], cases[2][-1] = 0, shape.capacity + 7                  # empty, past the end
    for opts in options:
      p = plan(q_shape, shape.capacity, shape.k_widths, shape.v_widths, jnp.bfloat16, **opts)
      for lens in cases:
        lens = jnp.asarray(lens, jnp.int32)
        with interpreted_launch():
          got = triton_records.rows_records(p, lens)
        want = records(p, lens, "rows")
        if not np.array_equal(np.asarray(got), np.asarray(want)):
          raise AssertionError(f"records[{i}] {opts} lens={np.asarray(lens)}: "
                               f"{np.argwhere(np.asarray(got) != np.asarray(want))[:4]}")
        if shape is many:   # ranks counted over several blocks of row tasks
          rc, triton_records.RC = triton_records.RC, 64
          with interpreted_launch():
            got = triton_records.rows_records(p, lens)
          triton_records.RC = rc
          assert np.array_equal(np.asarray(got), np.asarray(want)), f"records[{i}] RC=64"
      print(f"records[{i}] {opts}: equal ({p.total_chunks} records)")
      c = p.constexprs
      o = jnp.asarray(rng.standard_normal((p.total_chunks, c["G"], c["VW"])), jnp.float32)
      lse = rng.standard_normal((p.total_chunks, c["GP"])) * 3
      lse[rng.random(lse.shape) < 0.2] = -np.inf                       # empty chunks
      lse = lse.reshape(p.batch, p.n_chunks, p.n_groups, c["GP"])
      lse[0] = -np.inf                                                 # a row with no key
      lse = jnp.asarray(lse.reshape(p.total_chunks, c["GP"]), jnp.float32)
      for width, dt in ((None, F32), (max(shape.v_widths) + 16, F32),
                        (max(shape.v_widths), jnp.bfloat16)):
        with interpreted_launch():
          out, tot = triton_combine.combine_heads_triton(o, lse, p, dt, width)
        ref, ref_tot = combine_heads(o, lse, p, dt, width)
        assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape)
        tol = 1e-6 if dt == F32 else 8e-3
        assert_close(out.astype(F32), ref.astype(F32), tol, tol, f"combine[{i}] {opts} {width}")
        assert_close(tot, ref_tot, 1e-6, 1e-6, f"combine[{i}] {opts} {width} lse")
      if shape is many:   # chunks merged over several loop steps (the online rescale)
        elements, triton_combine.ELEMENTS = triton_combine.ELEMENTS, 256
        with interpreted_launch():
          out, tot = triton_combine.combine_heads_triton(o, lse, p, F32, None)
        triton_combine.ELEMENTS = elements
        ref, ref_tot = combine_heads(o, lse, p, F32, None)
        assert_close(out, ref, 1e-6, 1e-6, f"combine[{i}] {opts} in blocks of 2 chunks")
        assert_close(tot, ref_tot, 1e-6, 1e-6, f"combine[{i}] {opts} in blocks of 2 chunks lse")
  shape = rs.TEST_SHAPES[0]
  p = plan((shape.batch, shape.groups, sum(shape.k_widths)), shape.capacity, shape.k_widths,
           shape.v_widths, jnp.bfloat16, block_s=16)
  lens = jnp.asarray([100, 37, 150], jnp.int32)
  with interpreted_launch():
    got = triton_records.rows_records(p, lens)
  if np.array_equal(np.asarray(got), np.asarray(records(p, lens.at[1].add(1), "rows"))):
    raise AssertionError("records: a length off by one went unnoticed")
  c = p.constexprs
  o = jnp.asarray(rng.standard_normal((p.total_chunks, c["G"], c["VW"])), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((p.total_chunks, c["GP"])), jnp.float32)
  with interpreted_launch():
    out, _ = triton_combine.combine_heads_triton(o, lse, p, F32)
  ref, _ = combine_heads(o, lse.at[p.n_groups].set(-jnp.inf), p, F32)
  closeness.assert_differs(out, ref, 1e-4, 1e-4, "combine with a chunk dropped",
                           "combine: a dropped chunk went unnoticed")


def check_rotated_quantized():
  """The ragged kernel reading planar KIVI codes (`triton_ragged_quant`, the quantized
  rotated cache's store) vs the reference on the dequantized store: every `TEST_SHAPES`
  shape and one with 32-byte key planes (capacity rounded up to 32), 4- and 2-bit codes,
  bf16 and fp16 scales, ragged lengths incl. 0, three launch knob sets, the per-head output; negative
  control: flipped key codes of an attended slot move the output."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.dense import shapes as ds  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import planar  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import shapes as rs, to_heads  # pylint: disable=C0415
  from kvlowrank_kernels.rotated.reference import ragged_attention_reference  # pylint: disable=C0415
  from kvlowrank_kernels.rotated.triton_ragged_quant import ragged_attention_quantized_triton  # pylint: disable=C0415
  # TEST_SHAPES store plane widths 4-16; the fifth shape's 128 channels give CW = 32 keys.
  extra = rs.RaggedShape(2, 160, 2, (64, 48, 16), (16, 64, 48), 64)
  for i, shape in enumerate(rs.TEST_SHAPES + (extra,)):
    cap = -(-shape.capacity // 32) * 32
    lens = ds.ragged_lengths(shape.batch, cap, np.random.default_rng(900 + i))
    if i == 0:
      lens[0] = 0
    q, k, v, lens = rs.make_inputs(rs.RaggedShape(shape.batch, cap, shape.groups, shape.k_widths,
                                                  shape.v_widths, shape.head_dim),
                                   jax.random.key(900 + i), lengths=lens)
    for bits, sdt in ((4, None), (2, None), (4, jnp.float16)):
      kq = planar.quantize_keys(k[:, :, None], bits, 16, scale_dtype=sdt)
      vq = planar.quantize_values(v[:, :, None], bits, 16, scale_dtype=sdt)
      kh = planar.dequantize_keys(kq, sum(shape.k_widths))[:, :, 0].astype(jnp.bfloat16)
      vh = planar.dequantize_values(vq, sum(shape.v_widths))[:, :, 0].astype(jnp.bfloat16)
      w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
      ref, ref_lse = ragged_attention_reference(q, kh, vh, lens, out_dtype=F32, **w)
      for opts in (dict(block_s=16), dict(block_s=16, group_width=16, schedule="static"),
                   dict(block_s=32, target_chunks=5, group_width=64)):
        with interpreted_launch():
          out, lse = ragged_attention_quantized_triton(q, kq, vq, lens, out_dtype=F32,
                                                       poison=True, **w, **opts)
        tag = f"quant[{i}] bits={bits} scales={jnp.dtype(kq.scale.dtype).name} {opts}"
        assert_close(out, ref, 1e-2, 1e-2, f"{tag} out")
        assert_close(lse, ref_lse, 1e-2, 1e-3, f"{tag} lse")
      width = max(shape.v_widths) + 16
      with interpreted_launch():
        heads, _ = ragged_attention_quantized_triton(q, kq, vq, lens, out_dtype=F32, block_s=16,
                                                     heads_width=width, **w)
      assert_close(heads, to_heads(ref, shape.v_widths, width), 1e-2, 1e-2, f"quant[{i}] heads")
  # Negative control: one key code byte flipped in an attended slot of row 1.
  shape = rs.TEST_SHAPES[0]
  cap = 224
  q, k, v, lens = rs.make_inputs(rs.RaggedShape(shape.batch, cap, shape.groups, shape.k_widths,
                                                shape.v_widths, shape.head_dim), jax.random.key(7))
  kq = planar.quantize_keys(k[:, :, None], 4, 16)
  vq = planar.quantize_values(v[:, :, None], 4, 16)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  with interpreted_launch():
    good, _ = ragged_attention_quantized_triton(q, kq, vq, lens, out_dtype=F32, block_s=16, **w)
  bad_codes = kq.codes.at[1, 0, 3, :].set(jnp.uint8(0xFF) - kq.codes[1, 0, 3, :])
  with interpreted_launch():
    bad, _ = ragged_attention_quantized_triton(q, dataclasses.replace(kq, codes=bad_codes), vq,
                                               lens, out_dtype=F32, block_s=16, **w)
  diff = float(jnp.max(jnp.abs(bad - good)))
  assert diff > 1e-2, diff
  print(f"negative control: flipped codes move the output by {diff:.3g}")


def check_kivi_update():
  """The fused decode update vs the cache's jnp update on XLA:CPU (recip=True: XLA:CPU's
  division, `triton_update`), warp and planar layouts, step by step from ragged prefills
  (`kivi_update_cases`: block completion, store-block crossings, R not yet reached, padding);
  then a negative control (one row's key perturbed must break the equality)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import kivi_update_cases as kc  # pylint: disable=import-outside-toplevel
  from kvlowrank.cache.base import new_lengths  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi.triton_update import decode_update_triton  # pylint: disable=import-outside-toplevel

  def fused(cache, inp, pos):  # as `KiviCache._fused_decode_update`, with XLA:CPU's division
    l1 = new_lengths(cache.lens, jnp.asarray(pos)[:, None])
    with interpreted_launch():
      st, k_res, v_res, k_stage = decode_update_triton(
          cache.store, cache.k_res, cache.v_res, cache.k_stage, l1, jnp.asarray(pos),
          inp.k[:, 0], inp.v[:, 0], residual=cache.residual, recip=True)
    return dataclasses.replace(cache, store=st, k_res=k_res, v_res=v_res, k_stage=k_stage,
                               lens=l1)

  # (layout, key bits, value bits, group, scale dtype, key width, value width): the warp
  # layout, then the planar one (`triton_update_planar`) at the bit widths it writes, a group
  # of 64, fp32 scales, and FDC/ZACK's inner cache (one "head" of widths that are not powers
  # of two, values narrower than keys, groups of 16)
  cases = [("warp", 2, 2, 32, "float16", 128, 128), ("warp", 2, 2, 32, "bfloat16", 128, 128),
           ("planar", 4, 4, 32, "float16", 128, 128), ("planar", 2, 2, 32, "bfloat16", 128, 128),
           ("planar", 4, 2, 64, "float32", 128, 128), ("planar", 8, 4, 32, "float16", 128, 128),
           ("planar", 4, 4, 16, "float16", 208, 80), ("planar", 2, 2, 16, "bfloat16", 48, 112)]
  for layout, bits, v_bits, group, scale_dtype, hk, hv in cases:
    tag = f"{layout} {bits}/{v_bits}-bit G={group} {scale_dtype} {hk}/{hv} wide"
    ref = got = kc.prefilled(0, starts=(62, 5, 126, 40, 511, 190), scale_dtype=scale_dtype,
                             layout=layout, bits=bits, v_bits=v_bits, group=group,
                             head_dim=hk, v_head_dim=hv)
    for step in range(4):
      pos = kc.step_positions(ref, pad_rows=(3,) if step == 1 else ())
      inp = kc.inputs(100 + step, pos[:, None], widths=(hk, hv))
      ref = ref._decode_update(inp, jnp.asarray(pos))  # pylint: disable=protected-access
      got = fused(got, inp, pos)
      kc.compare(got, ref, f"kivi update {tag} step {step}")
      print(f"kivi update {tag} step {step}: equal (lens {np.asarray(got.lens)})")
    pos = kc.step_positions(ref)
    inp = kc.inputs(200, pos[:, None], widths=(hk, hv))
    want = ref._decode_update(inp, jnp.asarray(pos))  # pylint: disable=protected-access
    bad = dataclasses.replace(inp, k=inp.k.at[0, 0, 1, 7].add(4.0))
    try:
      kc.compare(fused(got, bad, pos), want, f"kivi update {tag}, perturbed key")
    except AssertionError as e:
      print(f"negative control failed as it must: {str(e)[:200]}")
    else:
      raise AssertionError(f"kivi update {tag}: a perturbed key went unnoticed")
    # the value that leaves the window this step (row 0: position pos - R >= 0), perturbed in
    # the ring before the update: its codes must change (the value path's negative control)
    assert pos[0] - ref.residual >= 0, pos
    slot = int(pos[0]) % ref.flush_block
    bad_ring = dataclasses.replace(got, v_res=got.v_res.at[0, slot, 0, 7].add(3.0))
    try:
      kc.compare(fused(bad_ring, inp, pos), want, f"kivi update {tag}, perturbed old value")
    except AssertionError as e:
      if "store" not in str(e):
        raise
      print(f"value negative control failed as it must: {str(e)[:200]}")
    else:
      raise AssertionError(f"kivi update {tag}: a perturbed leaving value went unnoticed")


def check_kivi_window():
  """The Mosaic KIVI epilogue (window attention + split merge in one launch) vs its XLA
  reference (`mosaic_ring.merge_with_window`, "xla"): GQA 4 and MHA, windows full / partial /
  empty, splits with empty (-inf) partials; then a negative control (a perturbed window
  value must show)."""
  from kvlowrank_kernels.kivi.mosaic_ring import merge_with_window, query_operand  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi.triton_window import window_merge_triton  # pylint: disable=import-outside-toplevel

  def inputs(seed, b, kh, qpk, w, parts, np_=8):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, kh * qpk, 128)).astype(jnp.bfloat16)
    o_t = jax.random.normal(ks[1], (b * kh, parts, 128, np_))
    lse_t = 3.0 * jax.random.normal(ks[2], (b * kh, parts, np_))
    lse_t = lse_t.at[0, -1].set(-jnp.inf).at[-1, 0].set(-jnp.inf)
    k_win = jax.random.normal(ks[3], (b, w, kh, 128)).astype(jnp.bfloat16)
    v_win = jax.random.normal(ks[4], (b, w, kh, 128)).astype(jnp.bfloat16)
    w_len = jnp.asarray(([w, 0, w // 2 + 1] * b)[:b], jnp.int32)
    p = dict(kh=kh, qpk=qpk, np=np_)
    # the kernel's query operand, in fp16 (the scales' type) while the window is bf16
    qt = query_operand(q, p, "float16")
    return (q, qt, o_t, lse_t, parts, p, k_win, v_win, w_len)

  def fused(args):
    with interpreted_launch():
      return window_merge_triton(args[0].shape, *args[1:], scale=None, out_dtype=F32)

  for i, (b, kh, qpk, w, parts) in enumerate(((3, 2, 4, 32, 3), (2, 4, 1, 16, 1))):
    args = inputs(600 + i, b, kh, qpk, w, parts)
    ref, ref_lse = merge_with_window(*args, scale=None, out_dtype=F32,
                                     window_implementation="xla", return_partials=False)
    out, lse = fused(args)
    assert_close(out, ref, 2e-3, 2e-3, f"kivi window[{i}] out")
    assert_close(lse, ref_lse, 1e-4, 1e-4, f"kivi window[{i}] lse")
  args = inputs(600, 3, 2, 4, 32, 3)
  ref, _ = merge_with_window(*args, scale=None, out_dtype=F32, window_implementation="xla",
                             return_partials=False)
  bad = args[:7] + (args[7].at[0, 3, 1, 9].add(20.0),) + args[8:]
  closeness.assert_differs(fused(bad)[0], ref, 2e-3, 2e-3, "kivi window, perturbed value",
                           "kivi window: a perturbed window value went unnoticed")

CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items()
          if name.startswith("check_") and callable(fn)}

if __name__ == "__main__":
  if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
    sys.exit(f"usage: interpret_checks.py {{{'|'.join(CHECKS)}}}")
  CHECKS[sys.argv[1]]()
