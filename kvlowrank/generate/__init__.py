"""Jitted batched generation (prefill + `lax.while_loop` decode) with any registered cache."""

from kvlowrank.generate.loop import GenerationResult, generate
from kvlowrank.generate.runner import run
from kvlowrank.generate.sampling import (Greedy, Sampler, SamplerConfig, Temperature, TopK,
                                         TopP, make_sampler, sampler_from_config)
