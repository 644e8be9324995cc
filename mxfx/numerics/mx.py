"""MXFP8 format math: the plain-torch reference for quantize and dequantize.

Everything here follows OCP Microscaling Formats (MX) v1.0 (§5.3 E8M0 scale,
§6.3 conversion, §5.1 block size 32) with the E4M3 payload of OCP FP8, and the
rceil scale rule of NVIDIA's MXFP8 training recipe. This is the one place where
the scale rules live; GPU kernels must agree with it bit for bit.

Conventions (kept in one place so kernels and tests share them):

* ``qdata``: ``torch.float8_e4m3fn``, same shape as the input.
* ``scales``: one E8M0 byte per 32 consecutive values along the quantized axis.
  Inside mxfx graphs they travel as ``torch.uint8`` (Inductor and collectives do
  not handle ``float8_e8m0fnu`` well); the public :func:`quantize` returns them as
  ``torch.float8_e8m0fnu``, a free view of the same bytes.
* Special blocks:

  - all zeros: scale byte 0 (2^-127), payload ±0 (the sign of each zero is kept, as torchao does).
  - any NaN **or ±Inf** in the block: scale byte 255 (E8M0 NaN) and every payload
    byte NaN (0x7F), so the whole block dequantizes to NaN. E4M3 has no infinity
    and no finite scale can carry one; mxfx marks the block non-finite rather
    than clamp the Inf to ±448 (which would hide an overflow) or let a huge
    scale flush the rest of the block to zero (which would hide the other 31
    values silently). This differs from torchao 0.18, which flushes them.
  - tiny blocks: the exponent clamps at -127 and the payload is computed with
    that stored scale (possibly E4M3 subnormal or zero).
"""

from __future__ import annotations

from typing import Literal

import torch

BLOCK_SIZE = 32
"""Values sharing one E8M0 scale (OCP MX v1.0 §5.1)."""

E4M3_MAX = 448.0
"""Largest finite E4M3 magnitude, 1.75 x 2^8 (OCP FP8)."""

E4M3_MAX_POW2_EXP = 8
"""Exponent of the largest power of two E4M3 represents (256): the floor rule's offset."""

E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

ScaleRule = Literal["rceil", "floor"]
SCALE_RULES: tuple[str, ...] = ("rceil", "floor")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rule(rule: str, op: str = "mxfx.quantize") -> None:
    """Raise ValueError unless ``rule`` is a known scale rule."""
    if rule not in SCALE_RULES:
        raise ValueError(f"{op}: unknown scale rule {rule!r}; valid rules: {', '.join(SCALE_RULES)}")


def check_block_axis(shape: torch.Size | tuple, axis: int, op: str) -> int:
    """Normalise ``axis`` and check its length is a multiple of 32 (0 is allowed: empty outputs).

    Returns the non-negative axis. Raises ValueError naming the op and shape (TypeError for a
    non-int axis).
    """
    ndim = len(shape)
    if ndim == 0:
        raise ValueError(f"{op}: a scalar cannot be block-quantized; give a tensor with at least one dimension")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{op}: axis {axis!r} for shape {tuple(shape)} must be an int dimension index")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for shape {tuple(shape)}")
    axis = axis % ndim
    if shape[axis] % BLOCK_SIZE != 0:
        raise ValueError(
            f"{op}: axis {axis} of shape {tuple(shape)} has length {shape[axis]}, not a multiple of "
            f"{BLOCK_SIZE}; pad it to a multiple of {BLOCK_SIZE} (e.g. with torch.nn.functional.pad) "
            f"or keep this tensor in high precision"
        )
    return axis


