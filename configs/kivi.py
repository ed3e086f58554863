r"""KIVI quantized KV cache (2/4-bit, per-channel K, per-token V, exact residual window).

  python experiments/evaluate.py --config=configs/kivi.py:bits=4 --workdir=runs/kivi
  python experiments/evaluate.py --config=configs/kivi.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/kivi.py --workdir=runs/kivi_sweep

Args after `:` (k=v, comma-separated): model, bits (2|3|4|8), seq_len, windows (0 = the
whole test split), smoke (stories260K, G=8, R=32, < 1 min). Other knobs via
--config.kivi.group_size=, --config.kivi.residual=, --config.kivi.v_bits=,
--config.kivi.scale_dtype=; get_sweep() covers bits in {4, 2}.

Measured: the KIVI rows of results/main.md (SmolLM2-135M, the main job's protocol).
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def kivi_section(bits: int = 2) -> ConfigDict:
  """KIVI's README/LongBench defaults: G = 32, R = 128, fp16 scales."""
  return ConfigDict(dict(bits=bits, group_size=32, residual=128,
                         v_bits=config_dict.placeholder(int), scale_dtype="float16"))


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", bits=2, seq_len=2048, windows=0, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "kivi"
  c.kivi = kivi_section(arg.bits)
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  if arg.smoke:
    apply_smoke(c)
  return c


def get_sweep(arg=None):
  del arg
  return [{"kivi.bits": 4}, {"kivi.bits": 2}]
