"""MXFP8 kernels: native GEMMs on Blackwell, Triton on CUDA, the plain-torch reference (``mxfx.numerics.mx``) and
emulated GEMMs elsewhere (:mod:`mxfx.kernels`)."""
