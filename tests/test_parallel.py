"""Tensor/data parallel decoding (`kvlowrank.parallel`) on 4 simulated CPU devices: every
cache's sharded forward (prefill + decode steps) and greedy generation equal one device's,
on meshes 1x4 and 2x2 (data x model; 4x1 too for dense, KIVI and FDC), plus a negative
control and the one-line errors. Dense, XQuant-CL and FDC run a 2-layer model, the other
(per-layer) caches and FDC's quantized data-parallel case a 1-layer one.
FDC ("fdc": ragged widths, head dim 64) runs balanced for each mesh's model axis
(`kvlowrank.methods.rotated.balance`) against the unbalanced model on one device.

The 4 devices need XLA_FLAGS before JAX starts, so the cases run in one subprocess
(tests/parallel_worker.py) that prints a JSON line per case."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("dense", "kivi", "palu", "palu_4bit", "xquant_x", "xquant_latent", "xquant_cl",
           "gear", "fdc")
MESHES = ([1, 4], [2, 2], [4, 1])
DATA_ONLY_METHODS = ("dense", "kivi")  # the caches also run on 4x1 (parallel_worker.py)
# fp32 models: the row-split products are summed in a different order than one matmul
# (~1e-6 relative). Quantized caches: a value within that rounding of a quantization
# boundary may take the neighbouring code on one layout; one 4-bit step of one latent moves
# these logits by ~1e-3, so they get a looser bound (still 1000x below the negative control).
TOL = 1e-4
QUANT_TOL = 5e-3
QUANTIZED = ("kivi", "palu_4bit", "xquant_x", "xquant_latent", "xquant_cl", "gear")
MULTI_LAYER = ("dense", "xquant_cl", "fdc")


@pytest.fixture(scope="module")
def cases():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [p for p in [os.environ.get("PYTHONPATH", "")] + sys.path if p]))
  out = subprocess.run([sys.executable, str(ROOT / "tests" / "parallel_worker.py")],
                       capture_output=True, text=True, env=env, timeout=900, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_sharded_equals_one_device(cases, method):
  got = {tuple(c["mesh"]): c for c in cases if c["case"] == "equal" and c["method"] == method}
  want = MESHES if method in DATA_ONLY_METHODS + ("fdc",) else MESHES[:2]
  assert sorted(got) == sorted(map(tuple, want))
  # The per-layer caches run 1 layer (parallel_worker.SPEC1); these compare 2 (the layer
  # stack's specs and the hidden state handed between sharded layers).
  assert {c["layers"] for c in got.values()} == {2 if method in MULTI_LAYER else 1}
  for mesh, c in got.items():
    tol = QUANT_TOL if method in QUANTIZED else TOL
    assert c["max_abs_diff"] <= tol * max(1.0, c["scale"]), (mesh, c)
    if c["tokens_equal"] is not None:
      assert c["tokens_equal"], (mesh, c)
  assert any(c["tokens_equal"] for c in got.values())


@pytest.mark.slow
def test_fdc_padding_and_quantized_data_parallel(cases):
  """Balancing pads (the worker's widths need padding at model = 2 and 4, none at 1); the
  quantized rotated cache splits over the data axis and equals one device."""
  pad = {tuple(c["mesh"]): c["padding"] for c in cases
         if c["case"] == "equal" and c["method"] == "fdc"}
  assert pad[(4, 1)] == 0 and pad[(2, 2)] > 0 and pad[(1, 4)] > 0
  [c] = [c for c in cases if c["case"] == "equal_data" and c["method"] == "fdc_4bit"]
  assert c["max_abs_diff"] <= TOL * max(1.0, c["scale"]), c


@pytest.mark.slow
def test_negative_control_swapped_heads(cases):
  [c] = [c for c in cases if c["case"] == "negative"]
  assert c["max_abs_diff"] > 100 * TOL


@pytest.mark.slow
@pytest.mark.parametrize("label,needle", [
    ("heads", "ModelSpec.n_kv_heads=4 does not split over mesh model=3"),
    ("batch", "batch=2 does not split over mesh data=4"),
    ("palu_groups", "a group would straddle devices"),
    ("devices", "needs 8 devices, 4 available"),
    ("rotated_unbalanced_params", "call kvlowrank.methods.rotated.balance(params, spec, tp=2)"),
    ("rotated_unbalanced_forward", "call kvlowrank.methods.rotated.balance(params, spec, "
                                   "tp=2)"),
    ("rotated_unbalanced_generate", "call kvlowrank.methods.rotated.balance(params, spec, "
                                    "tp=2)"),
    ("rotated_bits", "RotatedSpec.bits=4: quantized K'/V' do not split over mesh model=2"),
])
def test_one_line_errors(cases, label, needle):
  [c] = [c for c in cases if c["case"] == "error" and c["label"] == label]
  assert c["message"] is not None and needle in c["message"] and "\n" not in c["message"]


@pytest.mark.slow
def test_bench_sharded_params_equal_random_params(cases):
  """The bench creates its weights on a mesh layer by layer (one compiled program for every
  layer): the same values as `random_params` on one device, split over the devices; the
  layers differ (each draws its own keys)."""
  got = {c["method"]: c for c in cases if c["case"] == "sharded_params"}
  assert set(got) == {"dense", "palu50", "fdc50"}
  for c in got.values():
    assert c["equal"] and c["layers_differ"] and c["split"], c


@pytest.mark.slow
def test_bench_decode_on_a_mesh(cases):
  """Head-split caches: each of 2 devices holds half of one device's cache bytes (but the
  lengths [B] int32, which every device keeps, and GEAR's compressed lengths and
  prefill-chunk counts [B] int32);
  FDC's random ragged widths, balanced for the 2 devices, hold half of one device's bytes
  times 1 + `rotated.padding_fraction`."""
  got = {c["method"]: c for c in cases if c["case"] == "bench"}
  assert set(got) == {"dense", "KIVI-2", "Palu-50%", "FDC-50%", "GEAR-L-2"}
  for name, c in got.items():
    pad = c["padding"] if name == "FDC-50%" else 0.0
    whole = 24 if name == "GEAR-L-2" else 8     # bytes of the [B] arrays every device keeps
    assert c["mesh"] == [1, 2], c
    assert c["per_device"] * 2 - 2 * whole == round((c["one_device"] - whole) * (1 + pad)), c
    assert "[1x2]" in c["table"] and "per device" in c["table"]
  assert got["FDC-50%"]["padding"] > 0
