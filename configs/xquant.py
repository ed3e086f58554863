r"""XQuant / XQuant-CL: cache the quantized layer input X, rematerialise K/V every step.

  python experiments/evaluate.py --config=configs/xquant.py:bits=4 --workdir=runs/xquant
  python experiments/evaluate.py --config=configs/xquant.py:cl,bits=2 --workdir=runs/xq_cl
  python experiments/evaluate.py --config=configs/xquant.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/xquant.py --workdir=runs/xquant_sweep

Args after `:` (k=v, comma-separated): model, bits (2|3|4|8), cl (XQuant-CL instead of
XQuant), path (auto|x|latent: X itself or the GQA SVD latents; auto = the smaller
footprint, latent on SmolLM2's 9q/3kv heads: 2·192 < 576), group_size (64 by default:
SmolLM2's widths 576 and 192 are not multiples of the paper's 128), seq_len, windows,
decode (false: prefill mode only, faster on CPU), smoke (stories260K, < 2 min). Other
knobs via --config.xquant.<field> /
--config.xquant_cl.<field> (kvlowrank.cache.XQuantSpec / XQuantCLSpec: window,
key_axis, value_axis, n_high_layers, high_bits, base_layer, delta_axis, layer_bits,
scale_dtype, implementation, decode_chunk; XQuant-CL also rows_per_pass, the batch rows
one forward pass runs: None = as many as keep its fp32 carry within 2 GiB).

The XQuant-CL section follows the paper's Table 4 recipe: base layer 2, layers 0-2 at
4 bits, deltas of layers 3.. at `bits`. Evaluation protocol = configs/main.py (first 4
WikiText-2 test windows of 512 tokens, prefill and decode modes).

get_sweep(): XQuant 4/3/2 bits on the auto (latent) path and on the X path, XQuant-CL
3/2 bits on both paths, and KIVI at 4/3/2 bits with the same group (64) and no exact
window (the equal-bits comparison of the paper's Table 1/4), next to the dense cache.
Measured: results/xquant.md (the full table, the paper's claims).
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def xquant_section(bits: int = 4, group_size: int = 64, path: str = "auto") -> ConfigDict:
  """A `xquant` section (fields of kvlowrank.cache.XQuantSpec)."""
  return ConfigDict(dict(bits=bits, group_size=group_size, window=0, path=path,
                         key_axis="channel", value_axis="token", n_high_layers=0,
                         high_bits=4, scale_dtype="float16",
                         implementation=config_dict.placeholder(str), decode_chunk=2048))


def xquant_cl_section(bits: int = 2, group_size: int = 64, path: str = "auto") -> ConfigDict:
  """A `xquant_cl` section (kvlowrank.cache.XQuantCLSpec), paper Table 4 recipe."""
  return ConfigDict(dict(bits=bits, base_layer=2, n_high_layers=3, high_bits=4,
                         layer_bits=(), group_size=group_size, window=0, path=path,
                         delta_axis="token", key_axis="channel", value_axis="token",
                         scale_dtype="float16",
                         implementation=config_dict.placeholder(str), decode_chunk=2048,
                         rows_per_pass=config_dict.placeholder(int)))


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", bits=4, cl=False, path="auto", group_size=64,
                  seq_len=512, windows=4, prompt_len=256, decode=True, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "xquant_cl" if arg.cl else "xquant"
  c.cache_dtype = "bfloat16"
  c.xquant = xquant_section(arg.bits, arg.group_size, arg.path)
  c.xquant_cl = xquant_cl_section(arg.bits, arg.group_size, arg.path)
  # KIVI at the same group and without its exact window, for equal-bits comparisons.
  c.kivi = ConfigDict(dict(bits=arg.bits, group_size=arg.group_size, residual=0,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = max(1, arg.windows)
  c.eval.prompt_len = arg.prompt_len
  c.eval.prefill_chunk = 128
  if not arg.decode:
    c.eval.modes = ("prefill",)
  if arg.smoke:
    apply_smoke(c)   # stories260K: D = 64, 8q/4kv heads of 8 (auto path: x, a tie)
    c.xquant.group_size = 32
    c.xquant_cl.group_size = 32
    c.xquant_cl.base_layer = 1
    c.xquant_cl.n_high_layers = 1
  return c


def get_sweep(arg=None):
  del arg
  pts = [{"method": "dense"}]
  pts += [{"method": "xquant", "xquant.bits": b} for b in (4, 3, 2)]
  pts += [{"method": "xquant_cl", "xquant_cl.bits": b} for b in (3, 2)]
  pts += [{"method": "kivi", "kivi.bits": b} for b in (4, 3, 2)]
  pts += [{"method": "xquant", "xquant.path": "x", "xquant.bits": b} for b in (4, 2)]
  pts += [{"method": "xquant_cl", "xquant_cl.path": "x", "xquant_cl.bits": 2}]
  return pts