def scale_exponent(amax: torch.Tensor, rule: str) -> torch.Tensor:
    """Unbiased E8M0 exponent e per block from the block's absolute maximum.

    Args:
        amax: float32 tensor of block maxima (>= 0, may hold NaN/Inf).
        rule: ``"rceil"``: the smallest e with amax / 2^e <= 448 (no value
            saturates); ``"floor"``: floor(log2(amax)) - 8 (OCP MX v1.0 §6.3),
            values above 448 x 2^e saturate.

    Returns:
        int32 tensor of exponents clamped to [-127, 127]. Zero blocks give -127;
        the value for non-finite blocks is unspecified (callers mark them NaN).

    Both rules are computed exactly from the float32 mantissa and exponent
    (``frexp``), never through ``log2`` rounding.
    """
    mantissa, exp = torch.frexp(amax)  # amax = mantissa * 2^exp, mantissa in [0.5, 1)
    e = exp - 1 - E4M3_MAX_POW2_EXP  # floor(log2(amax)) - 8
    if rule == "rceil":
        # amax in [2^(exp-1), 2^exp); 448 * 2^e = 1.75 * 2^(exp-1): one step up when above it.
        e = e + (mantissa * 2 > E4M3_MAX / 2**E4M3_MAX_POW2_EXP).to(torch.int32)
    elif rule != "floor":
        check_rule(rule)
    e = torch.where(amax == 0, torch.full_like(e, E8M0_MIN_EXP), e)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def quantize_lastdim(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MXFP8 quantize along the last dimension, scales as uint8.

    Args:
        x: ``[..., K]`` bf16/fp16/fp32 tensor, K a multiple of 32; any strides.
        rule: ``"rceil"`` or ``"floor"``.

    Returns:
        ``(qdata, scales)``: qdata ``float8_e4m3fn [..., K]`` (contiguous),
        scales ``uint8 [..., K // 32]`` holding E8M0 bytes.
    """
    q, s, _ = quantize_blocks(x, rule)
    return q, s


def quantize_blocks(
    x: torch.Tensor, rule: str = "rceil", dim: int = -1, dequantized: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference MXFP8 quantize in blocks of 32 along ``dim``, -1 (rowwise) or -2 (columnwise, in x's
    own layout: no transpose), optionally with the dequantized values from the same pass.

    Args:
        x: ``[..., M, K]`` bf16/fp16/fp32 (1D allowed with ``dim=-1``), the blocked dim a multiple of 32.
        rule: ``"rceil"`` or ``"floor"``.
        dim: -1 or -2.
        dequantized: also return ``x_hat`` = :func:`dequantize_lastdim` of the pair in this dtype.

    Returns:
        ``(qdata, scales, x_hat)``: qdata ``float8_e4m3fn`` of x's shape, contiguous; scales uint8 of x's
        shape with ``dim`` divided by 32, contiguous (``[..., M/32, K]`` for ``dim=-2``: the transpose of the
        columnwise operand's ``[..., K, M/32]``); ``x_hat`` contiguous of x's shape, or None.
    """
    shape = x.shape
    if dim in (-1, x.dim() - 1):
        red, blocked = -1, (*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    elif dim in (-2, x.dim() - 2):
        red, blocked = -2, (*shape[:-2], shape[-2] // BLOCK_SIZE, BLOCK_SIZE, shape[-1])
    else:
        raise ValueError(f"mxfx.quantize_blocks: dim {dim} for shape {tuple(shape)} must be -1 or -2")
    blocks = x.to(torch.float32).reshape(blocked)
    amax = blocks.abs().amax(dim=red)
    nonfinite = ~torch.isfinite(amax)
    e = scale_exponent(amax, rule)
    scaled = blocks * torch.exp2(-e.to(torch.float32)).unsqueeze(red)  # exact: power-of-two multiply
    scaled.clamp_(-E4M3_MAX, E4M3_MAX)  # saturate; torch's cast would give NaN above 464
    scaled.masked_fill_(nonfinite.unsqueeze(red), float("nan"))
    qdata = scaled.to(torch.float8_e4m3fn)
    scales = torch.where(nonfinite, E8M0_NAN, e + E8M0_BIAS).to(torch.uint8)
    x_hat = None
    if dequantized is not None:  # the arithmetic of dequantize_lastdim, on the blocks at hand
        x_hat = qdata.to(torch.float32).mul_(scale_values(scales).unsqueeze(red)).reshape(shape).to(dequantized)
        x_hat = x_hat.contiguous()
    # contiguous whatever the input's strides (a strided input can reach here as a view, kept by the casts)
    return qdata.reshape(shape).contiguous(), scales.contiguous(), x_hat


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) to float32 powers of two; byte 255 gives NaN."""
    b = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    v = torch.exp2(b.to(torch.float32) - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(v, float("nan")), v)


def dequantize_lastdim(qdata: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference MXFP8 dequantize along the last dimension.

    ``x_hat = q * 2^(b - 127)`` computed in float32 (exact: E4M3 has 3 mantissa
    bits), then cast to ``dtype``. Shapes: qdata ``[..., K]``, scales ``[..., K // 32]``.

    The cast follows torch: a value past ``dtype``'s range becomes inf. With float16 that can
    happen to finite inputs near its top (65504 quantizes under rceil to 256 * 2^8 = 65536), so
    dequantize MX tensors of float16 data to bfloat16 or float32 where that matters.
    """
    *lead, k = qdata.shape
    blocks = qdata.to(torch.float32).reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    out = blocks * scale_values(scales).unsqueeze(-1)
    return out.reshape(*lead, k).to(dtype)


def check_input(x: torch.Tensor, op: str, fmt: str = "MXFP8", min_dim: int = 0) -> None:
    """The input check of every quantize, whatever the format: raise TypeError unless ``x`` is a tensor of one of
    :data:`INPUT_DTYPES`, ValueError unless it has at least ``min_dim`` dims. Messages start with ``op`` and name
    the format ``fmt`` (as its messages spell it: "MXFP8", "fp8_block")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{op}: input of shape {tuple(x.shape)} has dtype {x.dtype}; {fmt} quantizes "
            f"bfloat16, float16 or float32 (cast it first)"
        )
    if x.dim() < min_dim:
        raise ValueError(f"{op}: needs a tensor with at least {min_dim} dims, got shape {tuple(x.shape)}")


def check_output_dtype(dtype, t: torch.Tensor, op: str, name: str = "qdata") -> None:
    """Raise TypeError unless ``dtype`` is a dequantize output dtype: a floating type of 16 bits or
    more. The message names ``t`` (called ``name``) by its shape."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(
            f"{op}: output dtype {dtype} for {name} of shape {tuple(t.shape)} is not a floating type of 16 bits "
            f"or more; use torch.bfloat16, torch.float16, torch.float32 or torch.float64"
        )


def check_both_axes(x: torch.Tensor, rule: str, op: str, hint: str = "") -> torch.Tensor:
    """Checks of the ops that block ``x`` along both of its last two dims; returns x as ``[B, M, K]``.

    Raises:
        TypeError: not a tensor, or unsupported dtype; ValueError: unknown rule, or x not 2D/3D
        with M and K multiples of 32 (the message names ``op``, the shape and the failing dims, plus ``hint``
        where M fails).
    """
    check_input(x, op)
    check_rule(rule, op)
    if x.dim() not in (2, 3):
        raise ValueError(
            f"{op}: needs a 2D [M, K] or 3D [B, M, K] tensor, got shape {tuple(x.shape)}; reshape it "
            f"(e.g. merge leading dims into M)"
        )
    bad = [(name, n) for name, n in zip("MK", x.shape[-2:]) if n % BLOCK_SIZE]
    if bad:
        values = " and ".join(f"{name} = {n}" for name, n in bad)
        dims = " and ".join(name for name, _ in bad)
        verb, target = ("is", "a multiple") if len(bad) == 1 else ("are", "multiples")
        raise ValueError(
            f"{op}: needs a 2D [M, K] or 3D [B, M, K] tensor with M and K multiples of {BLOCK_SIZE}, "
            f"got shape {tuple(x.shape)} ({values} {verb} not); pad {dims} to {target} of {BLOCK_SIZE}"
            f"{hint if bad[0][0] == 'M' else ''}"
        )
    return x if x.dim() == 3 else x.unsqueeze(0)


def check_pair(qdata: torch.Tensor, scales: torch.Tensor, axis: int, op: str) -> int:
    """Validate an MX (qdata, scales) pair blocked along ``axis``; returns the normalised axis."""
    if qdata.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"{op}: qdata of shape {tuple(qdata.shape)} has dtype {qdata.dtype}, expected torch.float8_e4m3fn"
        )
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(
            f"{op}: scales of shape {tuple(scales.shape)} have dtype {scales.dtype}, "
            f"expected torch.float8_e8m0fnu (or uint8 E8M0 bytes)"
        )
    if qdata.device != scales.device:
        raise ValueError(f"{op}: qdata is on {qdata.device} but scales are on {scales.device}; move them to one device")
    try:
        axis = check_block_axis(qdata.shape, axis, op)
    except ValueError as e:
        if isinstance(axis, int) and not isinstance(axis, bool) and -qdata.dim() <= axis < qdata.dim():
            raise ValueError(
                f"{op}: qdata of shape {tuple(qdata.shape)} cannot be blocked along axis {axis} (length "
                f"{qdata.shape[axis]}, not a multiple of {BLOCK_SIZE}); dequantize along the axis the pair was "
                f"quantized along"
            ) from e
        raise
    expected = list(qdata.shape)
    expected[axis] //= BLOCK_SIZE
    if list(scales.shape) != expected:
        raise ValueError(
            f"{op}: scales of shape {tuple(scales.shape)} do not match qdata of shape {tuple(qdata.shape)} "
            f"blocked along axis {axis}; expected scales of shape {tuple(expected)}"
        )
    return axis


@torch.compiler.disable
def quantize(x: torch.Tensor, axis: int = -1, rule: ScaleRule = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 in blocks of 32 consecutive values along ``axis``.

    Follows OCP MX v1.0 §6.3 with the scale rule ``rule``; see the module
    docstring for zero, NaN, Inf and tiny blocks. Runs in plain torch on any
    device (GPU kernels are used by mxfx's graph ops, not here). Under
    ``torch.compile`` it runs eagerly (a graph break): Inductor cannot generate
    code for ``float8_e8m0fnu`` scales on CPU (torch 2.11/2.13).

    Args:
        x: bf16, fp16 or fp32 tensor, any shape and strides; ``x.shape[axis]``
            must be a multiple of 32.
        axis: the blocked axis (default: last; -2 is "columnwise").
        rule: ``"rceil"`` (default, smallest power-of-two scale with
            amax / scale <= 448) or ``"floor"`` (OCP baseline; values above
            448 x scale saturate).

    Returns:
        ``(qdata, scales)``: qdata ``torch.float8_e4m3fn`` of ``x``'s shape;
        scales ``torch.float8_e8m0fnu`` of ``x``'s shape with ``axis`` divided by 32.

    Raises:
        TypeError: ``x`` is not bf16/fp16/fp32.
        ValueError: ``x.shape[axis]`` is not a multiple of 32, or ``rule`` is unknown.
    """
    op = "mxfx.quantize"
    check_input(x, op)
    check_rule(rule, op)
    axis = check_block_axis(x.shape, axis, op)
    with torch.no_grad():  # not differentiable: the payload is a rounding
        q, s = quantize_lastdim(x.movedim(axis, -1), rule)
    return q.movedim(-1, axis), s.movedim(-1, axis).view(torch.float8_e8m0fnu)


@torch.compiler.disable
def dequantize(
    qdata: torch.Tensor, scales: torch.Tensor, axis: int = -1, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Dequantize an MXFP8 pair blocked along ``axis``: ``qdata * 2^(scale - 127)``.

    Runs eagerly under ``torch.compile``, as :func:`quantize` does.

    Args:
        qdata: ``torch.float8_e4m3fn`` tensor; ``qdata.shape[axis]`` a multiple of 32.
        scales: ``torch.float8_e8m0fnu`` (or uint8 E8M0 bytes), qdata's shape with
            ``axis`` divided by 32. Byte 255 (NaN) makes its whole block NaN.
        axis: the blocked axis, as given to :func:`quantize`.
        dtype: output dtype (default bf16; bf16, fp16, fp32 or fp64); the product is formed
            exactly in fp32. A value that exceeds the output dtype's range gives ±inf, as
            IEEE casts do. With rceil, inputs within one E4M3 step of their dtype's maximum
            round up past it: fp16 65000 becomes 65536 (dequantize it to fp32 or fp64), and
            bf16/fp32 values near 3.4e38 become 2^128, which no fp32 product holds, so they
            dequantize to ±inf in every dtype (quantize such data with floor: its largest
            product is 448 x 2^119, below fp32's maximum).

    Raises:
        TypeError / ValueError: wrong dtypes, or shapes that do not pair up.
    """
    axis = check_pair(qdata, scales, axis, "mxfx.dequantize")
    check_output_dtype(dtype, qdata, "mxfx.dequantize")
    out = dequantize_lastdim(qdata.movedim(axis, -1), scales.movedim(axis, -1), dtype)
    return out.movedim(-1, axis)
