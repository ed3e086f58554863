"""kvlowrank: KV-cache compression along the hidden dimension, in JAX."""

__version__ = "0.1.0"

from kvlowrank.spec import ModelSpec, RopeScaling
