"""CPU checks of the ragged-head rotated-cache decode attention (`kvlowrank_kernels.rotated`):
the jnp reference against a float64 numpy oracle, the LPT scheduling against brute force, the
kernel's launch orders and plan, and the dispatcher. The Triton kernel itself runs under the
interpreter (`interpret_checks.check_rotated`) and on the GPU
(`tests/test_rotated_kernel_gpu.py`)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.rotated import ragged_attention, resolve_implementation, triton_fit
from kvlowrank_kernels.rotated import lpt
from kvlowrank_kernels.rotated import shapes as rs
from kvlowrank_kernels.rotated.reference import ragged_attention_reference
from kvlowrank_kernels.rotated.triton_plan import head_groups, plan

F32 = jnp.float32


def oracle(q, k, v, lengths, k_widths, v_widths, scale):
  """float64 numpy: per KV head and query row, softmax over the valid slots."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, g, _ = q.shape
  out = np.zeros((b, g, sum(v_widths)))
  lse = np.full((b, len(k_widths), g), -np.inf)
  ko = np.concatenate([[0], np.cumsum(k_widths)])
  vo = np.concatenate([[0], np.cumsum(v_widths)])
  for bi in range(b):
    n = int(lengths[bi])
    for h in range(len(k_widths)):
      for gi in range(g):
        if n == 0:
          continue
        s = k[bi, :n, ko[h]:ko[h + 1]] @ q[bi, gi, ko[h]:ko[h + 1]] * scale
        m = s.max()
        e = np.exp(s - m)
        out[bi, gi, vo[h]:vo[h + 1]] = e @ v[bi, :n, vo[h]:vo[h + 1]] / e.sum()
        lse[bi, h, gi] = m + np.log(e.sum())
  return out, lse


def case(idx, lengths=None):
  shape = rs.TEST_SHAPES[idx]
  if lengths is None:
    lengths = np.asarray([1, shape.capacity, shape.capacity - 37][:shape.batch], np.int32)
  args = rs.make_inputs(shape, jax.random.key(idx), dtype=F32, lengths=lengths)
  return shape, args


@pytest.mark.parametrize("idx", range(len(rs.TEST_SHAPES)))
def test_reference_matches_float64_oracle(idx):
  shape, (q, k, v, lens) = case(idx)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  out, lse = ragged_attention_reference(q, k, v, lens, **w)
  want, want_lse = oracle(q, k, v, lens, **w)
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=2e-6)


def test_zero_length_and_one_head_equals_dense():
  """A row of length 0 gives 0 and -inf; one head is dense decode attention."""
  shape, (q, k, v, _) = case(0, lengths=np.asarray([0, 5, 0], np.int32))
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  out, lse = ragged_attention_reference(q, k, v, jnp.asarray([0, 5, 0], jnp.int32), **w)
  assert np.all(np.asarray(out)[[0, 2]] == 0) and np.all(np.isneginf(np.asarray(lse)[[0, 2]]))
  from kvlowrank_kernels.dense.reference import decode_attention_reference  # pylint: disable=C0415
  kk = k[..., :32]
  lens = jnp.asarray([3, 7, 9])
  out1, lse1 = ragged_attention_reference(q[..., :32], kk, v[..., :16], lens, k_widths=(32,),
                                          v_widths=(16,), scale=0.2)
  dense, dense_lse = decode_attention_reference(q[..., :32], kk[:, :, None], v[:, :, None, :16],
                                                lens, scale=0.2)
  np.testing.assert_allclose(out1, dense, atol=1e-6)
  np.testing.assert_allclose(lse1[:, 0], dense_lse, atol=1e-6)


def test_negative_control_wrong_head_offsets():
  """Reading every head's slice from offset 0 (uniform-width thinking) must be caught."""
  shape, (q, k, v, lens) = case(0)
  want, _ = oracle(q, k, v, lens, shape.k_widths, shape.v_widths, shape.scale)
  kw = shape.k_widths
  perm = np.concatenate([np.arange(w) for w in kw])             # every head at offset 0
  wrong, _ = ragged_attention_reference(q[..., perm], k[..., perm], v, lens, k_widths=kw,
                                        v_widths=shape.v_widths, scale=shape.scale)
  assert not np.allclose(np.asarray(wrong), want, atol=1e-3)


