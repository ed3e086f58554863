"""End-to-end evaluate.run on the real tiny stories260K model (skipped without ../shared):
the dense perplexity equals an independent float64 numpy computation on the same
windows; KIVI-2 produces a complete record."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvlowrank.experiment import config as config_lib
from kvlowrank.experiment import evaluate, models, records
from kvlowrank.resources import shared_dir
from np_reference import np_forward

pytestmark = pytest.mark.skipif(shared_dir() is None, reason="../shared not available")
REPO = Path(__file__).resolve().parents[1]


def get_config(name, arg):
  spec = importlib.util.spec_from_file_location(f"_cfg_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def test_dense_smoke_matches_numpy(tmp_path):
  c = config_lib.apply_overrides(get_config("baseline", "smoke"),
                                 {"cache_dtype": "float32", "progress": False})
  rec = evaluate.run(c, tmp_path)
  assert records.read(tmp_path / "results.jsonl") == [json.loads(json.dumps(rec))]
  assert rec["windows"] == 2 and rec["seq_len"] == 256 and rec["tokens"] == 2 * 255
  assert rec["data"]["source"].endswith("wikitext-2-raw/wiki.test.raw")
  model = models.load(c.model.path, "float32")
  windows, _, _ = evaluate.eval_windows(c.model.path, "float32",
                                        evaluate.from_config(c).data, 256, 2)
  # The windows are the start of the tokenized GPTQ string.
  txt = "\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film"
  np.testing.assert_array_equal(windows[0, :20], model.tokenizer.encode(txt)[:20])
  def np_ppl(shift):
    nll = 0.0
    for win in windows:
      logits = np_forward(model.params, win, model.spec)[:256 - shift]
      m = logits.max(-1, keepdims=True)
      lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
      nll += float((lse - logits[np.arange(256 - shift), win[shift:]]).sum())
    return math.exp(nll / (2 * (256 - shift)))

  ref = np_ppl(1)
  for mode in ("prefill", "decode"):
    assert rec[f"ppl_{mode}"] == pytest.approx(ref, rel=1e-5)
  # Negative control: scoring the token after next is far off.
  assert abs(rec["ppl_prefill"] / np_ppl(2) - 1) > 0.1
  assert rec["kv_bytes_per_token"] == 2 * 5 * 4 * 8 * 4  # fp32 dense: L=5, K=4, H=8
  assert rec["compression_vs_bf16"] == 0.5

def test_kivi_smoke_record(tmp_path):
  c = config_lib.apply_overrides(get_config("kivi", "smoke"), {"progress": False})
  rec = evaluate.run(c, tmp_path)
  assert rec["method"] == "kivi" and rec["bits"] == "2"
  assert rec["method_spec"]["group_size"] == 8 and rec["method_spec"]["residual"] == 32
  # 5 layers x 4 kv heads x (4 + 4 B packed codes + 2 x 2 x 2 B K/V scales and zeros).
  assert rec["kv_bytes_per_token"] == 320.0 and rec["compression_vs_bf16"] == 2.0
  assert rec["allocated_bytes_per_token"] > rec["kv_bytes_per_token"]  # + exact window
  for mode in ("prefill", "decode"):
    r = rec["results"][mode]
    assert r["n_tokens"] == 510 and r["n_windows"] == 2 and math.isfinite(r["ppl"])
  assert rec["ppl_prefill"] != rec["ppl_decode"]
