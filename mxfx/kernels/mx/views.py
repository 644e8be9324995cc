"""How the MX kernels view their inputs and lay out their scales (plain torch; no Triton).

A kernel reads ``x [..., C]`` as a 3D ``[B, R, C]`` view (:func:`as_brc`) and blocks it along C.
The logical shape of the scales is always ``[..., C/32]`` (OCP MX v1.0 §5: one E8M0 scale per
32 consecutive values); their *layout* is chosen so that each program of the kernel writes whole
32-byte sectors:

* **row-major** (contiguous): tiles that hold many blocks of each row, or a stream of blocks
  (rowwise quantize of a contiguous tensor, SwiGLU, route-weight);
* **MN-major** (the transpose view of a contiguous ``[..., C/32, R]`` tensor): tiles of a few
  blocks per row, which write a few scale bytes per row and one sector per row in row-major
  order, but whole sectors here (measured: docs/kernel-notes.md, "Kernel choices"). :func:`lastdim_scales` says when
  ``quantize_lastdim`` writes them so (a transposed input: the columnwise operand); both orientations of the dual
  quantizes always do.

Consumers index scales through their strides (the dequantize kernels, ``to_blocked`` for native
GEMMs), so either layout serves every GEMM path. The CPU reference path and the ops' fake
implementations lay their scales out with these same functions, so eager, compiled and CPU
results have one layout.
"""

from __future__ import annotations

import math

import torch

from mxfx.numerics.mx import BLOCK_SIZE

try:
    from torch.fx.experimental.symbolic_shapes import guard_or_false
except ImportError:  # older torch: sizes are plain ints or backed symbols here

    def guard_or_false(cond) -> bool:
        return bool(cond)


def _merge_into_rows(shape, strides) -> bool:
    """Whether dims ``shape`` (with ``strides``) merge into one dim with a single stride, the test
    ``Tensor.view`` makes (size-1 dims never matter). Decided from sizes and strides, without a
    failing ``view`` (Dynamo does not trace an exception raised by one), and without guarding on
    data-dependent sizes (the token counts after an all-to-all): undecidable means no."""
    dims = [(n, st) for n, st in zip(shape, strides) if not guard_or_false(n == 1)]
    return all(guard_or_false(dims[i][1] == dims[i + 1][1] * dims[i + 1][0]) for i in range(len(dims) - 1))


def brc_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., C]`` as a 3D ``[B, R, C]`` view without copying, or None when strides do not allow one.

    All leading dims merge into R when they can (B = 1); otherwise a 3D x keeps its first dim as B
    (a transposed 3D view, say), and a 4D+ x merges its dims after the first into R when they can.
    """
    c = x.shape[-1]
    if x.dim() == 1:
        return x.view(1, 1, c)
    lead = x.shape[:-1]
    if guard_or_false(x.numel() == 0) or _merge_into_rows(lead, x.stride()[:-1]):
        return x.view(1, math.prod(lead), c)
    if x.dim() == 3:
        return x
    if _merge_into_rows(lead[1:], x.stride()[1:-1]):
        return x.view(x.shape[0], math.prod(lead[1:]), c)
    return None


def as_brc(x: torch.Tensor) -> torch.Tensor:
    """:func:`brc_view` of ``x``, or of a contiguous copy when strides allow no view."""
    v = brc_view(x)
    return v if v is not None else x.contiguous().view(1, math.prod(x.shape[:-1]), x.shape[-1])


def scale_shape(shape) -> tuple:
    """Shape of the scales of a tensor blocked along its last dim.

    Raises:
        ValueError: ``shape`` is 0-d (no axis to block).
    """
    if len(shape) == 0:
        raise ValueError("mxfx: a scalar cannot be block-quantized; give a tensor with at least one dimension")
    return (*shape[:-1], shape[-1] // BLOCK_SIZE)


def mn_major(shape, like: torch.Tensor) -> torch.Tensor:
    """Empty uint8 tensor of logical ``shape [..., R, C]`` (2D+) stored MN-major: the transpose view
    of a contiguous ``[..., C, R]`` tensor, on ``like``'s device."""
    *lead, r, c = shape
    return like.new_empty((*lead, c, r), dtype=torch.uint8).transpose(-2, -1)


def mn_major_brc(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(B, R, C)`` of x's ``[B, R, C]`` view (:func:`brc_view`) when it is strided along C, whose
    scales ``quantize_lastdim`` writes MN-major (storage ``[B, C/32, R]``); None otherwise."""
    v = brc_view(x) if x.dim() >= 2 else None
    if v is None or v.stride(2) == 1:
        return None
    return tuple(v.shape)


def lastdim_scales(x: torch.Tensor) -> torch.Tensor:
    """Uint8 scales ``[..., C/32]`` for ``quantize_lastdim(x [..., C])``, laid out as the kernel writes them.

    Row-major when x's ``[B, R, C]`` view (:func:`brc_view`) has unit stride along C, or is
    copied first; MN-major per batch (storage ``[B, C/32, R]``, :func:`mn_major_brc`) when it is
    strided along C: a transposed view such as ``w.t()`` or the token-blocked ``x.t()`` of a wgrad,
    whose tiles hold one block per row. Empty; the kernel wrapper allocates the same storage
    (:func:`mn_major_storage_shape`) and views it with :func:`mn_major_view`.
    """
    shape = scale_shape(x.shape)
    brc = None if x.dim() < 2 or guard_or_false(x.stride(-1) == 1) else mn_major_brc(x)
    if brc is None:
        return x.new_empty(shape, dtype=torch.uint8)
    return mn_major_view(x.new_empty(mn_major_storage_shape(x, brc), dtype=torch.uint8), shape)


def mn_major_view(storage: torch.Tensor, shape) -> torch.Tensor:
    """The logical scales ``shape [..., R, C/32]`` of MN-major ``storage`` (``[C/32, R]`` or ``[B, C/32, R]``).

    A 2D x (or a 3D one viewed per batch) needs the transpose alone: no reshape of a buffer a kernel wrote,
    which torch 2.11's Inductor can lose track of under dynamic shapes (pytorch/pytorch#189271).
    """
    view = storage.transpose(-2, -1)
    return view if tuple(view.shape) == tuple(shape) else view.view(shape)


def mn_major_storage_shape(x: torch.Tensor, brc: tuple[int, int, int]) -> tuple:
    """Shape of the contiguous storage of MN-major scales for x: ``[C/32, R]`` when B = 1 and x is 2D,
    else ``[B, C/32, R]`` (see :func:`lastdim_scales`)."""
    b, r, c = brc
    return (c // BLOCK_SIZE, r) if b == 1 and x.dim() == 2 else (b, c // BLOCK_SIZE, r)


def laid_out_as(src: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """``src``'s values in ``layout`` (an empty tensor of src's shape from :func:`lastdim_scales` or
    :func:`mn_major`): what the CPU reference path returns, so its layout is the kernels'."""
    return layout.copy_(src)
