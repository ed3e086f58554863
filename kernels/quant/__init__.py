"""The project's one quantizer (`quantizer`) and one bit-packing module (`packing`).

Every cache and every kernel stores codes through these two modules, so a cache's arrays
are its kernel's operands.
"""

from .packing import SUPPORTED_BITS, block_shape, check_bits, pack, packed_words, unpack
from .quantizer import (QTensor, canonical_scale_dtype, dequantize, dequantize_codes,
                        fake_quant, quantize, quantize_codes, quantized_nbytes)
