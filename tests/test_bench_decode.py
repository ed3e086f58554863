"""The whole-model decode benchmark's library function on a tiny model (CPU): records with
consistent bytes and times, the table, skips; the GPU numbers are in BENCHMARKS.md."""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank.bench import decode
from kvlowrank.spec import ModelSpec

TINY = ModelSpec(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=128,
                 ffn_dim=64, max_seq_len=512)


def test_records_bytes_and_table():
  res = decode.run(TINY, methods=["dense", "kivi2", "palu50"], configs=[(1024, 2)], steps=2,
                   log=lambda s: None)
  recs = {r["method"]: r for r in res["records"]}
  assert set(recs) == {"dense", "KIVI-2", "Palu-50%"}
  for r in recs.values():
    assert r["cache_nbytes"] == r["cache_device_bytes"]      # nbytes() = what is allocated
    assert r["tokens_per_s"] == pytest.approx(2 / (r["step_ms"] / 1e3))
    assert r["step_ms"] > 0 and r["attention_ms"] > 0
  # KIVI-2 stores 2-bit codes: several times fewer bytes than the bf16 dense cache.
  assert recs["KIVI-2"]["cache_nbytes"] < recs["dense"]["cache_nbytes"] / 2
  rows = decode.speedups(res)
  assert [r["vs_dense"] for r in rows if r["method"] == "dense"] == [1.0]
  table = decode.table(res)
  assert table.count("\n") == 4 and "KIVI-2" in table


def test_skips_and_errors():
  res = decode.run(TINY, methods=["dense"], configs=[(128, 1)], steps=1, time_budget_s=0.0,
                   log=lambda s: None)
  assert res["records"] == [] and res["skipped"][0]["why"] == "time budget"
  assert not decode.fits(1e9, 32768, 8, 10 << 30, 80 << 30)       # 256 TB of cache
  assert decode.fits(1e3, 32768, 8, 10 << 30, 80 << 30)
  # The protocol's Llama-2 batch: dense's largest at 32K, 7 rows, allocated and run on an
  # H200 (decode_l2_dense_maxbatch_h200_2026-11-30.json: bf16 K and V, 32 layers x 32 heads
  # x 128, the run's weight bytes and allocator limit), is a configuration that runs; 8 is not.
  per_token, weights, limit = 32 * 32 * 128 * 2 * 2, 13476831232, 141104775168
  assert decode.fits(per_token, 32768, 7, weights, limit)
  assert not decode.fits(per_token, 32768, 8, weights, limit)
  with pytest.raises(ValueError, match="unknown methods"):
    decode.run(TINY, methods=["kivi9"], configs=[(128, 1)])
  with pytest.raises(ValueError, match="model must be one of"):
    decode.run("llama9", methods=["dense"], configs=[(128, 1)])


def test_random_params_shapes_and_fill():
  m = decode.METHODS["palu50"]
  params = decode.random_params(TINY, decode.jax.random.key(0), m)
  lp = params["layers"][0]
  # 4 KV heads = one G-LRD group of 512 channels: key rank 128, value rank 384.
  assert lp["palu_bk"].shape == (1, 128, 512) and lp["palu_bv"].shape == (1, 384, 512)
  # r_v = 384 > H = 128: W_o keeps its shape (PaluSpec.value_fold "auto"); "always" folds.
  assert lp["wo"].shape == (4 * 128, 64) and lp["wq"].dtype == jnp.bfloat16
  always = dataclasses.replace(m, spec=m.spec.replace(value_fold="always"))
  folded = decode.random_params(TINY, decode.jax.random.key(0), always)["layers"][0]
  assert folded["wo"].shape == (4 * 384, 64)
  caches = decode.init_caches("kivi", decode.METHODS["kivi2"].spec, TINY, params, batch=1,
                              capacity=256)
  filled = decode.fill_caches(caches, decode.jax.random.key(1), 200)
  assert int(filled[0].lens[0]) == 200


