"""Triton fused SwiGLU + MXFP8 quantize: quantizes ``silu(gate) * up`` formed in fp32.

``silu`` is mxfx's fp32 SiLU (``mxfx.kernels.common.silu``): libdevice ``expf`` and a division, the same
arithmetic as PyTorch's CUDA ``F.silu`` on fp32 except -0 for gates at or below -87.3365 (where F.silu's
values are below 2^-119), then an fp32 multiply by ``up``; no 16-bit intermediate is written. gate and
up may be separate tensors or strided halves of one fused ``gate_up`` tensor (``gate_up[..., :H]``,
``gate_up[..., H:]``). Both of those are read as streams of 32-value blocks (``blocks.load_blocks``),
so every output is written as one contiguous stream whatever H is; other strides go through 2D tiles.
The fused forward equals ``quantize(silu_fp32(gate) * up)`` bit for bit.
The same pass can also write the MX pairs of gate and of up themselves (``save_inputs``):
what the SwiGLU backward keeps, so that no second and third read of gate and up follows.
Quantization follows ``mxfx.numerics.mx`` (OCP MX v1.0 §6.3) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.numerics.mx import BLOCK_SIZE, check_block_axis, check_input, check_rule
from mxfx.kernels.common.launch import launch
from mxfx.kernels.common.silu_triton import silu_f32
from mxfx.kernels.mx.blocks import (
    CONVERT_ALL,
    SCALES_ROW_MAJOR,
    as_brc,
    block_stream,
    conversion_bits,
    encode_blocks,
    load_blocks,
    load_tile,
    scale_shape,
    store_dequantized,
    store_rowwise,
    tile_origin,
)

FLAT_CONFIG = (32, 32, 1)
"""(BLOCK_R, BLOCK_C, num_warps) when gate and up read as streams of 32-value blocks (contiguous, or
row-strided halves of a fused gate_up tensor) and only the MX pair is written: BLOCK_R blocks per program.
One-warp programs of 32 values per thread (measured: docs/kernel-notes.md, "Kernel choices")."""
FLAT_WIDE_CONFIG = (16, 32, 1)
"""The same when the pass also writes values or saved pairs (more bytes and registers per value): 16
values per thread ran fastest (``MXFX_BENCH_SWEEP="swiglu saved halves"``)."""
STREAM_EVEN = True
"""Drop the masks when gate and up are contiguous block streams whose block count the tile divides (a
boolean key: token counts that change between calls give at most two compiled variants). Gate_up halves keep
their masks, except at H = 32 (measured: docs/kernel-notes.md, "Kernel choices")."""
CONVERSION_FORMS = {"quantize": CONVERT_ALL, "wide": 0}
"""Conversion forms (``blocks.CONVERT_*`` bits): both for the pass that writes the MX pair alone, none where it also
writes values or saved pairs (measured: docs/kernel-notes.md, "Kernel choices")."""
SWIGLU_CONFIG = (16, 256, 8)
"""(BLOCK_R, BLOCK_C, num_warps) for other strides (every other column, say)."""


@triton.jit
def _store_mx(
    q_ptr,
    s_ptr,
    v,
    b,
    r0,
    c0,
    R,
    C,
    RCEIL: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    EVEN: tl.constexpr,
    CONVERT: tl.constexpr,
):
    """Quantize the fp32 tile ``v [BR, BC]`` rowwise and store its pair into contiguous [B, R, C] / [B, R, C/32]."""
    qbits, sbyte = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, RCEIL, CONVERT)
    store_rowwise(q_ptr, s_ptr, qbits, sbyte, b, r0, c0, R, C, 1, SCALES_ROW_MAJOR, BR, BC, EVEN)
    return qbits, sbyte


@triton.jit(do_not_specialize=["R"])
def _swiglu_quantize_kernel(
    g_ptr,
    u_ptr,
    q_ptr,
    s_ptr,
    h_ptr,
    gq_ptr,
    gs_ptr,
    uq_ptr,
    us_ptr,
    R,
    C,
    sgb,
    sgr,
    sgc,
    sub,
    sur,
    suc,
    n_c_tiles,
    RPR: tl.constexpr,
    RCEIL: tl.constexpr,
    WRITE_XHAT: tl.constexpr,
    SAVE_INPUTS: tl.constexpr,
    STREAM: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    EVEN: tl.constexpr,
    CONVERT: tl.constexpr,
):
    b, r0, c0 = tile_origin(n_c_tiles, BR, BC)
    if STREAM:  # R blocks of C = 32 values; the outputs are contiguous, so they are stored as [R, 32] too
        g = load_blocks(g_ptr, r0, R, RPR, sgr, BR, EVEN, CONVERT)
        u = load_blocks(u_ptr, r0, R, RPR, sur, BR, EVEN, CONVERT)
    else:
        g = load_tile(g_ptr, b, r0, c0, R, C, sgb, sgr, sgc, BR, BC, CONVERT=CONVERT)
        u = load_tile(u_ptr, b, r0, c0, R, C, sub, sur, suc, BR, BC, CONVERT=CONVERT)
    v = silu_f32(g) * u
    qbits, sbyte = _store_mx(q_ptr, s_ptr, v, b, r0, c0, R, C, RCEIL, BR, BC, EVEN, CONVERT)
    if WRITE_XHAT:
        store_dequantized(h_ptr, qbits, sbyte, b, r0, c0, R, C, BR, BC, EVEN)
    if SAVE_INPUTS:
        _store_mx(gq_ptr, gs_ptr, g, b, r0, c0, R, C, RCEIL, BR, BC, EVEN, CONVERT)
        _store_mx(uq_ptr, us_ptr, u, b, r0, c0, R, C, RCEIL, BR, BC, EVEN, CONVERT)


def swiglu_quantize(
    gate: torch.Tensor, up: torch.Tensor, rule: str, dequantized: torch.dtype | None = None, save_inputs: bool = False
):
    """``gate, up [..., H]`` (CUDA, same shape, any strides) -> ``(q e4m3 [..., H], s uint8 [..., H/32])``;
    with ``dequantized``, ``(q, s, h_hat)``, h_hat = dequantize(q, s) in that dtype, from the same pass;
    with ``save_inputs``, followed by ``(gate_q, gate_s, up_q, up_s)``, the contiguous rowwise MX pairs of
    gate and up, also from the same pass. gate and up may differ in dtype (each is read as it is).
    ``dequantized`` and the devices are checked by :func:`mxfx.kernels.mx.device_path.swiglu_quantize`, the entry
    point; this function raises ValueError / TypeError for shapes, H and input dtypes."""
    op = "mxfx.swiglu_quantize"
    for t in (gate, up):
        check_input(t, op)
        check_block_axis(t.shape, -1, op)
    check_rule(rule, op)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must match")
    gs, us = (block_stream(gate), block_stream(up)) if gate.numel() > 0 else (None, None)
    if gs is not None and us is not None and gs[2] != us[2]:  # one contiguous, one row-strided
        gs, us = block_stream(gate, one_stream=False), block_stream(up, one_stream=False)
    stream = gs is not None and us is not None
    if stream:  # both read as streams of blocks, each with its own row stride
        (g3, R, rpr, sgr), (u3, _, _, sur) = gs, us
        B, C, strides = 1, BLOCK_SIZE, (0, sgr, 1, 0, sur, 1)
    elif gate.numel() == 0:  # nothing to read (as_brc cannot view rows 0 wide): empty outputs
        g3, u3, (B, R, C), rpr, strides = gate, up, (1, 0, BLOCK_SIZE), 1, (0,) * 6
    else:
        g3, u3 = as_brc(gate), as_brc(up)
        if g3.shape != u3.shape:  # views merged differently: fall back to matching copies
            g3, u3 = as_brc(gate.contiguous()), as_brc(up.contiguous())
        (B, R, C), rpr, strides = g3.shape, 1, (*g3.stride(), *u3.stride())
    q = torch.empty(gate.shape, dtype=torch.uint8, device=gate.device)
    s = torch.empty(scale_shape(gate.shape), dtype=torch.uint8, device=gate.device)
    h = torch.empty(gate.shape, dtype=dequantized, device=gate.device) if dequantized is not None else None
    saved = [torch.empty_like(t) for t in (q, s, q, s)] if save_inputs else [g3] * 4  # placeholders: not written
    br, bc, warps = (FLAT_WIDE_CONFIG if save_inputs or h is not None else FLAT_CONFIG) if stream else SWIGLU_CONFIG
    n_c = triton.cdiv(C, bc)
    if R * C > 0:
        # RPR (blocks per row of a stream: H / 32, fixed for a model; 1 for a contiguous pair) is a constexpr, so
        # the block -> row division compiles to a shift or a multiply. Token counts (R) stay unspecialized.
        launch(
            _swiglu_quantize_kernel,
            (triton.cdiv(R, br) * n_c, B),
            g3,
            u3,
            q,
            s,
            h if h is not None else g3,
            *saved,
            R,
            C,
            *strides,
            n_c,
            RPR=rpr,
            RCEIL=rule == "rceil",
            WRITE_XHAT=h is not None,
            SAVE_INPUTS=save_inputs,
            STREAM=stream,
            BR=br,
            BC=bc,
            EVEN=STREAM_EVEN and stream and rpr == 1 and R % br == 0,
            CONVERT=conversion_bits(CONVERSION_FORMS["wide" if save_inputs or h is not None else "quantize"]),
            num_warps=warps,
        )
    out = (q.view(torch.float8_e4m3fn), s) if h is None else (q.view(torch.float8_e4m3fn), s, h)
    if save_inputs:
        out += (saved[0].view(torch.float8_e4m3fn), saved[1], saved[2].view(torch.float8_e4m3fn), saved[3])
    return out
