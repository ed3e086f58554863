"""GEAR decode attention (`kvlowrank_kernels.gear`) on the CPU.

* the jnp reference against a float64 numpy oracle: dense attention over K~ = D^ + S + A B^T,
  V~ likewise (materialised here only), concatenated with the exact window; negative
  controls (a dropped chunk factor, moved outliers) must fail the same check;
* contract errors name the field; `triton_fit` answers without Triton;
* the Triton kernel under the interpreter (`gear_interpret_checks.py`, subprocess);
* with its GEAR flags off the kernel compiles (sm_90 PTX, no GPU needed) to the KIVI kernel's
  instructions.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvlowrank_kernels.gear import gear_attention, shapes, triton_fit
from kvlowrank_kernels.gear.reference import gear_attention_reference
from kvlowrank_kernels.kivi.planar import dequantize_keys, dequantize_values

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_TRITON = (importlib.util.find_spec("triton") is not None
               and importlib.util.find_spec("torch") is not None)


def oracle(args, lowrank, sparse_k, sparse_v):
  """float64 dense attention over the materialised K~, V~ and the window: (out, lse)."""
  q, keys, values, k_win, v_win, q_len, w_len = args
  b, n, h = q.shape
  _, kh, s, _ = keys.codes.shape
  k = np.asarray(dequantize_keys(keys, h), np.float64)  # [B, S, K, H]
  v = np.asarray(dequantize_values(values, h), np.float64)
  if sparse_k is not None:
    idx = np.asarray(sparse_k.idx).astype(np.int64)  # [B, K, C, NK, H]
    val = np.asarray(sparse_k.val, np.float64)
    nb = s // idx.shape[2]
    for bi, ki, ci, j, ch in np.ndindex(*idx.shape):
      k[bi, ci * nb + idx[bi, ki, ci, j, ch], ki, ch] += val[bi, ki, ci, j, ch]
  if sparse_v is not None:
    idx = np.asarray(sparse_v.idx).astype(np.int64)  # [B, K, S, NV]
    val = np.asarray(sparse_v.val, np.float64)
    for bi, ki, t, j in np.ndindex(*idx.shape):
      v[bi, t, ki, idx[bi, ki, t, j]] += val[bi, ki, t, j]
  if lowrank is not None:
    lr = {f.name: np.asarray(getattr(lowrank, f.name), np.float64)
          for f in dataclasses.fields(lowrank)}
    rp, rg = lr["bp_k"].shape[-1], lr["b_k"].shape[-1]
    nb = s // lr["b_k"].shape[2]
    for bi, ki, t in np.ndindex(b, kh, s):
      c = t // nb
      for x, a, bp, bc in ((k, "a_k", "bp_k", "b_k"), (v, "a_v", "bp_v", "b_v")):
        if c < lr["n_pchunks"][bi]:
          x[bi, t, ki] += lr[bp][bi, ki] @ lr[a][bi, ki, t, :rp]
        else:
          x[bi, t, ki] += lr[bc][bi, ki, c] @ lr[a][bi, ki, t, :rg]
  qf = np.asarray(q, np.float64)
  out = np.zeros((b, n, h))
  lse = np.full((b, n), -np.inf)
  for bi in range(b):
    kk = np.concatenate([k[bi, :q_len[bi]], np.asarray(k_win[bi, :w_len[bi]], np.float64)])
    vv = np.concatenate([v[bi, :q_len[bi]], np.asarray(v_win[bi, :w_len[bi]], np.float64)])
    if not len(kk):
      continue
    for ni in range(n):
      kv = ni // (n // kh)
      sc = kk[:, kv] @ qf[bi, ni] / np.sqrt(h)
      m = sc.max()
      e = np.exp(sc - m)
      out[bi, ni] = e @ vv[:, kv] / e.sum()
      lse[bi, ni] = m + np.log(e.sum())
  return out, lse


def _case(i, variant, seed):
  shape = shapes.TEST_SHAPES[i]
  nb = shape.chunk
  q_len = np.asarray([shape.capacity, 2 * nb], np.int32)
  w_len = np.asarray([shape.window, 3], np.int32)
  npc = np.asarray([1, 2], np.int32)  # prefill + streaming chunks; all-prefill
  return shape, shapes.make_inputs(shape, jax.random.key(seed), q_len=q_len, w_len=w_len,
                                   n_pchunks=npc, variant=variant)


def _close(got, want, tol=2e-5):
  return np.allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", shapes.VARIANTS)
@pytest.mark.parametrize("i", range(len(shapes.TEST_SHAPES)))
def test_reference_matches_float64_oracle(i, variant):
  _, (args, groups) = _case(i, variant, 100 + i)
  out, lse = gear_attention_reference(*args, **groups, out_dtype=jnp.float32)
  want, want_lse = oracle(args, **groups)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=2e-5)
  # The residual terms matter: KIVI alone (no residual) is far from the oracle.
  plain, _ = gear_attention_reference(*args, out_dtype=jnp.float32)
  assert not _close(plain, want, 1e-3)


def test_negative_controls_fail_the_oracle_check():
  """A dropped streaming-chunk factor (keys, then values) and key outliers moved by one token:
  each must break the agreement that the intact operands pass."""
  _, (args, groups) = _case(0, "gear", 7)
  want, _ = oracle(args, **groups)
  out, _ = gear_attention_reference(*args, **groups, out_dtype=jnp.float32)
  assert _close(out, want)
  lr, sk = groups["lowrank"], groups["sparse_k"]
  c = lr.n_chunks - 1  # a streaming chunk of batch row 0 (n_pchunks = 1)
  for bad in (dict(lowrank=dataclasses.replace(lr, b_k=lr.b_k.at[0, :, c].set(0))),
              dict(lowrank=dataclasses.replace(lr, b_v=lr.b_v.at[0, :, c].set(0))),
              dict(sparse_k=dataclasses.replace(
                  sk, idx=((sk.idx.astype(jnp.int32) + 1) % 64).astype(jnp.uint8)))):
    out, _ = gear_attention_reference(*args, **dict(groups, **bad), out_dtype=jnp.float32)
    assert not _close(out, want), sorted(bad)


def test_dispatcher_runs_the_reference_on_cpu():
  _, (args, groups) = _case(1, "gear-l", 3)
  out, lse = gear_attention(*args, **groups, implementation="reference", out_dtype=jnp.float32)
  ref, ref_lse = gear_attention_reference(*args, **groups, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


def test_contract_errors_name_the_field():
  shape, (args, groups) = _case(0, "gear", 5)
  lr, sk, sv = groups["lowrank"], groups["sparse_k"], groups["sparse_v"]
  bad = [(dict(lowrank=dataclasses.replace(lr, b_v=lr.b_v[:, :, :-1])), "lowrank.b_v"),
         (dict(lowrank=dataclasses.replace(lr, n_pchunks=lr.n_pchunks[:1])), "n_pchunks"),
         (dict(lowrank=dataclasses.replace(lr, a_k=lr.a_k[..., :3])), "lowrank.a_k"),
         (dict(sparse_k=dataclasses.replace(sk, val=sk.val[..., :-1])), "sparse_k.val"),
         (dict(sparse_v=dataclasses.replace(sv, idx=sv.idx[:, :, :-1])), "sparse_v.idx"),
         (dict(sparse_k=sv), "sparse_k must be a GearSparseKeys")]
  for change, words in bad:
    with pytest.raises(ValueError, match=re.escape(words)):
      gear_attention(*args, **dict(groups, **change), implementation="reference")
  with pytest.raises(ValueError, match="unknown option"):
    gear_attention(*args, **groups, implementation="reference", blocks=3)
  del shape


def test_triton_fit_answers_without_triton():
  _, (args, groups) = _case(0, "gear", 5)
  q, keys, values, k_win = args[:4]
  assert triton_fit(q.shape, keys, values, k_win.shape[1], **groups) is None
  lr = groups["lowrank"]
  wide = dataclasses.replace(lr, bp_k=jnp.zeros(lr.bp_k.shape[:-1] + (17,), jnp.float16),
                             bp_v=jnp.zeros(lr.bp_v.shape[:-1] + (17,), jnp.float16),
                             a_k=jnp.zeros(lr.a_k.shape[:-1] + (17,), jnp.float16),
                             a_v=jnp.zeros(lr.a_v.shape[:-1] + (17,), jnp.float16))
  assert "<= 16" in triton_fit(q.shape, keys, values, k_win.shape[1], lowrank=wide)
  from kvlowrank_kernels.gear.triton_plan import plan  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="block_s"):
    plan(q.shape, keys, values, k_win.shape[1], lowrank=lr, block_s=128)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton and torch (CPU wheels)")
def test_kernel_under_interpreter():
  proc = subprocess.run([sys.executable, os.path.join(HERE, "gear_interpret_checks.py"), "gear"],
                        capture_output=True, text=True, timeout=1800, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "negative control failed as it must" in proc.stdout


def _ptx_instructions(fn, signature, constexprs, n_shift=None):
  """sm_90 PTX of fn (compiled on the CPU) as instruction lines: no debug info, comments,
  entry or parameter declarations; kernel params renumbered by n_shift(index)."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  from triton.compiler import ASTSource  # pylint: disable=import-outside-toplevel
  sig = dict(signature, **{k: "constexpr" for k in constexprs})
  ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=2, num_stages=4)).asm["ptx"]
  out = []
  for line in ptx.splitlines():
    if line.lstrip().startswith(".section") and "debug" in line:
      break
    line = re.sub(r"//.*", "", line).strip()
    if not line or line.startswith((".loc", ".file", "$L__tmp", ".param", ".visible .entry")):
      continue
    line = re.sub(r"\w+_param_(\d+)", lambda m: f"P{(n_shift or int)(int(m.group(1)))}", line)
    out.append(line)
  # The parameter loads may be scheduled in another order (more parameters): compare them as
  # a set, the other instructions in order.
  loads = sorted(x for x in out if x.startswith("ld.param"))
  return [x for x in out if not x.startswith("ld.param")] + loads


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (CPU wheel) to compile PTX")
def test_flags_off_compile_to_the_kivi_kernel():
  from kvlowrank_kernels.gear import triton_gear  # pylint: disable=import-outside-toplevel
  from kvlowrank_kernels.kivi import triton_kivi  # pylint: disable=import-outside-toplevel
  kivi_sig = {"q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*fp16", "kz_ptr": "*fp16",
              "vc_ptr": "*u8", "vs_ptr": "*i32", "vz_ptr": "*i32", "kw_ptr": "*bf16",
              "vw_ptr": "*bf16", "qlen_ptr": "*i32", "wlen_ptr": "*i32"}
  extra = {n: t for n, t in zip(("ak_ptr", "av_ptr", "bk_ptr", "bv_ptr", "bpk_ptr", "bpv_ptr",
                                  "npc_ptr", "ski_ptr", "skv_ptr", "svi_ptr", "svv_ptr",
                                  "qk_ptr"),
                                ["*fp16"] * 6 + ["*i32", "*u8", "*fp16", "*u8", "*fp16", "*fp16"])}
  tail = {"S": "i32", "W": "i32", "NSPLIT": "i32", "sm_scale": "fp32", "o_init": "*fp32",
          "lse_init": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
  ce = dict(KH=8, QPK=4, QP=4, H=128, KBITS=2, VBITS=2, KCW=32, VCW=32, G=64, GV=64, VB=32,
            BLOCK_S=64, BLOCK_W=32, KF16=1, VF16=1, FAST=True)
  off = dict(HAS_LR=0, HAS_SK=0, HAS_SV=0, NB=64, RP=4, RG=2, RA=4, NK=2, NV=3, MAXNREG=0)
  kivi = _ptx_instructions(triton_kivi.kivi_kernel, dict(kivi_sig, **tail), ce)
  gear = _ptx_instructions(triton_gear.gear_kernel, dict(kivi_sig, **extra, **tail),
                           dict(ce, **off), lambda i: i - 12 if i >= 23 else i)
  assert gear == kivi
  lowrank = _ptx_instructions(triton_gear.gear_kernel, dict(kivi_sig, **extra, **tail),
                              dict(ce, **dict(off, HAS_LR=1)), lambda i: i - 12 if i >= 23 else i)
  assert lowrank != kivi  # the check can fail
