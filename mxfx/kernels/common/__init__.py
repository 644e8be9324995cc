"""Kernels every format shares: launching, mxfx's SiLU and SwiGLU, high-precision GEMMs, byte moves."""
