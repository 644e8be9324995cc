"""fp8_block kernels: Triton and cuBLAS on CUDA, the plain-torch reference (``mxfx.numerics.block``) elsewhere
(:mod:`mxfx.kernels`)."""
