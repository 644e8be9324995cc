"""Kernels every format shares: their ops, launching, mxfx's SiLU and SwiGLU, high-precision GEMMs, byte moves."""
