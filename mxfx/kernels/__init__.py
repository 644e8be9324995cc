"""mxfx's kernels, one folder per format and one for what every format shares, each laid out alike:

* ``custom_ops.py``: every torch op of the folder (namespace ``mxfx``, with its fake implementation), GEMMs
  included, and the functions callers reach them by;
* ``gemm.py``: the bodies of its GEMM ops, which choose the kernel (native or emulated), and the reference decode;
* ``device_path.py`` (a format's folder): the same choice for its quantize kernels, Triton on CUDA, the plain-torch
  reference of :mod:`mxfx.numerics` elsewhere;
* one file per hardware kernel, named for what it is or its architecture.

The folders:

* :mod:`mxfx.kernels.mx`: MXFP8 (E4M3 + an E8M0 scale per 32 values). ``gemm_blackwell`` the native GEMMs (torch's
  scaled GEMMs on sm100 / sm120), ``gemm`` the emulation; ``operands`` the GEMM operands quantize passes make,
  ``swiglu_operand`` the SwiGLU input side of a GEMM; Triton ``blocks``, ``quantize``, ``dual``, ``dequantize``,
  ``swiglu`` and ``quant_stats`` (the fused quantization-statistics kernel), imported only once a CUDA tensor
  arrives, with the argument checks (``checks``) and scale views (``views``) both paths share.
* :mod:`mxfx.kernels.fp8_block`: fp8_block (E4M3 + FP32 scales per 1x128 tile / 128x128 block): cuBLAS's dense
  GEMM ``gemm_cublas``; the grouped GEMM in Gluon for sm90 (``grouped_gemm_sm90``) or in Triton
  (``grouped_gemm_triton``); Triton ``quantize`` and ``quant_stats``.
* :mod:`mxfx.kernels.common`: format-free pieces: the ops ``mxfx::hp_mm``, ``mxfx::grouped_wgrad_bf16`` and
  ``mxfx::swiglu_product`` (``custom_ops``); the high-precision GEMM bodies and the accumulating GEMMs every
  reference shares (``gemm``; the grouped wgrad into FP32 in Triton, ``grouped_wgrad_triton``, and in Gluon for
  sm90, ``grouped_wgrad_sm90``); how kernels launch and enter graphs (``launch``)
  and keep their autotuning results (``tuning``); mxfx's SiLU and SwiGLU (``silu``, ``swiglu``, Triton
  ``silu_triton``); byte moves (Triton ``transpose``, ``zero_rows``); the reduction every format's statistics
  kernel ends in (Triton ``quant_stats``).

Imports run one way: in a folder from ``custom_ops`` (and the operand makers above it) down to ``gemm`` and
``device_path``, then the kernels; ``mx`` and ``fp8_block`` use ``common``, :mod:`mxfx.numerics` and the device
facts of :mod:`mxfx.device`, never each other.
"""
