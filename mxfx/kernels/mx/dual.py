"""Triton MXFP8 quantize of ``x [M, K]`` in both orientations from one read
(``quantize_dual``, ``quantize_dual_source``).

Rowwise blocks run along K (``q_row [M, K]``, ``s_row [M, K/32]``); columnwise blocks run
down M, the logical ``[K, M]`` operand ``quantize_lastdim(x.t())`` gives, which dgrad and
wgrad of OCP MX v1.0 GEMMs need. The columnwise pair is stored either

* transposed (:func:`quantize_dual`): contiguous ``q_col [K, M]``, what native MX GEMMs read.
  The program reads its tile a second time as the ``[BK, BM]`` tile of ``x^T`` (an L1 hit, no
  DRAM traffic) and encodes that one along its rows, as the columnwise quantize of ``x.t()`` does:
  the compiler then transposes the 16-bit input through shared memory 16 bytes at a time
  (``LDSM``) rather than transposing the E4M3 result byte by byte; or
* in the *source layout* (:func:`quantize_dual_source`): ``q_col`` is the ``.transpose(-2, -1)``
  view of a contiguous ``[M, K]`` byte tensor. Same values, no transpose: every load and store
  runs along K.

Both scale tensors are MN-major (:mod:`mxfx.kernels.mx.views`): ``s_row [M, K/32]`` is the transpose
view of a contiguous ``[K/32, M]`` tensor and ``s_col [K, M/32]`` that of a contiguous ``[M/32, K]``
one, so a program's ``[32, BLOCK_K]`` tile writes its scales as whole 32-byte sectors. Emulated GEMMs (Hopper, which
  has no MX GEMM) read either layout at the same cost, so the weight caches there keep the
  dgrad form in this one (``mxfx.formats.mxfp8.source_layout``). Optionally the same pass
  writes the dequantized values of each orientation, so one read of the FP32 main weight gives
  everything a Hopper weight-cache refresh builds.

One program quantizes a ``[32, BLOCK_K]`` tile (a column block's 32 rows) with one or two warps, so the column
amax reduction stays in registers and shuffles (docs/kernel-notes.md, "Kernel choices").

Bit-identical to ``mxfx.numerics.mx.quantize_lastdim`` of ``x`` and of ``x.transpose(-2, -1)``
(OCP MX v1.0 §6.3, mxfx rules); the dequantized forms equal ``dequantize_lastdim``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.common.launch import launch
from mxfx.kernels.mx.checks import TOKEN_DIM_HINT, check_dual_args
from mxfx.kernels.mx.blocks import (
    CONVERT_ALL,
    CONVERT_BF16X2,
    blocked_offset,
    conversion_bits,
    decode_scale,
    encode_blocks,
    load_tile,
    tile_origin,
)
from mxfx.numerics.layout import new_blocked_scales

SOURCE_CONFIG = {"source": (32, 64, 1), "source fp32": (32, 64, 1), "dequantized": (32, 128, 2)}
"""(BLOCK_M, BLOCK_K, num_warps) of the source-layout passes, keyed as ``CONVERSION_FORMS``: a 16-bit input, a
32-bit one, and a 16-bit input whose dequantized forms are written too
(measured: docs/kernel-notes.md, "Kernel choices")."""
TRANSPOSED_CONFIG = (32, 64, 1)
"""(BLOCK_M, BLOCK_K, num_warps), columnwise pair stored transposed."""
TRANSPOSED_MAXNREG = 96
"""Registers per thread for the transposed pass of compiled kernels (None: uncapped;
measured: docs/kernel-notes.md, "Kernel choices")."""
ADDRESS_FORMS = {
    "source": (True, True),
    "source fp32": (False, False),
    "transposed": (True, False),
    "blocked": (False, True),
}
"""(CONTIG, WIDE) of ``_dual_kernel`` by output layout (the source layout split by input element size).
CONTIG: an x whose rows are contiguous is read with the row stride K that the stores use, not a runtime stride;
WIDE: tiles that divide x form every element's address in int64 from its row, not as an int64 tile base plus int32
offsets. Same values either way; the choice per layout is measured (docs/kernel-notes.md, "Kernel choices")."""

CONVERSION_FORMS = {
    "source": CONVERT_ALL,
    "source fp32": CONVERT_ALL,
    "transposed": CONVERT_ALL,
    "blocked": CONVERT_BF16X2,
    "dequantized": 0,
}
"""Conversion forms (``blocks.CONVERT_*`` bits) by output layout as in ``ADDRESS_FORMS``, plus those of a 16-bit
input whose dequantized forms are written too (measured: docs/kernel-notes.md, "Kernel choices")."""


@triton.jit
def _store_tile(
    ptr,
    vals,
    b,
    r0,
    c0,
    R,
    C,
    TRANSPOSE: tl.constexpr,
    EVEN: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    WIDE: tl.constexpr = False,
):
    """Store ``vals [BR, BC]`` at rows r0.., cols c0.. of batch b of a contiguous [B, R, C] tensor;
    TRANSPOSE: at [b, c0 + c, r0 + r] of a contiguous [B, C, R] tensor instead. EVEN: the tile lies inside
    (no mask); with WIDE too, each element's offset is formed in int64 (``ADDRESS_FORMS``)."""
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    if EVEN and WIDE:  # int64 offsets per element (see ADDRESS_FORMS)
        if TRANSPOSE:
            offs = ptr + ((b * C + c0 + ac[None, :]).to(tl.int64) * R + r0 + ar[:, None])
        else:
            offs = ptr + ((b * R + r0 + ar[:, None]).to(tl.int64) * C + c0 + ac[None, :])
    elif TRANSPOSE:
        offs = ptr + (b.to(tl.int64) * C + c0) * R + r0 + ac[None, :] * R + ar[:, None]
    else:
        offs = ptr + (b.to(tl.int64) * R + r0) * C + c0 + ar[:, None] * C + ac[None, :]
    if EVEN:
        tl.store(offs, vals.to(ptr.dtype.element_ty))
    else:
        tl.store(offs, vals.to(ptr.dtype.element_ty), mask=((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :])


@triton.jit
def _store_blocked(ptr, vals, b, r0, c0, R, C, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Store ``vals [BR, BC]``, entries (r0.., c0..) of an [R, C] scale matrix, into batch b's blocked layout
    (``mxfx.numerics.layout``). EVEN: no mask."""
    rr = (r0 + tl.arange(0, BR))[:, None]
    cc = (c0 + tl.arange(0, BC))[None, :]
    numel = ((R + 127) // 128 * 128) * ((C + 3) // 4 * 4)
    offs = blocked_offset(rr, cc, C)
    if EVEN:
        tl.store(ptr + b.to(tl.int64) * numel + offs, vals)
    else:
        tl.store(ptr + b.to(tl.int64) * numel + offs, vals, mask=(rr < R) & (cc < C))


@triton.jit
def _encode_rows(
    v,
    q_ptr,
    s_ptr,
    h_ptr,
    b,
    r0,
    c0,
    R,
    C,
    RCEIL: tl.constexpr,
    MX: tl.constexpr,
    HAT: tl.constexpr,
    BLOCKED: tl.constexpr,
    EVEN: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    WIDE: tl.constexpr,
    CONVERT: tl.constexpr,
):
    """Quantize the fp32 tile ``v [BR, BC]`` at rows r0.., cols c0.. of batch b of an [R, C] matrix in blocks of 32
    along C, and store its qdata into contiguous [B, R, C], its scales MN-major (storage [B, C/32, R]) or in the
    blocked layout of the [R, C/32] scale matrix (BLOCKED), and with HAT its dequantized values like the qdata."""
    q, s = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, RCEIL, CONVERT)
    if MX:
        _store_tile(q_ptr, tl.reshape(q, [BR, BC]), b, r0, c0, R, C, False, EVEN, BR, BC, WIDE)
        if BLOCKED:
            _store_blocked(s_ptr, s, b, r0, c0 // 32, R, C // 32, EVEN, BR, BC // 32)
        else:
            _store_tile(s_ptr, s, b, r0, c0 // 32, R, C // 32, True, EVEN, BR, BC // 32, WIDE)
    if HAT:
        h = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(s)[:, :, None]
        _store_tile(h_ptr, tl.reshape(h, [BR, BC]), b, r0, c0, R, C, False, EVEN, BR, BC, WIDE)


@triton.jit
def _dual_kernel(
    x_ptr,
    qr_ptr,
    sr_ptr,
    hr_ptr,
    qc_ptr,
    sc_ptr,
    hc_ptr,
    M,
    K,
    sxb,
    sxm,
    sxk,
    n_k_tiles,
    RCEIL: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    MX: tl.constexpr,
    HAT: tl.constexpr,
    COL_T: tl.constexpr,
    BLOCKED: tl.constexpr,
    EVEN: tl.constexpr,
    BATCHED: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    CONTIG: tl.constexpr,
    WIDE: tl.constexpr,
    CONVERT: tl.constexpr,
):
    b, m0, k0 = tile_origin(n_k_tiles, BM, BK)
    if not BATCHED:  # one matrix: b is 0, and its address terms fold away
        b = b * 0
    if CONTIG:  # rows of K contiguous values: the stores' row stride
        sxm = K
        sxk = 1
    v = load_tile(x_ptr, b, m0, k0, M, K, sxb, sxm, sxk, BM, BK, EVEN, EVEN and WIDE, CONVERT)
    if ROW:  # blocks of 32 along K: q_row [B, M, K], s_row [B, M, K/32]
        _encode_rows(v, qr_ptr, sr_ptr, hr_ptr, b, m0, k0, M, K, RCEIL, MX, HAT, BLOCKED, EVEN, BM, BK, WIDE, CONVERT)
    if COL and COL_T:  # blocks of 32 along M, stored [B, K, M]: the [BK, BM] tile of x^T read again (an L1 hit)
        vt = load_tile(x_ptr, b, k0, m0, K, M, sxb, sxk, sxm, BK, BM, EVEN, EVEN and WIDE, CONVERT)
        _encode_rows(vt, qc_ptr, sc_ptr, hc_ptr, b, k0, m0, K, M, RCEIL, MX, HAT, BLOCKED, EVEN, BK, BM, WIDE, CONVERT)
    elif COL:  # blocks of 32 along M, in the source layout: qdata storage [B, M, K], scales [B, M/32, K] (MN-major)
        q, s = encode_blocks(tl.reshape(v, [BM // 32, 32, BK]), 1, RCEIL, CONVERT)
        if MX:
            _store_tile(qc_ptr, tl.reshape(q, [BM, BK]), b, m0, k0, M, K, False, EVEN, BM, BK, WIDE)
            _store_tile(sc_ptr, s, b, m0 // 32, k0, M // 32, K, False, EVEN, BM // 32, BK, WIDE)
        if HAT:
            h = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * decode_scale(s)[:, None, :]
            _store_tile(hc_ptr, tl.reshape(h, [BM, BK]), b, m0, k0, M, K, False, EVEN, BM, BK, WIDE)


def _quantize_both(x, rule, op, *, row, col, dequantized, transposed, mx=True, blocked=False, hint=""):
    x3 = check_dual_args(x, rule, op, row=row, col=col, dequantized=dequantized, mx=mx, hint=hint)
    assert transposed or not blocked, "blocked scales are written by the transposed pass only"
    B, M, K = x3.shape
    dev = x.device

    lead = (B,) if x.dim() == 3 else ()  # a 2D x gets 2D outputs: no index or reshape of a written buffer

    def new(shape, dtype, want):
        return torch.empty((*lead, *shape), dtype=dtype, device=dev) if want else None

    col_shape = (K, M) if transposed else (M, K)
    # both scale tensors MN-major (see mxfx.kernels.mx.views): storage [.., K/32, M] and [.., M/32, K]
    q_row, s_row = new((M, K), torch.uint8, row and mx), new((K // 32, M), torch.uint8, row and mx)
    q_col = new(col_shape, torch.uint8, col and mx)
    s_col = new((M // 32, K), torch.uint8, col and mx)
    if blocked:  # the kernel writes only the scales (padding, where the layout has it, zeroed)
        s_row, s_col = new_blocked_scales(M, K // 32, lead, dev), new_blocked_scales(K, M // 32, lead, dev)
    h_row = new((M, K), dequantized, row and dequantized is not None)
    h_col = new(col_shape, dequantized, col and dequantized is not None)
    layout = (
        "blocked" if blocked else "transposed" if transposed else "source fp32" if x.element_size() == 4 else "source"
    )
    # the pass as CONVERSION_FORMS and SOURCE_CONFIG name it: a 16-bit input writing its dequantized forms has its own
    kind = "dequantized" if dequantized is not None and x.element_size() == 2 else layout
    bm, bk, warps = TRANSPOSED_CONFIG if transposed else SOURCE_CONFIG[kind]
    n_k = triton.cdiv(K, bk)
    contig, wide = ADDRESS_FORMS[layout]
    if B * M * K > 0:
        # outputs not written get the (read-only) input as a placeholder pointer
        args = [t if t is not None else x3 for t in (q_row, s_row, h_row, q_col, s_col, h_col)]
        launch(
            _dual_kernel,
            (triton.cdiv(M, bm) * n_k, B),
            x3,
            *args,
            M,
            K,
            *x3.stride(),
            n_k,
            RCEIL=rule == "rceil",
            ROW=row,
            COL=col,
            MX=mx,
            HAT=dequantized is not None,
            COL_T=transposed,
            BLOCKED=blocked,
            EVEN=M % bm == 0 and K % bk == 0,
            BATCHED=B > 1,
            BM=bm,
            BK=bk,
            CONTIG=contig and x3.stride(1) == K and x3.stride(2) == 1,
            WIDE=wide,
            CONVERT=conversion_bits(CONVERSION_FORMS[kind]),
            num_warps=warps,
            maxnreg=TRANSPOSED_MAXNREG if transposed and not blocked else None,
        )

    def out(t, view_t, fp8=False):
        # Only dtype views and transposes of what the kernel wrote: torch 2.11's Inductor can lose track of a
        # written buffer that is reshaped under dynamic shapes (pytorch/pytorch#189271).
        if t is None:
            return None
        t = t.view(torch.float8_e4m3fn) if fp8 else t
        return t.transpose(-2, -1) if view_t else t

    col_view_t = not transposed
    scales_t = not blocked
    return (
        out(q_row, False, True),
        out(s_row, scales_t),
        out(h_row, False),
        out(q_col, col_view_t, True),
        out(s_col, scales_t),
        out(h_col, col_view_t),
    )


def quantize_dual(x: torch.Tensor, rule: str):
    """Both orientations of ``x [M, K]`` (or ``[B, M, K]``; CUDA, bf16/fp16/fp32, any strides).

    Returns ``(q_row [.., M, K], s_row [.., M, K/32], q_col [.., K, M], s_col [.., K, M/32])``
    (e4m3 / uint8 E8M0): qdata contiguous, scales MN-major (transpose views of contiguous
    ``[.., K/32, M]`` / ``[.., M/32, K]`` tensors).

    Raises:
        ValueError: not 2D/3D, or M or K not a multiple of 32.
        TypeError: unsupported dtype (see ``mxfx.numerics.mx.check_input``).
    """
    q_row, s_row, _, q_col, s_col, _ = _quantize_both(
        x, rule, "mxfx.quantize_dual", row=True, col=True, dequantized=None, transposed=True, hint=TOKEN_DIM_HINT
    )
    return q_row, s_row, q_col, s_col


def quantize_dual_blocked(x: torch.Tensor, rule: str):
    """:func:`quantize_dual` with both scale matrices written straight into the blocked layout that
    Blackwell MX GEMMs read (``mxfx.numerics.layout``: 128x4 tiles, padding zero), from the same single read.

    Returns ``(q_row [.., M, K], s_row_blocked [.., blocked_numel(M, K/32)], q_col [.., K, M],
    s_col_blocked [.., blocked_numel(K, M/32)])``: qdata as :func:`quantize_dual` writes it, scales
    ``to_blocked`` of its ``s_row`` and ``s_col`` (per batch for a 3D x), without the ``to_blocked``
    pass. Raises as :func:`quantize_dual`.
    """
    q_row, s_row, _, q_col, s_col, _ = _quantize_both(
        x,
        rule,
        "mxfx.quantize_dual_blocked",
        row=True,
        col=True,
        dequantized=None,
        transposed=True,
        blocked=True,
        hint=TOKEN_DIM_HINT,
    )
    return q_row, s_row, q_col, s_col


def quantize_dual_source(
    x: torch.Tensor,
    rule: str,
    *,
    row: bool = True,
    col: bool = True,
    dequantized: torch.dtype | None = None,
    mx: bool = True,
):
    """Rowwise and columnwise MX of ``x [M, K]`` or ``[B, M, K]`` (CUDA, bf16/fp16/fp32, any strides), in x's layout.

    Args:
        x: the source; M and K multiples of 32.
        rule: "rceil" or "floor".
        row, col: which orientations to write (at least one).
        dequantized: also write the dequantized values of each written orientation in this dtype.
        mx: write the MX pairs; False (needs ``dequantized``) writes only the dequantized values,
            what a Hopper weight cache under ``keep_dequantized_weights`` keeps.

    Returns:
        ``(q_row [.., M, K], s_row [.., M, K/32], h_row, q_col [.., K, M], s_col [.., K, M/32], h_col)``:
        e4m3 qdata, uint8 E8M0 scales (None with ``mx=False``), ``h_*`` the dequantized tensors (None
        without ``dequantized``);
        ``q_row`` and ``h_row`` contiguous, ``s_row`` the transpose view of a contiguous
        ``[.., K/32, M]`` tensor, the column outputs transpose views of contiguous ``[.., M, K]`` /
        ``[.., M/32, K]`` tensors; orientations not written are all None.

    Raises:
        ValueError: not 2D/3D, M or K not a multiple of 32, neither orientation asked for, or
            ``mx=False`` without ``dequantized``.
        TypeError: unsupported input or ``dequantized`` dtype
            (see :func:`mxfx.kernels.mx.device_path.check_dual_args`).
    """
    return _quantize_both(
        x, rule, "mxfx.quantize_dual_source", row=row, col=col, dequantized=dequantized, transposed=False, mx=mx
    )
