"""Triton fused SwiGLU + MXFP8 quantize: quantizes ``silu(gate) * up`` formed in fp32.

``silu(g) = g / (1 + exp(-g))`` with IEEE division and libdevice ``expf``, the same
arithmetic as PyTorch's CUDA ``F.silu`` on fp32, then an fp32 multiply by ``up``; no
16-bit intermediate is written. gate and up may be separate tensors or strided
halves of one fused ``gate_up`` tensor (``gate_up[..., :H]``, ``gate_up[..., H:]``).
The same pass can also write the MX pairs of gate and of up themselves (``save_inputs``):
what the SwiGLU backward keeps, so that no second and third read of gate and up follows.
Quantization follows ``mxfx.format`` (OCP MX v1.0 §6.3) bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mxfx.format import check_block_axis, check_input, check_rule
from mxfx.kernels.launch import launch
from mxfx.kernels.mx_block import (
    as_brc,
    encode_blocks,
    flat_blocks,
    load_tile,
    scale_shape,
    store_dequantized,
    store_rowwise,
    tile_origin,
)

FLAT_CONFIG = (32, 32, 2)
"""(BLOCK_R, BLOCK_C, num_warps) when gate and up are contiguous: BLOCK_R 32-value blocks per program."""
SWIGLU_CONFIG = (16, 256, 8)
"""(BLOCK_R, BLOCK_C, num_warps) for strided gate/up (halves of a fused gate_up tensor)."""


@triton.jit
def _store_mx(q_ptr, s_ptr, v, b, r0, c0, R, C, RCEIL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Quantize the fp32 tile ``v [BR, BC]`` rowwise and store its pair into contiguous [B, R, C] / [B, R, C/32]."""
    qbits, sbyte = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, RCEIL)
    store_rowwise(q_ptr, s_ptr, qbits, sbyte, b, r0, c0, R, C, 1, False, BR, BC)
    return qbits, sbyte


@triton.jit(do_not_specialize=["R"])
def _swiglu_quantize_kernel(
    g_ptr, u_ptr, q_ptr, s_ptr, h_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, R, C, sgb, sgr, sgc, sub, sur, suc, n_c_tiles,
    RCEIL: tl.constexpr, WRITE_XHAT: tl.constexpr, SAVE_INPUTS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    b, r0, c0 = tile_origin(n_c_tiles, BR, BC)
    g = load_tile(g_ptr, b, r0, c0, R, C, sgb, sgr, sgc, BR, BC)
    u = load_tile(u_ptr, b, r0, c0, R, C, sub, sur, suc, BR, BC)
    v = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
    qbits, sbyte = _store_mx(q_ptr, s_ptr, v, b, r0, c0, R, C, RCEIL, BR, BC)
    if WRITE_XHAT:
        store_dequantized(h_ptr, qbits, sbyte, b, r0, c0, R, C, BR, BC)
    if SAVE_INPUTS:
        _store_mx(gq_ptr, gs_ptr, g, b, r0, c0, R, C, RCEIL, BR, BC)
        _store_mx(uq_ptr, us_ptr, u, b, r0, c0, R, C, RCEIL, BR, BC)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, rule: str, dequantized: torch.dtype | None = None,
                    save_inputs: bool = False):
    """``gate, up [..., H]`` (CUDA, same shape, any strides) -> ``(q e4m3 [..., H], s uint8 [..., H/32])``;
    with ``dequantized``, ``(q, s, h_hat)``, h_hat = dequantize(q, s) in that dtype, from the same pass;
    with ``save_inputs``, followed by ``(gate_q, gate_s, up_q, up_s)``, the contiguous rowwise MX pairs of
    gate and up, also from the same pass."""
    op = "mxfx.swiglu_quantize"
    for t in (gate, up):
        check_input(t, op)
        check_block_axis(t.shape, -1, op)
    check_rule(rule, op)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate of shape {tuple(gate.shape)} and up of shape {tuple(up.shape)} must match")
    (g3, _), (u3, _) = flat_blocks(as_brc(gate)), flat_blocks(as_brc(up))
    if g3.shape != u3.shape:  # one is flattened, the other not
        g3, u3 = as_brc(gate), as_brc(up)
        if g3.shape != u3.shape:  # views merged differently: fall back to matching copies
            g3, u3 = as_brc(gate.contiguous()), as_brc(up.contiguous())
    B, R, C = g3.shape
    q = torch.empty(gate.shape, dtype=torch.uint8, device=gate.device)
    s = torch.empty(scale_shape(gate.shape), dtype=torch.uint8, device=gate.device)
    h = torch.empty(gate.shape, dtype=dequantized, device=gate.device) if dequantized is not None else None
    saved = [torch.empty_like(t) for t in (q, s, q, s)] if save_inputs else [g3] * 4  # placeholders: not written
    br, bc, warps = FLAT_CONFIG if C == 32 else SWIGLU_CONFIG
    n_c = triton.cdiv(C, bc)
    if R * C > 0:
        launch(
            _swiglu_quantize_kernel, (triton.cdiv(R, br) * n_c, B),
            g3, u3, q, s, h if h is not None else g3, *saved, R, C, *g3.stride(), *u3.stride(), n_c,
            RCEIL=rule == "rceil", WRITE_XHAT=h is not None, SAVE_INPUTS=save_inputs, BR=br, BC=bc, num_warps=warps,
        )
    out = (q.view(torch.float8_e4m3fn), s) if h is None else (q.view(torch.float8_e4m3fn), s, h)
    if save_inputs:
        out += (saved[0].view(torch.float8_e4m3fn), saved[1], saved[2].view(torch.float8_e4m3fn), saved[3])
    return out
