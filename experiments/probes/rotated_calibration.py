"""FDC / ZACK on SmolLM2: how much the rotations depend on the calibration tokens, and which
side (keys or values) the loss at a target compression comes from (results/rotated.md).

  OPENBLAS_NUM_THREADS=1 python experiments/probes/rotated_calibration.py \
      --workdir runs/rotated [--target 0.5] [--windows 2] [--values_svd]

Prints JSON lines: (1) FDC's δ̄/ε̄ (mean |R_random - R_data| / mean |R_data|, after sign
alignment) and the kept-subspace overlap ||R_r[:, :k]ᵀ R_d[:, :k]||²_F / k for the Q-K and
ZACK value rotations; (2) the prefill PPL (first `windows` WikiText-2 test windows of 512
tokens, bf16 cache) with only the keys, or only the values, truncated to the widths the
target gives, for FDC (random R), FDC (WikiText R) and ZACK (WikiText R); with
--values_svd also FDC's values from the plain SVD of W_V (FDC's literal recipe). Grams are
cached in the workdir like the sweep's (`rotated_stats/`).
"""

from __future__ import annotations

import os

if (os.cpu_count() or 1) <= 4:
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json

import jax.numpy as jnp
import numpy as np

from kvlowrank.data import calib as calib_lib, text as text_lib
from kvlowrank.eval.perplexity import perplexity
from kvlowrank.experiment import models
from kvlowrank.methods import rotated
from kvlowrank.methods.rotated import calibration, compression


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--target", type=float, default=0.5)
  ap.add_argument("--windows", type=int, default=2)
  ap.add_argument("--values_svd", action="store_true")
  a = ap.parse_args()
  m = models.load("smollm2", "float32")
  spec, tok = m.spec, m.require_tokenizer()
  txt, _ = text_lib.load_text("wikitext2", "test")
  win = text_lib.windows(text_lib.tokenize(tok, txt, add_bos=True), 512, a.windows)
  ctoks, _ = calib_lib.calibration_tokens(tok, calib_lib.CalibSpec(n_samples=16, seq_len=512))
  stats = {c: rotated.statistics(m.params, spec, rotated.RotatedSpec(calibration=c), ctoks,
                                 a.workdir, "zack") for c in ("random", "data")}
  out = {}
  for name, attr, ks in (("qk", "qk_grams", (16, 32, 48)), ("v", "v_grams", (32,))):
    rr, _ = calibration.rotation_from_gram(getattr(stats["random"], attr))
    rd, _ = calibration.rotation_from_gram(getattr(stats["data"], attr))
    out[f"{name}_delta_over_eps"] = float(np.abs(rr - rd).mean() / np.abs(rd).mean())
    for k in ks:
      ov = np.einsum("lkhi,lkhj->lkij", rr[..., :k], rd[..., :k])
      out[f"{name}_subspace_overlap_{k}"] = float((ov ** 2).sum((-1, -2)).mean() / k)
  print(json.dumps(out), flush=True)
  full = (spec.head_dim,) * spec.n_kv_heads
  runs = [("fdc", "random", "whiten"), ("fdc", "data", "whiten"), ("zack", "data", "whiten")]
  if a.values_svd:
    runs.append(("fdc", "data", "svd"))
  for recipe, cal, vdec in runs:
    rs = rotated.RotatedSpec(target_ratio=a.target, calibration=cal, v_decomposition=vdec)
    s = rotated.statistics(m.params, spec, rs, ctoks, a.workdir, recipe)
    f = compression.factorise(m.params, spec, rs, s, recipe)
    _, lay, _ = compression.compress(m.params, spec, rs, s, recipe, f)
    for side in ("K", "V"):
      layers = [compression.compress_layer(lp, spec, f, i,
                                           lay.k_widths[i] if side == "K" else full,
                                           lay.v_widths[i] if side == "V" else full)
                for i, lp in enumerate(m.params["layers"])]
      ppl = perplexity(dict(m.params, layers=layers), win, spec=spec, method=recipe,
                       method_spec=rs, cache_dtype=jnp.bfloat16, batch_size=len(win)).ppl
      print(json.dumps({"recipe": recipe, "calibration": cal, "v_decomposition": vdec,
                        "truncated": side, "ppl": ppl}), flush=True)


if __name__ == "__main__":
  main()
