"""MXFP8 kernels: Triton on CUDA, the plain-torch reference (``mxfx.numerics.mx``) elsewhere (:mod:`mxfx.kernels`)."""
