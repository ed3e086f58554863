"""Pure functional Llama-family transformer."""

from kvlowrank.model.params import cast_params, check_params, count_params, init_params
from kvlowrank.model.transformer import forward, rms_norm
