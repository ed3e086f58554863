r"""Palu: low-rank latent KV cache (whitened SVD, Fisher ranks, Hadamard-quantized latents).

  python experiments/evaluate.py --config=configs/palu.py --workdir=runs/palu
  python experiments/evaluate.py --config=configs/palu.py:ratio=0.3,bits=3 --workdir=runs/palu
  python experiments/evaluate.py --config=configs/palu.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/palu.py --workdir=runs/palu_sweep

Args after `:` (k=v, comma-separated): model, granularity (m|g|j: M-LRD per KV head,
G-LRD groups of gs KV heads, J-LRD all heads), group_size (G-LRD; 0 = largest divisor
of n_kv_heads <= 4, the paper's gs-4), ratio (fraction of the KV hidden dim removed),
rank_search (fisher|uniform), decomposition (whiten|svd), bits (0 = unquantized
latents at the cache dtype, else 2|3|4|8 per-token latent quantization), hadamard
(bool), seq_len, windows, smoke (stories260K, rank multiple 8, < 2 min).
Other knobs via --config.palu.<field> (kvlowrank.methods.palu.PaluSpec: rank_multiple,
fisher_reduce, window, fisher_samples, damping).

get_sweep() reproduces the paper's ablation axes on this model (the measured table is
results/palu.md): granularity M/G/J at 50% (Table 1/6), Fisher vs uniform ranks at
30/50/70% (Table 8), Hadamard on/off at 2/3/4 bits at 30% and 50% (Table 7),
whitened vs plain SVD at 50%, next to the bf16 dense cache and KIVI-4/KIVI-2.
Evaluation: the first 8 WikiText-2 test windows of 512 tokens, prefill mode (every
query attends to the compressed cache); calibration: 16 x 512-token windows of the
WikiText-2 validation split (Fisher on the first 8), computed once per workdir.

Measured: results/palu.md. On SmolLM2-135M (3 KV heads)
G-LRD gs-4 resolves to gs=3 = J-LRD. In the smoke sweep (head dim 8) M-LRD at 50% is
infeasible (its group rank 8 is the rank multiple): the sweep records that point as
failed, with the reason, and runs the other 23.
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def palu_section(granularity="g", group_size=0, ratio=0.5, rank_search="fisher",
                 decomposition="whiten", bits=0, hadamard=True) -> ConfigDict:
  """A `palu` config section (fields of kvlowrank.methods.palu.PaluSpec)."""
  return ConfigDict(dict(
      granularity=granularity, group_size=group_size, decomposition=decomposition,
      rank_search=rank_search, target_ratio=ratio,
      # The paper rounds ranks to multiples of 32; 16 lets M-LRD (head dim 64) reach
      # 70% and keeps every rank a Hadamard order (16k up to 192).
      rank_multiple=16, fisher_reduce="rms", hadamard=hadamard,
      bits=bits if bits else config_dict.placeholder(int),
      window=0, damping=1e-6, fisher_samples=8))


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", granularity="g", group_size=0, ratio=0.5,
                  rank_search="fisher", decomposition="whiten", bits=0, hadamard=True,
                  seq_len=512, windows=8, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "palu"
  c.palu = palu_section(arg.granularity, arg.group_size, arg.ratio, arg.rank_search,
                        arg.decomposition, arg.bits, arg.hadamard)
  # KIVI at comparable bytes in the same sweep (G = 32, R = 128: KIVI's defaults).
  c.kivi = ConfigDict(dict(bits=2, group_size=32, residual=128,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = 2
  c.eval.modes = ("prefill",)
  c.calib.n_samples = 16
  c.calib.seq_len = 512
  if arg.smoke:
    apply_smoke(c)
    c.palu.rank_multiple = 8     # head dim 8: ranks 8/16/24/32
    c.palu.fisher_samples = 0
    c.eval.modes = ("prefill", "decode")
  return c


def get_sweep(arg=None):
  """The paper's ablation axes (see module docstring); every point is a palu section
  override, plus the dense and KIVI references."""
  del arg
  pts = [{"method": "dense"},
         {"method": "kivi", "kivi.bits": 4},
         {"method": "kivi", "kivi.bits": 2}]
  # Table 1/6: granularity at 50%.
  pts += [{"palu.granularity": g} for g in ("m", "g", "j")]
  # Table 8: rank search at 30/50/70% (G-LRD).
  pts += [{"palu.target_ratio": r, "palu.rank_search": s}
          for r in (0.3, 0.5, 0.7) for s in ("uniform", "fisher")
          if (r, s) != (0.5, "fisher")]
  # Whitening ablation (SVD-LLM vs plain SVD).
  pts += [{"palu.decomposition": "svd"}]
  # Table 7: Hadamard on/off at 2/3/4 bits, 30% and 50%.
  pts += [{"palu.target_ratio": r, "palu.bits": b, "palu.hadamard": h}
          for r in (0.3, 0.5) for b in (4, 3, 2) for h in (True, False)]
  return [dict(p, method=p.get("method", "palu")) for p in pts]
