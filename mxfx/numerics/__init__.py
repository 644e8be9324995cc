"""Format math: the plain-torch references that kernels match bit for bit (MXFP8, fp8_block) and the scale layouts."""
