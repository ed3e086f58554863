r"""SnapKV-style eviction (kvlowrank.methods.evict) around the dense, KIVI and GEAR caches.

  python experiments/evaluate.py --config=configs/evict.py:inner=kivi,budget=128 --workdir=runs/evict
  python experiments/evaluate.py --config=configs/evict.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/evict.py --workdir=runs/evict_sweep

Args after `:` (k=v, comma-separated): model, inner (dense | kivi | gear | zack where
registered: the caches with a section below, knobs via --config.evict.inner_specs.<inner>.*;
also palu, xquant, fdc at their defaults; never xquant_cl), budget (tokens kept per
sequence and layer), window (recent tokens never evicted), bits (KIVI/GEAR inner), seq_len,
windows, prompt_len (decode mode: prompt prefilled in one call, then one token per call),
smoke (stories260K, < 2 min; the random tiny model for inner=zack). get_sweep(): budgets {128, 256} x inner {dense, KIVI-2}.
Eviction is judged in decode mode (SnapKV compresses at the end of the prompt), so only
that mode runs; kv_bytes_per_token counts the budget's share of a seq_len context.

KIVI inside the budget: G = 32 and an exact residual R = 32 (not KIVI's 128): the inner
cache holds budget - window tokens, and with R >= that KIVI would never quantize anything.
GEAR inside the budget: the paper's GEAR (s = 2 %, r_p = 4, r_g = 2) over KIVI with
g = n_b = 32 instead of 64, for the same reason (its n_b-token buffer stays exact). Its
accuracy on SmolLM2 is not measured.

Stacking (issue 22 item 5): where the rotated caches are registered (`fdc` / `zack`), the
config also holds inner_specs.zack (ZACK at 50% widths, 4-bit K'/V' KIVI-style, R = 32,
rotation fitted on the WikiText-2 calib windows: random tokens gave a far worse PPL,
results/rotated.md) and `inner=zack` composes rotation + quantization + eviction in one
config; get_sweep() then adds that point at each budget. Rotation + eviction vs each alone
at equal bytes: configs/stack.py.

Measured: results/rotated.md, "Eviction" and "Rotation + eviction" (SmolLM2-135M).
"""

from ml_collections import ConfigDict

from kvlowrank.config_lib import parse_arg
from kvlowrank.experiment.config import apply_smoke, base_config
from kvlowrank.methods import methods

STACK = "zack" in methods()   # the rotated family is registered


def get_config(arg=None):
  arg = parse_arg(arg, model="smollm2", inner="dense", budget=128, window=32, bits=2,
                  seq_len=512, windows=4, prompt_len=256, smoke=False)
  c = base_config()
  c.model.path = arg.model
  c.method = "evict"
  c.evict = ConfigDict(dict(
      inner=arg.inner, budget=arg.budget, window=arg.window, observe=arg.window, pool=5,
      ring="auto", bytes_context=arg.seq_len,
      inner_specs=ConfigDict(dict(
          dense=ConfigDict(),
          kivi=ConfigDict(dict(bits=arg.bits, group_size=32, residual=32,
                               scale_dtype="float16")),
          gear=ConfigDict(dict(bits=arg.bits, group_size=32, buffer=32, sparsity=2.0,
                               rank_prefill=4, rank_chunk=2))))))
  if STACK:
    c.evict.inner_specs.zack = ConfigDict(dict(target_ratio=0.5, bits=4, group_size=16,
                                               residual=32, calibration="data"))
  c.eval.seq_len = arg.seq_len
  c.eval.max_windows = arg.windows
  c.eval.batch_size = arg.windows
  c.eval.modes = ("decode",)
  c.eval.prompt_len = arg.prompt_len
  c.eval.prefill_chunk = 0
  if arg.smoke:
    apply_smoke(c)                 # stories260K, 2 windows of 256, prompt 64
    c.eval.modes = ("decode",)
    c.eval.prefill_chunk = 0
    c.evict.budget = min(arg.budget, 64)
    c.evict.window = c.evict.observe = min(arg.window, 16)
    c.evict.bytes_context = c.eval.seq_len
    c.evict.inner_specs.kivi.group_size = 8     # head dim 8
    c.evict.inner_specs.kivi.residual = 16
    c.evict.inner_specs.gear.group_size = 8     # as configs/gear.py's smoke
    c.evict.inner_specs.gear.buffer = 16
    if arg.inner in ("zack", "fdc"):
      # Widths are multiples of 8 or more: stories260K's head dim 8 leaves nothing to
      # remove; the random tiny model (head dim 32) is the rotated family's smoke model.
      c.model.path = "random:tiny"
      c.evict.inner_specs.zack.residual = 16
  return c


def get_sweep(arg=None):
  del arg
  inners = ("dense", "kivi") + (("zack",) if STACK else ())
  return [{"evict.inner": inner, "evict.budget": budget}
          for inner in inners for budget in (128, 256)]
