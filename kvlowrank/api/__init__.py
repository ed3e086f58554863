"""The one-call API: load a model, compress its KV cache with any registered method, then
generate, evaluate and count bytes.

  import kvlowrank
  model = kvlowrank.load("smollm2")                  # progress bar while loading
  cm = kvlowrank.compress(model, "kivi", bits=2)     # or "palu" (calibrates, cached), ...
  cm.generate(["The capital of France is"], max_new_tokens=32)
  cm.evaluate(seq_len=512, max_windows=4)            # PPL (prefill/decode), drift
  cm.nbytes(seq_len=4096, batch=1)                   # allocated cache bytes

Everything goes through the harness's code: method specs are built and validated by the
method registry, calibration (and its orbax cache) is kvlowrank.experiment.evaluate
.calibrated_params, generation is kvlowrank.generate, perplexity and drift are
kvlowrank.eval.
"""

from kvlowrank.api.compress import compress
from kvlowrank.api.compressed import CompressedModel
from kvlowrank.api.load import load

__all__ = ["CompressedModel", "compress", "load"]
