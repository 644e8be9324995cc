"""The weight operands the GEMM ops read: custom ops (``mxfx::cached_weight_*``) over :func:`store.lookup`.

Compiled graphs call them opaquely (each has a fake implementation giving the form's shape and strides);
their run-time bodies return the cached form when it is fresh and rebuild it when it is not.
"""

from __future__ import annotations

import torch

from mxfx.runtime.cache.forms import _E4M3, ORIENTATIONS, _fake_form, source_layout
from mxfx.runtime.cache.store import _check, lookup


def _check_mx_orientation(orientation: str) -> None:
    if orientation not in ORIENTATIONS:
        raise ValueError(f"mxfx.runtime.cache: orientation={orientation!r} is not valid; choose one of {ORIENTATIONS}")


@torch.library.custom_op("mxfx::cached_weight_quantize", mutates_args=())
def _cached_weight_quantize(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, orientation)


@_cached_weight_quantize.register_fake
def _(weight, rule, orientation):
    _check_mx_orientation(orientation)
    _check(weight, rule, orientation)
    return _fake_form(weight, orientation, _E4M3), _fake_form(weight, orientation, torch.uint8, scales=True)


def weight_operand(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The MX operand of a weight for one GEMM orientation, from its cache (the recipe, "Forward, Dgrad, and Wgrad Need Different Operands").

    A torch custom op (``mxfx::cached_weight_quantize``) with a fake
    implementation, so compiled graphs call it opaquely; its run-time body
    returns the cached pair when the cache is fresh (same storage region, same
    ``weight._version``), builds it when it is missing (a dgrad form after a
    refresh), and rebuilds the weight's forms when they are stale.

    Args:
        weight: the high-precision parameter (fp32 main weight, bf16 or fp16),
            ``[N, K]`` or ``[E, N, K]``, N and K multiples of 32, any strides.
        rule: scale rule, "rceil" or "floor".
        orientation: "forward": ``W`` blocked along K, returns qdata
            ``[..., N, K]`` and scales ``[..., N, K/32]``; "dgrad":
            ``W.transpose(-2, -1)`` blocked along N, returns qdata
            ``[..., K, N]`` and scales ``[..., K, N/32]``.

    Returns:
        ``(qdata float8_e4m3fn, scales uint8 E8M0)``, the cache itself: treat them
        as read-only. Contiguous where the GEMM runs natively; there the scales of a 2D weight
        are kept in the blocked layout the native GEMM reads (1D, ``blocked_numel(N, K/32)`` /
        ``blocked_numel(K, N/32)`` bytes, :func:`blocked_scales`). Where it is emulated (Hopper,
        CPU; :func:`source_layout`) one pass writes both pairs in the weight's own layout: the
        forward scales MN-major (the transpose view of a contiguous ``[..., K/32, N]`` tensor),
        the dgrad pair the transpose views of contiguous ``[..., N, K]`` / ``[..., N/32, K]``
        tensors (docs/format.md, "Scale memory layouts").

    Raises:
        ValueError: unknown rule or orientation, a weight that is not 2D/3D, has
            dims that are not multiples of 32, or is not a float of 16+ bits.
    """
    with torch.no_grad():
        return _cached_weight_quantize(weight, rule, orientation)


@torch.library.custom_op("mxfx::cached_weight_dequantized", mutates_args=())
def _cached_weight_dequantized(weight: torch.Tensor, rule: str, orientation: str) -> torch.Tensor:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, orientation + "_bf16")[0]


@_cached_weight_dequantized.register_fake
def _(weight, rule, orientation):
    _check(weight, rule, orientation)
    return _fake_form(weight, orientation, torch.bfloat16)


def weight_dequantized(weight: torch.Tensor, rule: str, orientation: str) -> torch.Tensor:
    """The dequantized BF16 operand of a weight for one orientation, from its cache.

    Exactly ``dequantize(*weight_operand(weight, rule, orientation))`` in BF16, with the
    scales read back from the blocked layout where the cache keeps them so (:func:`blocked_scales`)
    (the MX values; exact except in blocks whose scale is below 2^-118, where
    BF16 flushes E4M3 subnormals), kept as the cache form
    ``(rule, orientation + "_bf16")`` and rebuilt with the weight's other forms once per
    optimizer step. For ``Policy.keep_dequantized_weights``: the emulated GEMM
    takes it instead of dequantizing the weight on every call. Costs 2 bytes
    per value per orientation of persistent memory.

    Args:
        weight: as for :func:`weight_operand`.
        rule: "rceil" or "floor".
        orientation: "forward" (``[..., N, K]``) or "dgrad" (``[..., K, N]``).

    Returns:
        bf16 tensor of the oriented shape; the cache itself: read-only.

    Raises:
        ValueError: as for :func:`weight_operand`.
    """
    with torch.no_grad():
        return _cached_weight_dequantized(weight, rule, orientation)


def weight_operands(weight: torch.Tensor, rule: str, orientation: str, keep_dequantized: bool):
    """What an MX GEMM takes of a weight: ``(qdata, scales, dequantized)``.

    ``(qdata, scales)`` from :func:`weight_operand`; ``dequantized`` is
    :func:`weight_dequantized` under ``Policy.keep_dequantized_weights``, else None.
    Where the GEMM is emulated (Hopper, CPU; :func:`source_layout`) and the BF16 form is kept,
    ``qdata`` and ``scales`` are None and the cache holds no MX form of the weight: the emulated
    GEMM reads only the BF16 values (the same values), so each step writes 8 bytes per
    parameter instead of the 10 of MX plus BF16 forms, and the cache holds 4 (against about 2
    for the MX forms alone, without the option).
    Shapes, dtypes and errors as for those two functions.
    """
    if keep_dequantized and source_layout(weight):  # emulated GEMM: the BF16 form is all it reads
        return None, None, weight_dequantized(weight, rule, orientation)
    qdata, scales = weight_operand(weight, rule, orientation)
    return qdata, scales, (weight_dequantized(weight, rule, orientation) if keep_dequantized else None)


@torch.library.custom_op("mxfx::cached_weight_block", mutates_args=())
def _cached_weight_block(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mx_orientation(orientation)
    return lookup(weight, rule, "block_" + orientation)


@_cached_weight_block.register_fake
def _(weight, rule, orientation):
    _check_mx_orientation(orientation)
    _check(weight, rule, "block_" + orientation)
    *lead, n, k = weight.shape
    rows, cols = (n, k) if orientation == "forward" else (k, n)
    q = weight.new_empty([*lead, rows, cols], dtype=_E4M3)
    return q, weight.new_empty([*lead, -(-rows // 128), -(-cols // 128)], dtype=torch.float32)


def block_weight_operand(weight: torch.Tensor, rule: str, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8_block operand of a weight for one GEMM orientation, from its cache (:data:`BLOCK_FORMS`).

    A custom op (``mxfx::cached_weight_block``) like :func:`weight_operand`, with the same freshness: one
    128x128 quantize of the weight per optimizer step serves both orientations.

    Args:
        weight: the high-precision parameter ``[N, K]`` or ``[E, N, K]`` (fp32/bf16/fp16), any dims.
        rule: "rceil" or "amax" (``mxfx.numerics.block.SCALE_RULES``).
        orientation: "forward": qdata ``[..., N, K]``, scales ``[..., ceil(N/128), ceil(K/128)]``;
            "dgrad": qdata ``[..., K, N]``, scales ``[..., ceil(K/128), ceil(N/128)]``.

    Returns:
        ``(qdata float8_e4m3fn, scales float32)``, contiguous; the cache itself: read-only.

    Raises:
        ValueError: unknown rule or orientation, a weight that is not 2D/3D or not a float of 16+ bits.
    """
    with torch.no_grad():
        return _cached_weight_block(weight, rule, orientation)
