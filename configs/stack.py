r"""Rotation + eviction vs each alone at equal KV bytes (issue 22's stacking claim,
results/rotated.md): ZACK with the WikiText-2 rotation, SnapKV eviction (configs/evict.py's
wrapper: window = observe = 32, pool 5), and both, on SmolLM2-135M in decode mode.

  python experiments/sweep.py --config=configs/stack.py --workdir=runs/stack
  python experiments/sweep.py --config=configs/stack.py:smoke --workdir=/tmp/smoke

Args after `:` (k=v, comma-separated): model, seq_len, windows, prompt_len, smoke (the
random tiny model, head dim 32, seq_len 256: seconds).

Evaluation as configs/evict.py's table: the first 2 WikiText-2 test windows of seq_len = 512
tokens, decode mode (prompt of 256 tokens in one call, then one token per call), bf16 K/V.
Calibration: 16 x 512 tokens of WikiText-2 validation (seed 3), the rotation fitted on them
(calibration="data", ZACK's recipe; random tokens gave far worse PPL, results/rotated.md).

get_sweep(): with T = seq_len and bytes = kv_bytes_per_token at a T-token context (an
eviction cache holds min(budget, T) of T tokens: its bytes are the inner's x budget / T):
  dense                                    1      x dense bytes
  ZACK, 50% of the KV dims kept            0.5
  evict(dense), budget T/2                 0.5
  evict(ZACK, 75% kept), budget floor(2T/3)  0.75 x floor(2T/3) / T (T = 512: 341 tokens,
                                           0.4995, 0.2% fewer bytes than the two above:
                                           exact equality would need 341.33 tokens)
  ZACK, 75% kept (the stacked point's inner cache alone, for reference)  0.75
  evict(dense), budget floor(2T/3) (the stacked point's eviction alone, for reference)
                                           floor(2T/3) / T (T = 512: 0.666)
and a second equal-bytes pair at a quarter of the dense bytes:
  evict(dense), budget T/4                 0.25
  evict(ZACK, 50% kept), budget T/2        0.25

Measured: results/rotated.md ("Rotation + eviction").
"""

import importlib.util
from pathlib import Path

from kvlowrank.config_lib import parse_arg


def _load(name):
  spec = importlib.util.spec_from_file_location(f"_configs_{name}",
                                                Path(__file__).with_name(f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_evict, _fdc = _load("evict"), _load("fdc")
RATIO_STACKED = 0.25      # fraction of the KV dims the stacked point's ZACK removes


def _arg(arg):
  return parse_arg(arg, model="smollm2", seq_len=512, windows=2, prompt_len=256,
                   smoke=False)


def get_config(arg=None):
  a = _arg(arg)
  c = _evict.get_config(
      f"model={a.model},inner=zack,budget={a.seq_len // 2},window=32,seq_len={a.seq_len},"
      f"windows={a.windows},prompt_len={a.prompt_len}" + (",smoke" if a.smoke else ""))
  c.evict.inner_specs.zack = _fdc.rotated_section(ratio=RATIO_STACKED, calibration="data")
  c.zack = _fdc.rotated_section(ratio=0.5, calibration="data")
  return c


def get_sweep(arg=None):
  """The points of the module docstring (budgets from seq_len: smoke has T = 256)."""
  a = _arg(arg)
  t = 256 if a.smoke else a.seq_len
  return [{"method": "dense"},
          {"method": "zack"},
          {"method": "evict", "evict.inner": "dense", "evict.budget": t // 2},
          {"method": "evict", "evict.inner": "zack", "evict.budget": 2 * t // 3},
          {"method": "zack", "zack.target_ratio": RATIO_STACKED},
          {"method": "evict", "evict.inner": "dense", "evict.budget": 2 * t // 3},
          {"method": "evict", "evict.inner": "dense", "evict.budget": t // 4},
          {"method": "evict", "evict.inner": "zack", "evict.budget": t // 2,
           "evict.inner_specs.zack.target_ratio": 0.5}]
