r"""The long-context job: passkey retrieval and needle-in-a-haystack accuracy of every
method vs context length and needle depth, through each method's real decode path.

  python experiments/longctx.py --config=configs/longctx.py --workdir=runs/longctx
  python experiments/longctx.py --config=configs/longctx.py:cpu --workdir=runs/longctx
  python experiments/longctx.py --config=configs/longctx.py:smoke --workdir=/tmp/lc_smoke
  python experiments/longctx.py --config=configs/longctx.py:tasks=ruler --workdir=runs/ruler

Each prompt (kvlowrank.eval.passkey: KIVI's passkey format; kvlowrank.eval.needle: a
RULER-style fact in WikiText-2 text) is prefilled into a fresh cache of the method and
the answer decoded greedily (kvlowrank.generate.generate); the score is the exact match
of the answer's first word. Resumable: <workdir>/results.jsonl holds one record per
prompt; the report (longctx.md, longctx_accuracy.png, heatmap_<method>.png) is written
at the end.

Methods (get_sweep): dense (bf16), KIVI-2 and KIVI-4 (G = 32, R = 128: the last 128
tokens stay exact, so depth 100% sits in KIVI's exact window), Palu-50% (G-LRD, Fisher
ranks, whitened SVD, bf16 latents; calibrated on WikiText-2 validation, cached in the
workdir), XQuant-2 (GQA latent path, groups of 64) and GEAR-2 (2-bit KIVI backbone, s = 2 %,
ranks 4 / 2), as in configs/main.py. Any
other registered method (kvlowrank.methods, e.g. one that lands later) runs with
`:methods=dense+<name>` at its spec's defaults (or add its section below and a point
to _METHODS).

Args after `:`: model, methods ("" = the six above; else "+"-joined labels of
_METHODS or registered method names), tasks (passkey+needle, +longbench, +ruler; joined by "+"),
samples (prompts per cell), cpu (the sizing measured on the shared 2-core CPU box:
depths 0/50/100% at 1K, 50% at 2K, 4K and 8K, passkey only at 8K; 1 prompt per
cell), smoke (stories260K,
contexts 256/512, dense and KIVI-2; seconds).
Contexts count prompt + max_new_tokens (12): SmolLM2-135M-Instruct's window is 8192
(llama.context_length of its GGUF), so 8K fills it exactly.

Measured: results/longctx.md (on the CPU box with :cpu).
"""

from ml_collections import ConfigDict, config_dict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config

_METHODS = [
    {"method": "dense", "longctx.label": "dense"},
    {"method": "kivi", "kivi.bits": 2, "longctx.label": "KIVI-2"},
    {"method": "kivi", "kivi.bits": 4, "longctx.label": "KIVI-4"},
    {"method": "palu", "longctx.label": "Palu-50%"},
    {"method": "xquant", "xquant.bits": 2, "longctx.label": "XQuant-2"},
    # GEAR-2 at GearSpec's defaults (configs/main.py's GEAR-2: 2-bit KIVI backbone,
    # g = n_b = 64, s = 2 %, r_p = 4, r_g = 2); no section, so no other point's key changes.
    {"method": "gear", "longctx.label": "GEAR-2"},
]


def _args(arg):
  return parse_arg(arg, model="smollm2", methods="", tasks="passkey+needle", samples=1,
                   cpu=False, smoke=False)


def get_config(arg=None):
  arg = _args(arg)
  c = base_config()
  c.model.path = arg.model
  c.method = "dense"
  c.cache_dtype = "bfloat16"
  c.kivi = ConfigDict(dict(bits=2, group_size=32, residual=128,
                           v_bits=config_dict.placeholder(int), scale_dtype="float16"))
  c.palu = ConfigDict(dict(granularity="g", group_size=0, decomposition="whiten",
                           rank_search="fisher", target_ratio=0.5, rank_multiple=16,
                           fisher_reduce="rms", hadamard=True,
                           bits=config_dict.placeholder(int), window=0, damping=1e-6,
                           fisher_samples=8))
  c.xquant = ConfigDict(dict(bits=2, group_size=64, window=0, path="auto",
                             key_axis="channel", value_axis="token", n_high_layers=0,
                             high_bits=4, scale_dtype="float16",
                             implementation=config_dict.placeholder(str)))
  c.longctx = ConfigDict(dict(
      tasks=tuple(arg.tasks.split("+")), contexts=(1024, 2048, 4096, 8192),
      depths=(0.0, 0.25, 0.5, 0.75, 1.0), depth_overrides=(), task_overrides=(),
      samples=arg.samples,
      seed=0, max_new_tokens=12, filler_chars=200_000, data_path="", label="",
      longbench=("narrativeqa", "qasper", "hotpotqa", "passage_retrieval_en"),
      ruler="4096", hf_samples=20, hf_revision=""))
  if arg.cpu:
    # The sizing measured on the shared 2-core CPU box (~8 jobs at once): 3 depths at
    # 1K, 50% beyond, passkey only at 8K (an 8K prefill is ~1 min of an idle 2-core CPU).
    c.longctx.depths = (0.0, 0.5, 1.0)
    c.longctx.depth_overrides = ((2048, (0.5,)), (4096, (0.5,)), (8192, (0.5,)))
    c.longctx.task_overrides = ((8192, ("passkey",)),)
  if arg.smoke:
    apply_smoke(c)                 # stories260K (512-token window), KIVI G = 8, R = 32
    c.palu.rank_multiple = 8
    c.palu.fisher_samples = 0
    c.xquant.group_size = 32
    c.longctx.contexts = (256, 512)
    c.longctx.depths = (0.0, 1.0)
    c.longctx.filler_chars = 4000  # its pure-Python tokenizer is slow on long texts
    c.longctx.ruler = "4096"
  return c


def get_sweep(arg=None):
  arg = _args(arg)
  if not arg.methods:
    return _METHODS[:2] if arg.smoke else list(_METHODS)
  known = {p["longctx.label"]: p for p in _METHODS}
  return [known.get(m, {"method": m, "longctx.label": m}) for m in arg.methods.split("+")]
