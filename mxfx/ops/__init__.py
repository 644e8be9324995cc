"""MX autograd ops: the replacements the graph passes insert."""

from mxfx.ops.linear import mx_linear  # noqa: F401
