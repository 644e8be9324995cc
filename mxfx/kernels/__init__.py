"""mxfx's kernels, one folder per format and one for what every format shares.

* :mod:`mxfx.kernels.mx`: MXFP8 (E4M3 + an E8M0 scale per 32 values). ``device_path`` picks Triton on CUDA or
  the plain-torch reference (:mod:`mxfx.numerics.mx`) elsewhere; ``custom_ops`` wraps it as the ``mxfx::*`` torch
  ops graphs call; ``gemm`` chooses a native or an emulated MX GEMM and holds the emulation, ``gemm_blackwell``
  the native ones; ``operands`` the GEMM operands quantize passes make, ``swiglu_operand`` the SwiGLU input side; ``quant_stats`` the fused quantization-statistics kernel. The Triton modules
  (``blocks``, ``quantize``, ``dual``, ``dequantize``, ``swiglu``, ``quant_stats``) are imported only once a CUDA
  tensor arrives.
* :mod:`mxfx.kernels.fp8_block`: fp8_block (E4M3 + FP32 scales per 1x128 tile / 128x128 block), laid out the
  same way: ``device_path``, ``custom_ops`` (``mxfx::block_*``), ``gemm`` (which kernel runs, and the reference
  decode: cuBLAS dense ``gemm_cublas``; grouped Gluon ``grouped_gemm_sm90`` or Triton ``grouped_gemm_triton``),
  Triton ``quantize`` and ``quant_stats`` (the fused quantization-statistics kernel).
* :mod:`mxfx.kernels.common`: format-free pieces, laid out the same way: ``custom_ops`` (``mxfx::hp_mm``,
  ``mxfx::grouped_wgrad_bf16``, ``mxfx::swiglu_product`` and the high-precision GEMMs callers use), ``gemm`` (their
  bodies and the accumulating GEMMs every reference shares; Triton ``grouped_wgrad_triton``), how kernels launch
  and enter graphs (``launch``), mxfx's SiLU and SwiGLU (``silu``, ``swiglu``, Triton ``silu_triton``), byte moves
  (``transpose``, ``zero_rows``), and the reduction every format's statistics kernel ends in (Triton
  ``quant_stats``).

Imports run one way: ``mx`` and ``fp8_block`` use ``common``, :mod:`mxfx.numerics` and the device facts of
:mod:`mxfx.device`, never each other.
"""
