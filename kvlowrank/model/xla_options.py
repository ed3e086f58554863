"""XLA compile options for the jitted decode programs: `generate`'s decode loop,
`kvlowrank.eval.perplexity`'s windows (decode mode's T = 1 steps) and the decode benchmark's
timed loop (`kvlowrank.bench.decode`), so the benchmark times what the user runs.

`DECODE` asks XLA to record each CUDA graph (command buffer) as a DAG of its commands'
buffer dependencies (`CONCURRENT`) instead of the scheduled sequence (the default, `LHS`).
Commands that share no buffer may then overlap on the GPU (which ones do is XLA's
choice). The results are the same ops on the same buffers. Measured effect: BENCHMARKS.md
("Whole-model decode") and `results/decode_ablations.md`. On CPU the option is accepted
and has no effect, and XLA validates its value there, so the CPU tests catch a bad one.
"""

DECODE = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
