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
g = n_b = 32 instead of 64, for the same reason (its n_b-token buffer stays exact). Not
measured here (no expected numbers below).

Stacking (issue 22 item 5): where the rotated caches are registered (`fdc` / `zack`), the
config also holds inner_specs.zack (ZACK at 50% widths, 4-bit K'/V' KIVI-style, R = 32,
rotation fitted on the WikiText-2 calib windows: random tokens gave a far worse PPL,
results/rotated.md) and `inner=zack` composes rotation + quantization + eviction in one
config; get_sweep() then adds that point at each budget. Rotation + eviction vs each alone
at equal bytes: configs/stack.py.

Expected (measured 2026-11-25 on the loaded 2-core CPU box: SmolLM2-135M fp32, bf16 K/V,
the first 2 WikiText-2 test windows of 512 tokens (windows=2), decode mode: prompt 256 in
one call, then 255 one-token calls; window = observe = 32, pool 5). PPL over all 511
predictions / the 255 prompt predictions / the 256 predictions of tokens 256..511;
KV B/token: kv_bytes_per_token at a 512-token context (allocated bytes / 512 in brackets):

  | cache | PPL all | prompt | after prompt | KV B/token |
  |---|---|---|---|---|
  | dense | 28.224 | 34.088 | 23.386 | 23040 (23040) |
  | KIVI-2 (G 32, R 128) | 40.808 | 56.163 | 29.688 | 4320 |
  | KIVI-2 (G 32, R 32) | 44.237 | 60.604 | 32.330 | 4320 (5760) |
  | evict(dense) budget 256 | 34.623 | 34.095 | 35.156 | 11520 (13020) |
  | evict(dense) budget 128 | 38.047 | 34.088 | 42.448 | 5760 (7230) |
  | evict(KIVI-2 R 32) budget 256 | 52.209 | 58.347 | 46.737 | 2160 (4830) |
  | evict(KIVI-2 R 32) budget 128 | 46.593 | 47.066 | 46.128 | 1080 (3720) |

(The prompt's own predictions see the whole prompt, as SnapKV's prefill: evict(dense)
matches dense there. After the prompt the cache is full and each decode step evicts the
token leaving the window. Stacked with KIVI-2 the quantization error dominates at both
budgets on this 135M model; 2 windows, so differences of ~1 PPL are noise.)
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
