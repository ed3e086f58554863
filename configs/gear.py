r"""GEAR (Kang et al. 2024): KIVI/KCVT backbone + sparse outliers + low-rank residual.

  python experiments/evaluate.py --config=configs/gear.py --workdir=runs/gear2
  python experiments/evaluate.py --config=configs/gear.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/gear.py --workdir=runs/gear

Args after `:` (k=v, comma-separated): model, bits, backbone (kivi|kcvt), seq_len,
windows (0 = the whole test split), prompt_len, drift (> 0: also measure generation drift
against the dense model, `kvlowrank.eval.drift`, over that many greedy tokens after 2
prompts of prompt_len tokens; get_sweep then runs only dense, KIVI-2, GEAR-2, GEAR-L-2 and
outlier-only-2), smoke (stories260K, g = 8, n_b = 16).

  python experiments/sweep.py --config=configs/gear.py:drift=128 --workdir=runs/gear_drift
Knobs via --config.gear.sparsity=, .rank_prefill=, .rank_chunk=, .buffer=, .group_size=,
.iterations=, .seed=, .outlier_fill= (GearSpec documents them).

Protocol: decode mode only (GEAR's claims are about error compounding over generation):
each window prefills `prompt_len` tokens in ONE call (prefill_chunk = 0, so the prompt
gets the paper's single rank-r_p factor) and decodes the rest token by token. Default
size: 2 windows of 512 tokens of WikiText-2 test (256 prompt + 256 decoded and scored
tokens each, one batch of 2), bf16 K/V, fp32 SmolLM2 weights: sized so the 20-point sweep
fits ~25 min on the shared 2-core CPU box -- small, so PPL differences under ~0.3 are noise.

Measured: results/gear.md (the whole grid, KV bytes in both conventions, drift, claims).

get_sweep(): the dense baseline; KIVI-2 with the paper's baseline groups (g = 64, R = 64);
the Fig. 4a grid s in {0, 1, 2, 4} % x r in {0, 2, 4, 8} over 2-bit KIVI (g = 64,
n_b = 64), with r = r_p and r_g = r / 2 (the paper's 4 : 2) -- it contains GEAR-2
(s 2, r 4), GEAR-L-2 (s 0, r 4), outlier-only-2 (s 2, r 0) and the bare backbone
(s 0, r 0); 4-bit KCVT alone and GEAR-4 over KCVT (s 2, r 4, n_b = 64, the official
GEAR-KCVT scripts' gap). Results and the claims: results/gear.md.
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def gear_section(bits: int = 2, backbone: str = "kivi") -> ConfigDict:
  """The paper's defaults: s = 2 %, r_p = 4, r_g = 2, 3 power iterations, g = n_b = 64."""
  return ConfigDict(dict(backbone=backbone, bits=bits, group_size=64, buffer=64,
                         sparsity=2.0, rank_prefill=4, rank_chunk=2, iterations=3, seed=0,
                         outlier_fill="mean", scale_dtype="float16",
                         implementation=config_dict.placeholder(str)))


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", bits=2, backbone="kivi", seq_len=512, windows=2,
                  prompt_len=256, drift=0, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "gear"
  c.gear = gear_section(arg.bits, arg.backbone)
  # The KIVI-2 reference point: the paper's KIVI baseline groups (g = 64, n_b = 64).
  c.kivi = ConfigDict(dict(bits=2, group_size=64, residual=64,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = max(1, arg.windows)
  c.eval.modes = ("decode",)
  c.eval.prompt_len = arg.prompt_len
  c.eval.prefill_chunk = 0
  c.eval.drift_tokens = arg.drift   # x drift_prompts = 2 prompts of prompt_len tokens
  if arg.smoke:
    apply_smoke(c)
    c.eval.prefill_chunk = 0
    c.gear.group_size = 8             # stories260K: head dim 8
    c.gear.buffer = 16
    c.kivi.residual = 16
  return c


def _grid():
  for s in (0.0, 1.0, 2.0, 4.0):
    for r in (0, 2, 4, 8):
      yield {"method": "gear", "gear.sparsity": s, "gear.rank_prefill": r,
             "gear.rank_chunk": r // 2}


def get_sweep(arg=None):
  if parse_arg(arg, model="smollm2", bits=2, backbone="kivi", seq_len=512, windows=2,
               prompt_len=256, drift=0, smoke=False).drift:
    # The drift run: the 2-bit claims' points only (dense = the reference: match 1, KL 0).
    return [{"method": "dense"}, {"method": "kivi"}, {"method": "gear"},
            {"method": "gear", "gear.sparsity": 0.0},
            {"method": "gear", "gear.rank_prefill": 0, "gear.rank_chunk": 0}]
  return ([{"method": "dense"}, {"method": "kivi"}] + list(_grid()) + [
      {"method": "gear", "gear.backbone": "kcvt", "gear.bits": 4, "gear.sparsity": 0.0,
       "gear.rank_prefill": 0, "gear.rank_chunk": 0},
      {"method": "gear", "gear.backbone": "kcvt", "gear.bits": 4},
  ])
