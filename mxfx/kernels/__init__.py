"""MX kernels: Triton on CUDA, the plain-torch reference (``mxfx.numerics.mx``) elsewhere.

Every function here takes and returns plain tensors (scales as uint8 E8M0 bytes)
and picks its implementation from the input's device. Graph code uses the torch
custom ops registered in :mod:`mxfx.kernels.custom_ops`, which wrap these functions.
"""

from mxfx.kernels.device_path import (  # noqa: F401
    dequantize_lastdim,
    quantize_blocked,
    quantize_dequantize,
    quantize_dual,
    quantize_dual_blocked,
    quantize_dual_source,
    quantize_lastdim,
    route_weight_quantize,
    swiglu_quantize,
)
