r"""The main job: perplexity vs KV bytes/token of every method on SmolLM2-135M.

  python experiments/sweep.py --config=configs/main.py --workdir=runs/main

Sweep (get_sweep): bf16 dense baseline, KIVI-4, KIVI-2 (G = 32, R = 128, fp16 scales),
Palu G-LRD (gs-4 -> gs=3 = all 3 KV heads on SmolLM2; Fisher ranks, whitened SVD) at
50% with bf16 latents and at 30% with 3-bit Hadamard-rotated latents (about KIVI-2's
bytes), XQuant-4 and XQuant-2 (auto = GQA latent path, groups of 64) and XQuant-CL-2
(paper Table 4 recipe), GEAR-2 and GEAR-L-2 (2-bit KIVI backbone g = n_b = 64, s = 2 % / 0,
r_p = 4, r_g = 2; their decode prompt is prefilled in one call: results/gear.md), FDC-50% and
ZACK-50% (adaptive Eq. 1 widths; results/rotated.md), each in both eval modes, on the embedded SmolLM2-135M-Instruct (fp32 weights) and a
WikiText-2 test subset: the first 4 windows of 512 tokens (GPTQ windows, scored in one
batch of 4). Decode mode prefills 256 tokens (in chunks of 128) and decodes the last
256 one by one. Generation drift against the bf16 dense model (kvlowrank.eval.drift:
greedy match and KL columns): 2 prompts (the first 256 tokens of windows 0 and 1) x 64
greedy tokens. About 21-32 min on an otherwise idle 2-core CPU (README); writes
results.jsonl, report.md and pareto.png into the workdir and prints where they went.

Args after `:`: model, seq_len, windows, prompt_len, smoke (stories260K, < 2 min).

Measured: results/main.md (the table this job prints, with its date, machine and time).
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", seq_len=512, windows=4, prompt_len=256,
                  smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "dense"
  c.cache_dtype = "bfloat16"
  c.kivi = ConfigDict(dict(bits=4, group_size=32, residual=128,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  # Palu (configs/palu.py documents the fields); calibrated on c.calib (WikiText-2
  # validation, 16 x 512 tokens; Fisher on the first 8), cached in the workdir.
  c.palu = ConfigDict(dict(granularity="g", group_size=0, decomposition="whiten",
                           rank_search="fisher", target_ratio=0.5, rank_multiple=16,
                           fisher_reduce="rms", hadamard=True,
                           bits=config_dict.placeholder(int), window=0, damping=1e-6,
                           fisher_samples=8))
  # XQuant / XQuant-CL (configs/xquant.py documents the fields): groups of 64 (SmolLM2's
  # widths 576 / 192 are not multiples of 128), no exact window; CL = paper Table 4
  # recipe (base layer 2, layers 0-2 at 4 bits).
  c.xquant = ConfigDict(dict(bits=4, group_size=64, window=0, path="auto",
                             key_axis="channel", value_axis="token", n_high_layers=0,
                             high_bits=4, scale_dtype="float16",
                             implementation=config_dict.placeholder(str)))
  c.xquant_cl = ConfigDict(dict(bits=2, base_layer=2, n_high_layers=3, high_bits=4,
                                layer_bits=(), group_size=64, window=0, path="auto",
                                delta_axis="token", key_axis="channel", value_axis="token",
                                scale_dtype="float16",
                                implementation=config_dict.placeholder(str)))
  # GEAR (configs/gear.py documents the fields): 2-bit KIVI backbone, g = n_b = 64, s = 2 %,
  # r_p = 4, r_g = 2; its rows prefill the prompt in one call (the paper's prefill factor).
  c.gear = ConfigDict(dict(backbone="kivi", bits=2, group_size=64, buffer=64, sparsity=2.0,
                           rank_prefill=4, rank_chunk=2, iterations=3, seed=0,
                           outlier_fill="mean", scale_dtype="float16",
                           implementation=config_dict.placeholder(str)))
  # FDC / ZACK (configs/fdc.py documents the fields): adaptive Eq. 1 widths at 50% of the
  # KV dims; FDC's rotations on random tokens (c.calib's shape, FDC's >= 8K tokens),
  # ZACK's rotations on WikiText-2 (c.calib), as ZACK calibrates on text.
  for name in ("fdc", "zack"):
    c[name] = ConfigDict(dict(rate=0.0, target_ratio=0.5, allocation="adaptive",
                              width_multiple=16, v_decomposition="whiten",
                              calibration="random" if name == "fdc" else "data",
                              bits=config_dict.placeholder(int), group_size=16, residual=32,
                              implementation=config_dict.placeholder(str)))
  # Stacking (configs/evict.py documents the fields): SnapKV eviction around ZACK-50% with
  # KIVI-style 4-bit K'/V', i.e. rotation + quantization + eviction in one cache, keeping
  # half of a window's tokens; judged in decode mode only (SnapKV selects at the prompt's
  # end), so its point runs that mode.
  c.evict = ConfigDict(dict(
      inner="zack", budget=arg.seq_len // 2, window=32, observe=32, pool=5, ring="auto",
      bytes_context=arg.seq_len,
      inner_specs=ConfigDict(dict(zack=ConfigDict(dict(
          target_ratio=0.5, bits=4, group_size=16, residual=32, calibration="data"))))))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = arg.windows
  c.eval.prompt_len = arg.prompt_len
  c.eval.prefill_chunk = 128
  c.eval.drift_tokens = 64  # x drift_prompts = 2 prompts of eval.prompt_len tokens
  if arg.smoke:
    c.eval.drift_tokens = 16
    apply_smoke(c)
    c.palu.rank_multiple = 8       # stories260K: head dim 8
    c.palu.fisher_samples = 0
    c.xquant.group_size = 32       # stories260K: D = 64 (auto path: x)
    c.xquant_cl.group_size = 32
    c.xquant_cl.base_layer = 1
    c.xquant_cl.n_high_layers = 1
    c.gear.group_size = 8          # stories260K: head dim 8
    c.gear.buffer = 16
    c.fdc.width_multiple = c.zack.width_multiple = 8   # head dim 8: full width only
    c.fdc.target_ratio = c.zack.target_ratio = 0.0
    c.zack.group_size = 8                               # 4-bit K'/V' groups within a head
    c.evict.budget, c.evict.window = c.eval.seq_len // 2, 16
    c.evict.observe, c.evict.bytes_context = 16, c.eval.seq_len
    c.evict.inner_specs.zack.update(dict(target_ratio=0.0, width_multiple=8, group_size=8,
                                         residual=16))
  return c


def get_sweep(arg=None):
  del arg
  return [
      {"method": "dense"},
      {"method": "kivi", "kivi.bits": 4},
      {"method": "kivi", "kivi.bits": 2},
      {"method": "palu"},
      {"method": "palu", "palu.target_ratio": 0.3, "palu.bits": 3},
      {"method": "xquant", "xquant.bits": 4},
      {"method": "xquant", "xquant.bits": 2},
      {"method": "xquant_cl", "xquant_cl.bits": 2},
      {"method": "gear", "eval.prefill_chunk": 0},                          # GEAR-2
      {"method": "gear", "gear.sparsity": 0.0, "eval.prefill_chunk": 0},    # GEAR-L-2
      {"method": "gear", "gear.rank_prefill": 0, "gear.rank_chunk": 0,      # outlier-only-2
       "eval.prefill_chunk": 0},
      {"method": "fdc"},
      {"method": "zack"},
      {"method": "zack", "zack.bits": 4},                                   # rotation + 4-bit
      {"method": "evict", "eval.modes": ("decode",), "eval.prefill_chunk": 0},  # + eviction
  ]
