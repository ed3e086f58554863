r"""FDC: post-RoPE rotated K' (one Q-K rotation per KV head) + Palu-style V latents, adaptive
per-head widths from one singular-value removal rate (kvlowrank.methods.rotated).

  python experiments/evaluate.py --config=configs/fdc.py --workdir=runs/fdc
  python experiments/evaluate.py --config=configs/fdc.py:allocation=uniform --workdir=runs/fdc
  python experiments/evaluate.py --config=configs/fdc.py:rate=0.05 --workdir=runs/fdc
  python experiments/evaluate.py --config=configs/fdc.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/fdc.py --workdir=runs/rotated
  python experiments/search_rate.py --config=configs/fdc.py --workdir=runs/fdc_search

Args after `:` (k=v, comma-separated): model, rate (the removal rate r; used when
ratio < 0), ratio (target fraction of KV dims removed: adaptive = smallest r reaching it,
uniform = one width everywhere; default 0.5), allocation (adaptive|uniform),
calibration (random: uniformly random token ids, FDC's >= 8K tokens | data: the calib
windows, WikiText-2 validation), bits (0 = K'/V' at the cache dtype, else 2|4|8 KIVI-style
quantization), seq_len, windows, smoke (the random tiny model, head dim 32: seconds).
Other knobs via --config.fdc.<field> (kvlowrank.methods.rotated.RotatedSpec:
width_multiple, v_decomposition, group_size, residual).

Calibration: 16 windows x 512 tokens (8192 tokens, FDC's minimum) at positions 0..511,
which span the evaluated 512-token windows; FDC's values are whitened on the WikiText-2
windows (Palu's whitened SVD) whatever the rotation's tokens. Evaluation: the first 2
WikiText-2 test windows of 512 tokens, prefill mode. get_sweep(): the claims of
results/rotated.md (adaptive vs uniform, random vs WikiText calibration, FDC vs ZACK vs Palu
at 50% of the KV dims, rotation + 4-bit vs each alone), next to dense, KIVI-4 and KIVI-2.

Measured: results/rotated.md.
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config

RECIPE = "fdc"


def rotated_section(rate=0.0, ratio=0.5, allocation="adaptive", calibration="random",
                    bits=0) -> ConfigDict:
  """A `fdc`/`zack` config section (fields of kvlowrank.methods.rotated.RotatedSpec)."""
  return ConfigDict(dict(
      rate=rate,
      target_ratio=ratio if ratio >= 0 else config_dict.placeholder(float),
      allocation=allocation, width_multiple=16, calibration=calibration,
      v_decomposition="whiten", bits=bits if bits else config_dict.placeholder(int),
      group_size=16, residual=32, implementation=config_dict.placeholder(str)))


def build(recipe, arg=None):
  """The config of `recipe` ("fdc" | "zack"); configs/zack.py calls this too."""
  # Calibration defaults follow the papers: FDC fits R on random tokens, ZACK on a text
  # corpus (its 57K-token synthetic set; here the WikiText-2 validation windows).
  arg = parse_arg(arg, model="smollm2", rate=0.0, ratio=0.5, allocation="adaptive",
                  calibration="random" if recipe == "fdc" else "data", bits=0, seq_len=512,
                  windows=2, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = recipe
  section = rotated_section(arg.rate, arg.ratio, arg.allocation, arg.calibration, arg.bits)
  c.fdc = ConfigDict(section.to_dict())
  c.zack = ConfigDict(section.to_dict())
  other = "zack" if recipe == "fdc" else "fdc"
  c[other].calibration = "data" if recipe == "fdc" else "random"   # the other's default
  # References at comparable bytes in the same sweep: Palu-50% (configs/palu.py's main row)
  # and KIVI-4 (G = 32, R = 128).
  c.palu = ConfigDict(dict(granularity="g", group_size=0, decomposition="whiten",
                           rank_search="fisher", target_ratio=0.5, rank_multiple=16,
                           fisher_reduce="rms", hadamard=True,
                           bits=config_dict.placeholder(int), window=0, damping=1e-6,
                           fisher_samples=8))
  c.kivi = ConfigDict(dict(bits=4, group_size=32, residual=128,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = arg.windows
  c.eval.modes = ("prefill",)
  c.calib.n_samples = 16
  c.calib.seq_len = arg.seq_len
  if arg.smoke:
    apply_smoke(c)
    c.model.path = "random:tiny"    # head dim 32: widths 16/32 (stories260K's is 8)
    c.eval.modes = ("prefill", "decode")
    c.palu.rank_multiple = 16
    c.palu.fisher_samples = 0
  return c


def get_config(arg=None):
  return build(RECIPE, arg)


def get_sweep(arg=None):
  """The claims' points (module docstring), in a get_config() workdir of either file (the
  fdc section defaults to random-token calibration, the zack section to WikiText)."""
  del arg
  return [{"method": "dense"},
          {"method": "palu"},                                     # Palu-50% (G-LRD, Fisher)
          {"method": "kivi", "kivi.bits": 4},
          {"method": "kivi", "kivi.bits": 2},
          {"method": "fdc"},                                      # adaptive 50%, random R
          {"method": "fdc", "fdc.allocation": "uniform"},         # /AC ablation at 50%
          {"method": "fdc", "fdc.calibration": "data"},           # WikiText R
          {"method": "fdc", "fdc.bits": 4},                       # rotation + 4-bit
          {"method": "fdc", "fdc.target_ratio": 0.75},            # rotation alone, 25% dims
          {"method": "zack"},                                     # adaptive 50%, WikiText R
          {"method": "zack", "zack.allocation": "uniform"},
          {"method": "zack", "zack.calibration": "random"}]
