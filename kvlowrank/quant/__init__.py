"""Quantization primitives: uniform asymmetric group quantization with bit-packed
storage (uniform.py, packing.py) and Walsh-Hadamard rotations (hadamard.py)."""

from kvlowrank.quant.hadamard import hadamard_factors, hadamard_matrix, hadamard_transform
from kvlowrank.quant.packing import SUPPORTED_BITS, block_shape, pack, packed_words, unpack
from kvlowrank.quant.uniform import (QTensor, canonical_scale_dtype, dequantize,
                                     dequantize_codes, fake_quant, quantize, quantize_codes,
                                     quantized_nbytes)
