"""Shared helpers of the GPU benchmarks (`experiments/bench_*.py`, `kernel_report.py`).

One module per concept:
  timing    how a decode op is timed: `time_op` (chained executables), `time_fn`,
            `chained`, and the device's ceilings (`measure_ceilings`);
  inputs    seeded random fills built in one kernel (`rand`, `rand_u8`);
  env       the device and software versions that head every result (`environment`);
  memory    the device's memory counters (`peak_bytes`, `bytes_in_use`, `bytes_limit`);
  roofline  roofline, % of roofline and speed-up over the best dense kernel (`finalize`);
  ops       where a call's device time goes: per kernel and category, from a profiler trace
            (`ops.op_times`);
  decode    the whole-model decode benchmark (`experiments/bench_decode.py`);
  compare   decode runs side by side, the step split into attention and rest
            (`experiments/decode_report.py`).

Measurements made with them are in BENCHMARKS.md, not here.
"""

from kvlowrank.bench.env import environment
from kvlowrank.bench.inputs import rand, rand_u8
from kvlowrank.bench.memory import bytes_in_use, bytes_limit, peak_bytes
from kvlowrank.bench.roofline import finalize
from kvlowrank.bench.timing import Ceilings, Timing, chained, measure_ceilings, time_fn, time_op

__all__ = ["Ceilings", "Timing", "bytes_in_use", "bytes_limit", "chained", "environment",
           "finalize", "measure_ceilings", "peak_bytes", "rand", "rand_u8", "time_fn",
           "time_op"]