def test_profile_records_ops_by_category():
  res = decode.run(TINY, methods=["dense"], configs=[(256, 1)], steps=2, profile=True,
                   log=lambda s: None)
  prof = res["records"][0]["step_ops"]
  assert prof["total_s"] > 0 and prof["ops"]
  assert sum(prof["categories"].values()) == pytest.approx(prof["total_s"])
  # The compute stream's busy time: at most the ops' summed time (all streams / threads).
  assert 0 < prof["stream_busy_s"] <= prof["total_s"] * (1 + 1e-9)
  assert all(o["launches"] > 0 for o in prof["ops"])
  # The categories come from the HLO op / kernel names; a cuDNN / Triton call is attention,
  # a cuBLAS GEMM is a matmul even when XLA runs it as a custom call.
  assert decode.ops.category("custom-call.3", "triton_ragged_kernel") == (
      "custom call (attention kernels)")
  assert decode.ops.category("custom-call.4", "sm90_xmma_gemm_bf16") == "matmul"
  # As the H100 trace names them (jax-triton's and Mosaic GPU's custom calls).
  for op, kernel in (("triton_kernel_call.534", "ragged_kernel"),
                     ("entry_mosaic_gpu_kernel", "entry_mosaic_gpu_kernel")):
    assert decode.ops.category(op, kernel) == "custom call (attention kernels)"
  assert decode.ops.category("loop_add_fusion") == "other fusion"
  # Inside a command buffer (a CUDA graph) a Triton launch's op is the buffer: its kernel
  # name files it; an XLA fusion in the same buffer stays a fusion (negative control).
  assert decode.ops.category("command_buffer.3", "_window_merge_kernel") == (
      "custom call (attention kernels)")
  assert decode.ops.category("command_buffer.3", "loop_add_fusion") == "other fusion"
  # A mesh's all-reduces are collectives, not reduction fusions (their names hold "reduce").
  for op, kernel in (("all-reduce-start.3", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
                     ("all-reduce.12", ""), ("all-gather-start", ""),
                     ("psum.456.0-fusion.1", "psum_456_0_fusion_1")):
    assert decode.ops.category(op, kernel) == "collective (all-reduce / all-gather)"
  assert decode.ops.category("input_reduce_fusion") == "reduction fusion"
  assert decode.ops.category("loop_reduce_fusion.7", "cumsum_fusion") == "reduction fusion"
  assert "profile" not in res["records"][0] and decode.run(
      TINY, methods=["dense"], configs=[(256, 1)], steps=2,
      log=lambda s: None)["records"][0]["step_ops"] is None


def _plane(name, ops_ns):
  ev = lambda op, ns: types.SimpleNamespace(name=op, stats=[("hlo_op", op)], duration_ns=ns,
                                            start_ns=0.0)
  return types.SimpleNamespace(name=name, lines=[
      types.SimpleNamespace(name="Stream #1", events=[ev(o, ns) for o, ns in ops_ns]),
      types.SimpleNamespace(name="XLA Ops", events=[ev("summary", 1e9)])])


def test_profile_events_count_one_gpu_of_a_mesh():
  """Several GPUs (a mesh): only GPU 0's kernels count, whatever the planes' order; one GPU
  and other device planes as before; no device plane: the host's threads."""
  # GPU 0 is listed third: taking the first plane would give 40 ns, all of them 100.
  events = lambda planes: list(decode.ops._events(types.SimpleNamespace(planes=planes)))
  ev3 = lambda planes: [e[:3] for e in events(planes)]
  mesh = events([_plane(f"/device:GPU:{i}", [("fusion", 10.0 * (i + 1))]) for i in (3, 1, 0, 2)])
  assert [e[:3] for e in mesh] == [("fusion", "fusion", 10.0)]
  assert [e[4] for e in mesh] == [("/device:GPU:0", "Stream #1")]
  one = [_plane("/device:GPU:0", [("fusion", 5.0)]), _plane("/device:CUSTOM:0", [("x", 1.0)])]
  assert sorted(ev3(one)) == [("fusion", "fusion", 5.0), ("x", "x", 1.0)]
  host = [_plane("/host:CPU", [("dot", 2.0)])]
  got = ev3(host)
  assert ("dot", "dot", 2.0) in got and ("summary", "summary", 1e9) in got


def test_stream_busy_is_the_union_of_the_ops_intervals():
  """Overlapping, nested, touching and separate intervals against a brute-force count of
  the covered integer points; the sum of the durations (what `total_s` adds) overcounts."""
  rng = np.random.default_rng(0)
  for _ in range(20):
    starts = rng.integers(0, 200, 12)
    spans = [(float(a), float(a + d)) for a, d in zip(starts, rng.integers(0, 40, 12))]
    covered = np.zeros(260, bool)
    for a, b in spans:
      covered[int(a):int(b)] = True
    assert decode.ops._busy_ns(spans) == covered.sum()
  assert decode.ops._busy_ns([(0.0, 10.0), (5.0, 8.0), (10.0, 12.0), (20.0, 21.0)]) == 13.0
  assert sum(b - a for a, b in [(0.0, 10.0), (5.0, 8.0)]) > decode.ops._busy_ns(
      [(0.0, 10.0), (5.0, 8.0)])
  assert decode.ops._busy_ns([]) == 0.0


def test_cross_layer_method_and_max_batch_check():
  """XQuant-CL runs through the same loop (its layers attend inside the cross-layer step, so
  no attention split); the allocation check of a batch reports whether it runs."""
  res = decode.run(TINY, methods=["xquantcl2"], configs=[(256, 2)], steps=2,
                   log=lambda s: None)
  rec = res["records"][0]
  assert rec["method"] == "XQuant-CL-2" and rec["attention_ms"] is None
  assert rec["cache_nbytes"] == rec["cache_device_bytes"] and rec["tokens_per_s"] > 0
  m = decode.METHODS["kivi2"]
  params = decode.random_params(TINY, decode.jax.random.key(0), m)
  ok = decode.check_max_batch(TINY, params, m, 256, 3)
  assert ok["fits"] and ok["batch"] == 3 and ok["tokens_per_s"] > 0
  bad = decode.check_max_batch(TINY, params, m, 256, 0)     # negative control
  assert not bad["fits"] and "batch must be positive" in bad["error"]
  res = dict(res, records=[dict(rec, max_batch_check=ok)])
  assert decode.table(res).splitlines()[-1].endswith(" ✓ |")


def test_max_batch_counts_one_pass_of_temporaries_for_row_sliced_caches():
  """A cache that runs the batch in passes of a few rows (XQuant-CL) holds one pass's
  temporaries: the estimate counts them once, not per sequence. The numbers: 1 GiB of cache
  and 1 GiB of temporaries per row, 100 GiB free after weights and margin."""
  gib = 1 << 30
  rec = dict(batch=8, cache_device_bytes=8 * gib, step_temp_bytes=8 * gib)
  limit, weights = 110 * gib, 8 * gib
  assert decode.max_batch(rec, weights, limit) == 50                  # (1 + 1) GiB per row
  sliced = dict(rec, rows_per_pass=4, step_temp_bytes=4 * gib)        # one pass of 4 rows
  assert decode.max_batch(sliced, weights, limit) == 96               # (100 - 4) / 1
  # Measured below one pass (2 rows of 4): the temporaries of a full pass are twice that.
  small = dict(rec, batch=2, cache_device_bytes=2 * gib, step_temp_bytes=2 * gib,
               rows_per_pass=4)
  assert decode.max_batch(small, weights, limit) == 96
  assert decode.max_batch(dict(sliced, rows_per_pass=None), weights, limit) == 66


def test_max_batch_check_steps_down_to_the_largest_that_runs():
  """An estimate that does not allocate: the check tries one sequence fewer at a time."""
  calls = []

  def fake_run(spec, params, method, context, b, **kw):
    calls.append(b)
    if b > 5:
      raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory at batch {b}")
    return dict(tokens_per_s=100.0 * b, peak_bytes_process=b << 30)

  got = decode.check_max_batch(TINY, None, None, 256, 7, tries=3, run=fake_run)
  assert calls == [7, 6, 5] and got["largest_run"] == 5 and not got["fits"]
  assert [f["batch"] for f in got["failed"]] == [7, 6] and "batch 7" in got["error"]
  assert got["tokens_per_s"] == 500.0
  none = decode.check_max_batch(TINY, None, None, 256, 9, tries=2, run=fake_run)
  assert none["largest_run"] is None and not none["fits"]            # 9, 8: both fail
  # A large estimate a few percent high: after one fewer, 97%, 90%, 75% of it.
  assert decode.step_down(214, 5) == [214, 213, 207, 192, 160]
  assert decode.step_down(2, 5) == [2, 1] and decode.step_down(0, 3) == [0]
  tried = []

  def fits_200(spec, params, method, context, b, **kw):
    tried.append(b)
    if b > 200:
      raise RuntimeError("RESOURCE_EXHAUSTED")
    return dict(tokens_per_s=1.0, peak_bytes_process=0)

  far = decode.check_max_batch(TINY, None, None, 256, 214, run=fits_200)
  assert tried == [214, 213, 207, 192] and far["largest_run"] == 192 and not far["fits"]
  rec = dict(method="KIVI-2", context=256, batch=2, tokens_per_s=1.0, step_ms=2.0,
             attention_ms=None, cache_nbytes=1, cache_device_bytes=1, peak_bytes_est=1,
             max_batch=7, max_batch_check=got)
  res = dict(model="tiny", records=[rec, dict(rec, method="dense", max_batch_check=None)])
  assert " 7 ✗ (5 ✓) |" in decode.table(res)


def test_bytes_per_token_excludes_weights_kept_on_the_cache():
  """XQuant keeps its SVD factors on the cache: the memory pre-check must count them once
  as weights, not once per token (they made XQuant-2 "not fit" at 32K/B=8 on an 80 GB GPU)."""
  m = decode.METHODS["xquant2"]
  gqa = decode.dataclasses.replace(TINY, dim=512, n_kv_heads=1)   # XQuant latent: 2*128 < 512
  params = decode.random_params(gqa, decode.jax.random.key(0), m)
  per_token, kept = decode.bytes_per_token(gqa, params, m, probe=1024)
  caches = decode.init_caches(m.cache, m.spec, gqa, params, batch=1, capacity=1024)
  assert kept == sum(c.weights_nbytes() for c in caches) > 0
  assert per_token * 1024 == decode.storage_bytes(caches) == decode.caches_nbytes(caches)
  assert decode.array_bytes(caches) == per_token * 1024 + kept      # the control: all arrays


def test_progress_saves_every_record_and_survives_a_cut(tmp_path):
  """`on_progress` gets the result so far after each record (complete False; the return
  value is complete); saved with `records.write_json`, a run cut after its first record
  (KeyboardInterrupt from the callback, as a kill would) leaves that record readable."""
  import json
  from kvlowrank.experiment import records
  seen = []
  res = decode.run(TINY, methods=["dense", "kivi2"], configs=[(256, 1)], steps=1,
                   log=lambda s: None, on_progress=lambda r: seen.append(r))
  assert [len(r["records"]) for r in seen] == [1, 2]
  assert [r["complete"] for r in seen] == [False, False] and res["complete"]
  assert [r["method"] for r in res["records"]] == ["dense", "KIVI-2"]
  rec = res["records"][0]
  assert min(rec["setup_s"], rec["compile_s"], rec["timed_s"], rec["attention_timing_s"]) > 0

  out = tmp_path / "cut.json"

  def save_then_die(r):
    records.write_json(out, r)
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    decode.run(TINY, methods=["dense", "kivi2"], configs=[(256, 1)], steps=1,
               log=lambda s: None, on_progress=save_then_die)
  saved = json.loads(out.read_text())
  assert [r["method"] for r in saved["records"]] == ["dense"] and not saved["complete"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.json"]   # no temp file left


def test_plot_panels_show_only_their_batches(tmp_path, monkeypatch):
  """experiments/bench_decode.py --png: one panel per context, each with the batches measured
  at that context (records of two calls, 8K × 8 and 32K × 4, side by side)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench_decode.py"
  spec = importlib.util.spec_from_file_location("bench_decode_launcher", script)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  recs = [dict(method=m, context=c, batch=b, tokens_per_s=t)
          for m, c, b, t in [("dense", 8192, 8, 659.3), ("KIVI-2", 8192, 8, 1045.7),
                             ("dense", 32768, 4, 206.6), ("KIVI-2", 32768, 4, 425.4)]]
  saved = {}
  orig = plt.Figure.savefig
  def keep(fig, path, **kw):  # the axes as drawn, before the figure is written
    saved["ticks"] = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
    saved["bars"] = [[round(p.get_height(), 1) for p in ax.patches] for ax in fig.axes]
    return orig(fig, path, **kw)
  monkeypatch.setattr(plt.Figure, "savefig", keep)
  mod.plot({"model": "llama2-7b", "records": recs}, tmp_path / "p.png")
  assert (tmp_path / "p.png").stat().st_size > 0
  assert saved["ticks"] == [["B=8"], ["B=4"]]  # before: both panels showed B=4 and B=8
  assert saved["bars"] == [[659.3, 1045.7], [206.6, 425.4]]
