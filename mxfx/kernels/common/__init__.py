"""Kernels every format shares: device facts, launching, mxfx's SiLU and SwiGLU, high-precision GEMMs, byte moves."""
