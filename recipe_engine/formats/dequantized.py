"""Dequantized safetensors: every quantized weight stored as its on-grid values in the model dtype, a stock
checkpoint any loader reads (transformers, llama.cpp's converter, every engine), at the model dtype's size."""
from __future__ import annotations

from . import Exporter, register


@register
class Dequantized(Exporter):
    name = "dequantized"
    summary = "the model dtype's weights (values on the grid): any loader, llama.cpp's converter; full size"
    checkpoint = True

    def scale_dtype(self, weight_dtype):
        """The model dtype, as compressed-tensors stores them: the values written are bit for bit the packed
        default's dequantized, so switching ``export`` changes the file, never the model."""
        return weight_dtype