def test_bad_operands_name_the_field():
  shape, (q, k, v, lens) = case(0)
  w = dict(v_widths=shape.v_widths, scale=shape.scale)
  with pytest.raises(ValueError, match="k_widths"):
    ragged_attention(q, k, v, lens, k_widths=(32, 24, 40), **w)
  with pytest.raises(ValueError, match="q_rot"):
    ragged_attention(q[..., :-16], k, v, lens, k_widths=shape.k_widths, **w)
  with pytest.raises(ValueError, match="lengths"):
    ragged_attention(q, k, v, lens[:2], k_widths=shape.k_widths, **w)


# ----------------------------------------------------------------------------- LPT

def brute_force_greedy(costs, m):
  """Independent LPT: repeatedly the largest remaining task (lowest index on ties) to the
  least-loaded machine (lowest index on ties)."""
  left = list(range(len(costs)))
  loads = [0.0] * m
  assign = [None] * len(costs)
  while left:
    t = max(left, key=lambda i: (costs[i], -i))
    left.remove(t)
    j = min(range(m), key=lambda i: (loads[i], i))
    assign[t] = j
    loads[j] += costs[t]
  return np.asarray(assign), np.asarray(loads)


def optimal_makespan(costs, m):
  best = float("inf")
  for a in itertools.product(range(m), repeat=len(costs)):
    if a and a[0] != 0:      # machine symmetry: the first task on machine 0
      continue
    loads = np.zeros(m)
    np.add.at(loads, list(a), costs)
    best = min(best, loads.max())
  return best


@pytest.mark.parametrize("seed", range(12))
def test_lpt_equals_brute_force_greedy_and_graham_bound(seed):
  rng = np.random.default_rng(seed)
  m = int(rng.integers(2, 4))
  n = int(rng.integers(m + 1, 9))
  costs = rng.integers(1, 20, n).astype(np.float64)
  if seed % 3 == 0:   # (request, head) costs: lengths x widths, with ties
    costs = (rng.choice([64, 96, 128], n) * rng.choice([16, 48, 80], n)).astype(np.float64)
  assign, loads = lpt.lpt_assign(costs, m)
  want_assign, want_loads = brute_force_greedy(list(costs), m)
  np.testing.assert_array_equal(assign, want_assign)
  np.testing.assert_allclose(loads, want_loads)
  opt = optimal_makespan(costs, m)
  assert loads.max() <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9
  # The kernel's dispatch form: the LPT order started on the first slot to free up.
  order = np.argsort(-costs, kind="stable")
  slot, finish = lpt.dispatch(costs[order], m)
  np.testing.assert_array_equal(slot, assign[order])
  np.testing.assert_allclose(finish, loads)


def test_lpt_bound_is_tight_and_a_bad_order_is_worse():
  """Graham's worst case (2m+1 tasks: 2m-1, 2m-1, 2m-2, 2m-2, ..., m, m, m) reaches
  4/3 - 1/(3m) exactly; dispatching the same tasks shortest first is worse (negative control
  for the test above: the bound check can fail)."""
  m = 3
  costs = np.asarray([5, 5, 4, 4, 3, 3, 3], np.float64)
  _, loads = lpt.lpt_assign(costs, m)
  opt = optimal_makespan(costs, m)
  assert opt == 9 and loads.max() == 11
  assert loads.max() == pytest.approx((4 / 3 - 1 / (3 * m)) * opt)
  _, finish = lpt.dispatch(np.sort(costs), m)
  assert finish.max() > (4 / 3 - 1 / (3 * m)) * opt


