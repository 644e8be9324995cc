"""Pieces shared by every MX Triton kernel: encode/decode of 32-value blocks, and the [B, R, C] input view.

The device functions here are the Triton transcription of ``mxfx.numerics.mx``
(OCP MX v1.0 §6.3 with the rceil/floor rules and the special-block rules written
there); ``tests/test_kernels.py`` holds them to that reference bit for bit.
Importing this module imports Triton: only ``mxfx.kernels.mx.device_path`` imports it,
lazily, once it knows a tensor is on CUDA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mxfx.numerics.mx import BLOCK_SIZE
from mxfx.kernels.common.e4m3_triton import E4M3_NAN_BYTE, HW_E4M3_CONVERSION
from mxfx.kernels.mx.views import as_brc, scale_shape  # noqa: F401  (the kernels' input views)

FP32_EXP_SHIFT = tl.constexpr(23)
FP32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
FP32_MANT_MASK = tl.constexpr(0x7FFFFF)
FP32_MANT_1_75 = tl.constexpr(0x600000)
"""Mantissa field of 1.75: above it, amax / 2^(floor(log2 amax) - 8) exceeds 448 and rceil steps up."""

E4M3X4_PTX = tl.constexpr(
    "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
    "mov.b32 $0, {lo, hi}; }"
)
"""Four fp32 values ($1..$4) to their E4M3 bytes in one 32-bit register ($0, $1's byte lowest): the conversion
``HW_E4M3_CONVERSION`` describes, two values per instruction, the pairs merged by one ``mov``, where Triton's own fp8
cast goes through 16-bit halves and byte permutes (``PRMT``) to pack the same bytes for a store."""

CONVERT_E4M3X4 = 1
"""Bit of a kernel's ``CONVERT`` constexpr (its conversion forms): quantize through :data:`E4M3X4_PTX`."""
CONVERT_BF16X2 = 2
"""Bit of ``CONVERT``: widen bf16 inputs a register pair at a time (:func:`to_f32`). Each kernel takes the bits
that measured fastest for it (its module's ``CONVERSION_FORMS``; ``docs/kernel-notes.md``, "Conversion forms")."""
CONVERT_ALL = CONVERT_E4M3X4 | CONVERT_BF16X2

_CONVERSION_ENV = os.environ.get("MXFX_KERNEL_CVT", "").strip()
if _CONVERSION_ENV not in ("", "0", "1", "2", "3"):
    raise ValueError(
        f"MXFX_KERNEL_CVT={_CONVERSION_ENV!r}: expected 0-3 (bits {CONVERT_E4M3X4}: E4M3 packing, "
        f"{CONVERT_BF16X2}: bf16 widening), or unset it to let each kernel use its own forms"
    )
CONVERSION_OVERRIDE = int(_CONVERSION_ENV) if _CONVERSION_ENV else None
"""``MXFX_KERNEL_CVT`` (0-3, ``CONVERT`` bits, read at import): use these bits in every kernel instead of each kernel's
own choice. For benchmarks that compare the forms, and tests; unset in normal use. Other values raise ValueError."""


def conversion_bits(chosen: int) -> int:
    """The ``CONVERT`` bits a launch passes: the kernel's measured choice, or :data:`CONVERSION_OVERRIDE` when set."""
    return chosen if CONVERSION_OVERRIDE is None else CONVERSION_OVERRIDE


E8M0_ZERO_SCALE_BITS = tl.constexpr(0x00400000)
"""fp32 bits of 2^-127 (E8M0 byte 0), an fp32 subnormal."""


@triton.jit
def to_f32(v, CONVERT: tl.constexpr = 0):
    """fp32 values of a loaded tile. With ``CONVERT & CONVERT_BF16X2``, compiled kernels widen bf16 pairs as they sit in
    one 32-bit register (``and`` keeps the high element, ``shl`` moves the low one up): two instructions per pair,
    where the generic ``cvt`` extracts each half first (``PRMT``, then a shift)."""
    if (CONVERT & 2) != 0 and HW_E4M3_CONVERSION and v.dtype == tl.bfloat16 and v.numel % 2 == 0:  # 2: CONVERT_BF16X2
        return tl.inline_asm_elementwise(
            "{ and.b32 $1, $2, 0xFFFF0000; shl.b32 $0, $2, 16; }",
            "=r,=r,r",
            [v],
            dtype=tl.float32,
            is_pure=True,
            pack=2,
        )
    return v.to(tl.float32)


@triton.jit
def abs_bits(v):
    """Sign-cleared fp32 bits of ``v`` as int32: integer order equals float order for
    non-negative floats, and NaN/Inf bits sort above every finite value."""
    return v.to(tl.int32, bitcast=True) & FP32_ABS_MASK


@triton.jit
def block_scale(amax, RCEIL: tl.constexpr):
    """From block amax bits (see :func:`abs_bits`) to ``(inv_scale fp32, sbyte uint8, nonfinite)``.

    e = floor(log2 amax) - 8 (+1 for rceil when the mantissa exceeds 1.75), clamped at
    -127; zero and fp32-subnormal amax clamp there too. inv_scale = 2^-e exactly.
    """
    biased = amax >> FP32_EXP_SHIFT
    e = biased - (127 + 8)
    if RCEIL:
        e += ((amax & FP32_MANT_MASK) > FP32_MANT_1_75).to(tl.int32)
    e = tl.where(biased == 0, -127, tl.maximum(e, -127))
    nonfinite = biased == 255
    inv_scale = ((127 - e) << FP32_EXP_SHIFT).to(tl.float32, bitcast=True)  # 127 - e in 7..254
    if HW_E4M3_CONVERSION:  # every value of a nonfinite block scales to NaN, which the conversion makes 0x7F
        inv_scale = tl.where(nonfinite, float("nan"), inv_scale)
    sbyte = tl.where(nonfinite, 255, e + 127).to(tl.uint8)
    return inv_scale, sbyte, nonfinite


@triton.jit
def to_e4m3_bits(v, inv_scale, nonfinite, CONVERT: tl.constexpr = 0):
    """E4M3 bytes of ``v * inv_scale`` (saturated at +-448, RNE); NaN bytes where ``nonfinite``.

    ``inv_scale`` as :func:`block_scale` returns it (NaN in nonfinite blocks where ``HW_E4M3_CONVERSION``).
    ``CONVERT & CONVERT_E4M3X4``: four values a conversion call (:data:`E4M3X4_PTX`), same bytes.
    """
    if (
        (CONVERT & 1) != 0 and HW_E4M3_CONVERSION and v.numel % 4 == 0
    ):  # 1: CONVERT_E4M3X4 (plain ints: launch arguments)
        return tl.inline_asm_elementwise(
            E4M3X4_PTX, "=r,f,f,f,f", [v * inv_scale], dtype=tl.uint8, is_pure=True, pack=4
        )
    if HW_E4M3_CONVERSION:
        return (v * inv_scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    scaled = tl.minimum(tl.maximum(v * inv_scale, -448.0), 448.0)
    qbits = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(nonfinite, E4M3_NAN_BYTE, qbits).to(tl.uint8)


@triton.jit
def encode_blocks(v, AXIS: tl.constexpr, RCEIL: tl.constexpr, CONVERT: tl.constexpr = 0):
    """Quantize fp32 ``v`` whose blocks of 32 run along ``AXIS`` (a reshaped 3D tile).

    Returns ``(qbits, sbyte)``: uint8 E4M3 bytes of ``v``'s shape and uint8 E8M0 bytes
    with ``AXIS`` reduced.
    """
    inv_scale, sbyte, nonfinite = block_scale(tl.max(abs_bits(v), axis=AXIS), RCEIL)
    qbits = to_e4m3_bits(v, tl.expand_dims(inv_scale, AXIS), tl.expand_dims(nonfinite, AXIS), CONVERT)
    return qbits, sbyte


@triton.jit
def decode_scale(sbyte):
    """E8M0 bytes (any int tile) to fp32 2^(b - 127); byte 0 is the subnormal 2^-127, 255 is NaN."""
    b = sbyte.to(tl.int32)
    bits = tl.where(b == 0, E8M0_ZERO_SCALE_BITS, b << FP32_EXP_SHIFT)
    return tl.where(b == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def blocked_offset(r, c, SCALE_COLS):
    """Byte offset of scale (r, c) in the blocked layout (see ``mxfx.numerics.layout``); SCALE_COLS = K / 32."""
    col_tiles = (SCALE_COLS + 3) // 4
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@triton.jit
def tile_origin(n_c_tiles, BR: tl.constexpr, BC: tl.constexpr):
    """(b, r0, c0) of this program: grid (row tiles x col tiles, B), column tiles fastest,
    so neighbouring programs stream neighbouring memory."""
    pid = tl.program_id(0)
    return tl.program_id(1), (pid // n_c_tiles) * BR, (pid % n_c_tiles) * BC


@triton.jit
def load_tile(
    ptr,
    b,
    r0,
    c0,
    R,
    C,
    sb,
    sr,
    sc,
    BR: tl.constexpr,
    BC: tl.constexpr,
    EVEN: tl.constexpr = False,
    WIDE: tl.constexpr = False,
    CONVERT: tl.constexpr = 0,
):
    """fp32 tile ``[BR, BC]`` at rows r0.., cols c0.. of batch b of a strided [B, R, C] tensor (0 outside).
    EVEN: the caller knows the tile lies inside (BR divides R, BC divides C), and no mask is computed.
    WIDE: each element's offset formed in int64 from its row and column, rather than an int64 tile base plus
    int32 offsets within the tile: the same values, scheduled differently by ptxas (see ``dual.ADDRESS_FORMS``)."""
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    if WIDE:
        offs = ptr + b.to(tl.int64) * sb + (r0 + ar[:, None]).to(tl.int64) * sr + (c0 + ac[None, :]).to(tl.int64) * sc
    else:
        base = ptr + b.to(tl.int64) * sb + r0.to(tl.int64) * sr + c0.to(tl.int64) * sc
        offs = base + ar[:, None] * sr + ac[None, :] * sc
    if EVEN:
        v = tl.load(offs)
    else:
        v = tl.load(offs, mask=((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :], other=0.0)
    return to_f32(v, CONVERT)


SCALES_ROW_MAJOR = tl.constexpr(0)
"""Scale layouts :func:`store_rowwise` writes (see :mod:`mxfx.kernels.mx.views`; launch with ``.value``, a plain
int, which Inductor can write into the code it generates for a traced launch): contiguous [B, R, C/32];"""
SCALES_MN_MAJOR = tl.constexpr(1)
"""storage [B, C/32, R] (the transpose view is the logical [B, R, C/32]);"""
SCALES_BLOCKED = tl.constexpr(2)
"""the blocked layout of ``mxfx.numerics.layout`` (B must be 1)."""


@triton.jit
def store_rowwise(
    q_ptr,
    s_ptr,
    qbits,
    sbyte,
    b,
    r0,
    c0,
    R,
    C,
    RPR,
    SCALES: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    """Store a tile's E4M3 bytes ``[BR, BC]`` into contiguous [B, R, C] and its scales ``[BR, BC/32]``
    in the layout ``SCALES`` (one of the ``SCALES_*`` constants).

    For the blocked layout, RPR rows of this view make one row of the scale matrix (a row split
    into 32-value rows by :func:`flat_blocks` has RPR = K / 32; else 1). EVEN: the tile lies inside (no masks).
    """
    NB: tl.constexpr = BC // 32
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    an = tl.arange(0, NB)
    row0 = b.to(tl.int64) * R + r0
    rmask = (r0 + ar) < R
    q_base = q_ptr + row0 * C + c0
    q_offs = q_base + ar[:, None] * C + ac[None, :]
    if EVEN:
        tl.store(q_offs, tl.reshape(qbits, [BR, BC]))
    else:
        tl.store(q_offs, tl.reshape(qbits, [BR, BC]), mask=rmask[:, None] & ((c0 + ac) < C)[None, :])
    smask = rmask[:, None] & ((c0 // 32 + an) < C // 32)[None, :]
    if SCALES == SCALES_BLOCKED:
        rr = r0 + ar
        col = (rr % RPR)[:, None] * (C // 32) + (c0 // 32 + an)[None, :]
        s_offs = s_ptr + blocked_offset((rr // RPR)[:, None], col, RPR * (C // 32))
    elif SCALES == SCALES_MN_MAJOR:
        s_base = s_ptr + (b.to(tl.int64) * (C // 32) + c0 // 32) * R + r0
        s_offs = s_base + an[None, :] * R + ar[:, None]
    else:
        s_base = s_ptr + row0 * (C // 32) + c0 // 32
        s_offs = s_base + ar[:, None] * (C // 32) + an[None, :]
    if EVEN:
        tl.store(s_offs, sbyte)
    else:
        tl.store(s_offs, sbyte, mask=smask)


@triton.jit
def store_dequantized(
    h_ptr, qbits, sbyte, b, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr = False
):
    """Store the values of a tile's blocks, ``dequant(qbits [BR, BC/32, 32], sbyte [BR, BC/32])``, into
    contiguous [B, R, C] in ``h_ptr``'s dtype (laid out as :func:`store_rowwise` lays out the qdata).
    EVEN: the tile lies inside (no mask)."""
    h = qbits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(sbyte)[:, :, None]
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    base = h_ptr + (b.to(tl.int64) * R + r0) * C + c0
    offs = base + ar[:, None] * C + ac[None, :]
    h = tl.reshape(h, [BR, BC]).to(h_ptr.dtype.element_ty)
    if EVEN:
        tl.store(offs, h)
    else:
        tl.store(offs, h, mask=((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :])


@triton.jit
def load_blocks(ptr, j0, NBLK, RPR, sr, BR: tl.constexpr, EVEN: tl.constexpr = False, CONVERT: tl.constexpr = 0):
    """fp32 tile ``[BR, 32]``: 32-value blocks j0.. of a [R, C] tensor with unit column stride and row
    stride ``sr`` (elements), numbered row-major: block j holds row j // RPR, columns 32 (j % RPR)..
    (RPR = C / 32); 0 for j >= NBLK. RPR = 1 with sr = 32 reads a contiguous tensor as one stream.
    EVEN: BR divides NBLK (no mask)."""
    j = j0 + tl.arange(0, BR)
    row = j // RPR
    start = row.to(tl.int64) * sr + (j - row * RPR) * 32
    if EVEN:
        v = tl.load(ptr + start[:, None] + tl.arange(0, 32)[None, :])
    else:
        v = tl.load(ptr + start[:, None] + tl.arange(0, 32)[None, :], mask=(j < NBLK)[:, None], other=0.0)
    return to_f32(v, CONVERT)


def block_stream(x: torch.Tensor, one_stream: bool = True):
    """``(x3, NBLK, RPR, row stride)`` to read ``x [..., C]`` as a stream of 32-value blocks with
    :func:`load_blocks` (``x3``: the [1, R, C] view of ``x`` to pass as the pointer), or None when
    x's rows do not merge into one [R, C] view with unit column stride. A contiguous ``x`` gives
    ``(x3, numel / 32, 1, 32)`` (RPR = 1 specializes the division away) unless ``one_stream`` is
    False, which always gives RPR = C / 32 (what a kernel reading it next to a row-strided tensor needs)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        x3 = x.view(1, -1, x.shape[-1])
    except RuntimeError:  # the leading dims do not merge
        return None
    _, R, C = x3.shape
    if one_stream and (x3.stride(1) == C or R == 1):
        return x3, R * C // BLOCK_SIZE, 1, BLOCK_SIZE
    return x3, R * C // BLOCK_SIZE, C // BLOCK_SIZE, x3.stride(1)


def flat_blocks(x3: torch.Tensor):
    """``[1, R, C]`` with contiguous rows -> ``([1, R*C/32, 32] view, RPR = C/32)``, else ``(x3, 1)``.

    A contiguous tensor is one stream of 32-value blocks: tiles of whole blocks read
    and write one contiguous chunk each, whatever K is.
    """
    B, R, C = x3.shape
    if B == 1 and x3.stride(2) == 1 and (x3.stride(1) == C or R == 1):
        return x3.reshape(1, -1, BLOCK_SIZE), C // BLOCK_SIZE
    return x3, 1
