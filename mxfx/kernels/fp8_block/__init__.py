"""fp8_block kernels: cuBLAS, Gluon and Triton on CUDA, the plain-torch reference (``mxfx.numerics.block``)
elsewhere (:mod:`mxfx.kernels`)."""