def test_launch_order_under_jit():
  """lpt: chunk costs (valid tokens x group width) non-increasing, equal to numpy's stable
  sort; rows: every chunk once, row tasks non-increasing; static: identity."""
  lens = jnp.asarray([500, 3, 0, 257], jnp.int32)
  ct, widths = (64, 128, 96), (320, 160, 240)
  f = jax.jit(lambda l, s: lpt.order(s, l, 8, ct, widths), static_argnums=1)
  valid = np.clip(np.asarray(lens)[:, None, None]
                  - np.arange(8)[None, :, None] * np.asarray(ct)[None, None, :], 0,
                  np.asarray(ct)[None, None, :])
  cost = (valid * np.asarray(widths)).reshape(-1)
  got = np.asarray(f(lens, "lpt"))
  np.testing.assert_array_equal(got, np.argsort(-cost, kind="stable"))
  rows = np.asarray(f(lens, "rows"))
  assert sorted(rows.tolist()) == list(range(cost.size))
  row_cost = cost.reshape(-1, 3).sum(-1)[rows // 3]
  assert np.all(np.diff(row_cost) <= 0)
  np.testing.assert_array_equal(np.asarray(f(lens, "static")), np.arange(cost.size))
  with pytest.raises(ValueError, match="schedule"):
    lpt.order("fifo", lens, 8, ct, widths)


@pytest.mark.parametrize("n", [1, 7, 264, lpt.COUNT_SORT_MAX + 5])
def test_descending_is_numpys_stable_sort(n):
  """Counting ranks (and the argsort beyond COUNT_SORT_MAX) == numpy's stable descending
  sort, ties in index order; a random permutation (negative control) is not."""
  keys = np.random.default_rng(n).integers(0, 6, n).astype(np.int32)     # many ties
  got = np.asarray(jax.jit(lpt.descending)(jnp.asarray(keys)))
  np.testing.assert_array_equal(got, np.argsort(-keys, kind="stable"))
  if n > 7:
    assert not np.array_equal(np.random.default_rng(0).permutation(n), got)


def test_heads_layout_is_the_packed_output_per_head():
  """heads_width=W: head h's v_h columns of the packed output, then zeros; a width below
  max(v_widths) is a one-line error naming heads_width."""
  shape, (q, k, v, lens) = case(0)
  w = dict(k_widths=shape.k_widths, v_widths=shape.v_widths, scale=shape.scale)
  out, lse = ragged_attention(q, k, v, lens, **w)
  heads, lse2 = ragged_attention(q, k, v, lens, heads_width=64, **w)
  assert heads.shape == (shape.batch, len(shape.k_widths), shape.groups, 64)
  np.testing.assert_array_equal(lse, lse2)
  for h, (o, vw) in enumerate(zip(np.cumsum((0,) + shape.v_widths[:-1]), shape.v_widths)):
    np.testing.assert_array_equal(heads[:, h, :, :vw], out[..., o:o + vw])
    assert not np.any(heads[:, h, :, vw:])
  with pytest.raises(ValueError, match="heads_width"):
    ragged_attention(q, k, v, lens, heads_width=32, **w)


# ----------------------------------------------------------------------------- plan, dispatch

def test_default_chunks_capped_in_length():
  """The default chunking: DEFAULT_TARGET_CHUNKS chunks in all, more where they would exceed
  MAX_CHUNK_TOKENS, at least MIN_TILES tiles each; an explicit target_chunks has no cap."""
  from kvlowrank_kernels.rotated import triton_plan as tp  # pylint: disable=C0415
  kw = vw = (64,) * 8                     # Llama-3 layer: 8 KV heads, G = 4 -> 2 head groups
  # (batch, capacity) -> chunk tokens. Batch 8: 792 / 16 tasks = 50 chunks per task (6 and 11
  # tiles). Batch 28: 792 / 56 = 15 would make 1152- and 2240-token chunks; the cap makes 1024.
  # 4K x 1: 792 chunks capped at 4 tiles each.
  for b, s, ct in [(8, 16384, 384), (8, 32768, 704), (28, 16384, 1024), (28, 32768, 1024),
                   (1, 4096, 256)]:
    p = plan((b, 4, sum(kw)), s, kw, vw, jnp.bfloat16)
    assert p.n_groups == 2 and p.chunk_tokens == (ct, ct), (b, s, p.chunk_tokens)
    assert p.n_chunks == -(-s // ct)
    assert tp.MIN_TILES * p.block_s <= ct <= tp.MAX_CHUNK_TOKENS
  # the model's capacity rounds up (32K + 256): 33 chunks of 1024 tokens at batch 28
  p = plan((28, 4, 512), 33024, kw, vw, jnp.bfloat16)
  assert p.chunk_tokens == (1024, 1024) and p.n_chunks == 33
  # an explicit total has no length cap: 396 / 56 tasks -> 8 chunks of 4096 tokens
  assert plan((28, 4, 512), 32768, kw, vw, jnp.bfloat16,
              target_chunks=396).chunk_tokens == (4096, 4096)


def test_plan_groups_and_chunk_sizes():
  kw, vw = (80, 64, 80, 64, 48, 48, 32, 96), (80, 48, 48, 96, 80, 96, 32, 32)
  common = plan((8, 4, sum(kw)), 16384, kw, vw, jnp.bfloat16, target_chunks=396)
  assert len(set(common.chunk_tokens)) == 1 and common.total_chunks == 8 * 3 * common.n_chunks
  assert common.n_chunks == -(-16384 // common.chunk_tokens[0]) >= 396 // 24
  assert common.head_groups == head_groups(kw, vw, 4) == ((0, 1, 2), (3, 4), (5, 6, 7))
  assert all(len(grp) * 4 <= 16 for grp in common.head_groups)
  weight_row, packed, lse = common.output_index()
  c = common.constexprs
  assert len(set(packed.reshape(-1).tolist())) == packed.size == 4 * sum(vw)  # one source each
  assert packed.max() < common.n_groups * 4 * c["VW"]
  assert len(set(lse.reshape(-1).tolist())) == 32
  for i, grp in enumerate(common.head_groups):                    # query g: a row j*G + g
    gv = sum(vw[h] for h in grp)
    assert np.all(weight_row[i, :, :gv] % 4 == np.arange(4)[:, None])
    assert np.all(weight_row[i, :, :gv] // 4 < len(grp))
  heads = common.heads_index(96)
  assert heads.shape == (8, 4, 96) and np.all(heads[0, :, 80:] == common.n_groups * 4 * c["VW"])


def test_triton_fit_and_dispatcher_without_gpu():
  kw, vw = (64, 48), (32, 80)
  assert triton_fit((2, 4, 112), kw, vw, jnp.bfloat16, 4096) is None
  assert "float32" in triton_fit((2, 4, 112), kw, vw, jnp.float32)
  assert "k_widths" in triton_fit((2, 4, 112), (64, 40), vw, jnp.bfloat16)
  assert "q_rot" in triton_fit((2, 4, 100), kw, vw, jnp.bfloat16)
  assert "k_widths" in triton_fit((2, 4, 336), (64, 272), vw, jnp.bfloat16)
  if jax.default_backend() != "gpu":
    assert resolve_implementation(None, args=((2, 4, 112), kw, vw, jnp.bfloat16, 64)) == \
        "reference"
    shape, (q, k, v, lens) = case(1)
    with pytest.warns(UserWarning, match="unavailable"):
      out, _ = ragged_attention(q, k, v, lens, k_widths=shape.k_widths, v_widths=shape.v_widths,
                                scale=shape.scale, implementation="triton")
    ref, _ = ragged_attention_reference(q, k, v, lens, k_widths=shape.k_widths,
                                        v_widths=shape.v_widths, scale=shape.scale)
    np.testing.assert_array_equal(out, ref)


def test_quantized_fit_names_the_field_and_the_reference_dequantizes():
  """`quantized_fit`: None for the store the codes kernel reads (2/4 bits, groups of 16,
  16-bit scales, the widths' sums as its channels), else one line naming what is off; the
  reference of `ragged_attention_quantized` equals the bf16 reference on the store
  dequantized (`kivi.planar`), and a flipped code row moves it (negative control)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import planar  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.rotated import quantized_fit, ragged_attention_quantized  # pylint: disable=C0415
  shape, (q, k, v, lens) = case(0)
  kw, vw = shape.k_widths, shape.v_widths
  cap = -(-k.shape[1] // 32) * 32
  k = jnp.pad(k, ((0, 0), (0, cap - k.shape[1]), (0, 0)))
  v = jnp.pad(v, ((0, 0), (0, cap - v.shape[1]), (0, 0)))
  store = lambda bits, group, sdt=None: (planar.quantize_keys(k[:, :, None], bits, group, sdt),
                                         planar.quantize_values(v[:, :, None], bits, group, sdt))
  kq, vq = store(4, 16, jnp.float16)
  qs = (q.shape[0], q.shape[1], sum(kw))
  assert quantized_fit(qs, kq, vq, kw, vw, jnp.bfloat16) is None
  assert "float32" in quantized_fit(qs, kq, vq, kw, vw, jnp.float32)
  assert "bits" in quantized_fit(qs, *store(8, 16, jnp.float16), kw, vw, jnp.bfloat16)
  assert "group_size" in quantized_fit(qs, *store(4, 8, jnp.float16), kw, vw, jnp.bfloat16)
  assert "keys.scale" in quantized_fit(qs, *store(4, 16, jnp.float32), kw, vw, jnp.bfloat16)
  assert "widths sum" in quantized_fit(qs, kq, vq, kw[:-1] + (kw[-1] + 16,), vw, jnp.bfloat16)
  w = dict(k_widths=kw, v_widths=vw, scale=shape.scale)
  out, lse = ragged_attention_quantized(q, kq, vq, lens, implementation="reference", **w)
  kh = planar.dequantize_keys(kq, sum(kw))[:, :, 0].astype(q.dtype)
  vh = planar.dequantize_values(vq, sum(vw))[:, :, 0].astype(q.dtype)
  ref, ref_lse = ragged_attention_reference(q, kh, vh, lens, **w)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_array_equal(lse, ref_lse)
  bad = dataclasses.replace(kq, codes=kq.codes.at[1].set(255 - kq.codes[1]))
  moved, _ = ragged_attention_quantized(q, bad, vq, lens, implementation="reference", **w)
  assert float(jnp.max(jnp.abs(moved - out))) > 1e-2


def test_head_table_and_records_fit():
  """The one-launch combine's head table agrees with the XLA combine's index tables
  (`output_index`): each head's LSE rows and packed output columns; the one-launch records
  take the "rows" order with one chunk size only, up to the row-task bound."""
  shape = rs.TEST_SHAPES[0]
  for gw in (16, 64, 256):
    p = plan((shape.batch, shape.groups, sum(shape.k_widths)), shape.capacity, shape.k_widths,
             shape.v_widths, jnp.bfloat16, block_s=16, group_width=gw)
    tab = p.head_table()
    _, packed, lse_idx = p.output_index()
    gp, vw = p.constexprs["GP"], p.constexprs["VW"]
    for h, (grp, row0, vlo, width, off) in enumerate(tab):
      assert width == shape.v_widths[h]
      np.testing.assert_array_equal(lse_idx[h], grp * gp + row0 + np.arange(shape.groups))
      want = (grp * shape.groups + np.arange(shape.groups))[:, None] * vw + vlo + np.arange(width)
      np.testing.assert_array_equal(packed[:, off:off + width], want)
    assert p.records_fit("rows", 2048)
    assert not p.records_fit("lpt", 2048) and not p.records_fit("static", 2048)
    assert not p.records_fit("rows", p.batch * p.n_chunks - 1)


def test_bad_epilogue_names_the_field():
  from kvlowrank_kernels.rotated.triton_plan import check_epilogue  # pylint: disable=C0415
  for good in ("triton", "xla"):
    check_epilogue(good)
  with pytest.raises(ValueError, match="epilogue must be one of"):
    check_epilogue("jnp")
