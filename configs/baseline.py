r"""Dense (exact) KV cache perplexity on WikiText-2: the bf16 baseline of every table.

  python experiments/evaluate.py --config=configs/baseline.py --workdir=runs/baseline
  python experiments/evaluate.py --config=configs/baseline.py:smoke --workdir=/tmp/smoke

Args after `:` (comma-separated k=v, kvlowrank.config_lib.parse_arg): model (loader
path or name), seq_len, windows (0 = the whole test split), smoke (stories260K from
../shared, 2 windows of 256 tokens, < 1 min on CPU). Scalars via --config.x=...,
e.g. --config.cache_dtype=float32 --config.eval.modes="('prefill',)".

Measured: the dense row of results/main.md (SmolLM2-135M, the main job's 4 x 512
subset). The full split at seq_len 2048 was not run on the CPU box (decode mode feeds ~150
windows x 2047 single-token steps).
"""

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", seq_len=2048, windows=0, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "dense"
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  if arg.smoke:
    apply_smoke(c)
  return c

