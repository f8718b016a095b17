"""Quantised frozen weights: NF4 (QLoRA's, bit for bit bitsandbytes') and int8 per channel."""

from ._array import (
    DoubleQuantizedScales as DoubleQuantizedScales,
    QuantizedArray as QuantizedArray,
    is_quantized as is_quantized,
    quantize as quantize,
)
from ._linear import (
    QuantConfig as QuantConfig,
    QuantizedLinear as QuantizedLinear,
    dequantized_linear as dequantized_linear,
    quantize_linears as quantize_linears,
    quantizing as quantizing,
)
