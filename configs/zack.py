r"""ZACK: post-RoPE rotated K' (one Q-K rotation per KV head) + V rotated by the SVD of
[V; W_O^hᵀ] with Rᵀ folded into W_O, adaptive per-head widths (kvlowrank.methods.rotated).

  python experiments/evaluate.py --config=configs/zack.py --workdir=runs/zack
  python experiments/evaluate.py --config=configs/zack.py:ratio=0.5,bits=4 --workdir=runs/zack
  python experiments/evaluate.py --config=configs/zack.py:smoke --workdir=/tmp/smoke
  python experiments/sweep.py --config=configs/zack.py --workdir=runs/rotated
  python experiments/search_rate.py --config=configs/zack.py --workdir=runs/zack_search

Args after `:` and the sweep: as configs/fdc.py (one family, two recipes; the zack section
has the same fields, kvlowrank.methods.rotated.RotatedSpec; v_decomposition is FDC's only).
get_sweep() is configs/fdc.py's (FDC and ZACK points in one workdir).

Measured: results/rotated.md.
"""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_configs_fdc", Path(__file__).with_name("fdc.py"))
_fdc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fdc)


def get_config(arg=None):
  return _fdc.build("zack", arg)


def get_sweep(arg=None):
  return _fdc.get_sweep(arg)
