"""MX autograd ops: the replacements the graph passes insert."""

from mxfx.kernels.mx_gemm import mx_mm  # noqa: F401
from mxfx.ops.linear import mx_linear  # noqa: F401
