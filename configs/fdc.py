r"""FDC: post-RoPE rotated K' (one Q-K rotation per KV head) + Palu-style V latents, adaptive
per-head widths from one singular-value removal rate (kvlowrank.methods.rotated).

  python experiments/evaluate.py --config=configs/fdc.py --workdir=runs/fdc
  python experiments/evaluate.py --config=configs/fdc.py:ratio=0.5,allocation=uniform --workdir=runs/fdc
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
which span the evaluated 512-token windows. get_sweep(): the claims of results/rotated.md
(adaptive vs uniform, random vs WikiText calibration, FDC vs ZACK vs Palu at 50% of the KV
dims, rotation + 4-bit vs each alone, a few rates), next to dense and KIVI-4.

Expected (measured, 2-core CPU): see results/rotated.md.
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
      v_decomposition="svd", bits=bits if bits else config_dict.placeholder(int),
      group_size=16, residual=32, implementation=config_dict.placeholder(str)))


def build(recipe, arg=None):
  """The config of `recipe` ("fdc" | "zack"); configs/zack.py calls this too."""
  arg = parse_arg(arg, model="smollm2", rate=0.0, ratio=0.5, allocation="adaptive",
                  calibration="random", bits=0, seq_len=512, windows=4, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = recipe
  section = rotated_section(arg.rate, arg.ratio, arg.allocation, arg.calibration, arg.bits)
  c.fdc = ConfigDict(section.to_dict())
  c.zack = ConfigDict(section.to_dict())
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


def sweep_points(recipe):
  """The claims' points for one recipe (see module docstring)."""
  m = recipe
  pts = [{"method": m},                                                  # adaptive 50%, random
         {"method": m, f"{m}.allocation": "uniform"},                    # /AC at 50%
         {"method": m, f"{m}.calibration": "data"},                      # WikiText calibration
         {"method": m, f"{m}.bits": 4},                                  # rotation + 4-bit
         {"method": m, f"{m}.target_ratio": 0.25},
         {"method": m, f"{m}.target_ratio": 0.25, f"{m}.allocation": "uniform"}]
  pts += [{"method": m, f"{m}.target_ratio": None, f"{m}.rate": r} for r in (0.02, 0.05)]
  return pts


def get_sweep(arg=None):
  del arg
  return ([{"method": "dense"}, {"method": "kivi"}, {"method": "palu"}]
          + sweep_points("fdc") + sweep_points("zack"))
