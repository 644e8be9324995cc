"""Triton fp8_block quantize kernels: 1x128 rowwise, 1x128 columnwise (along tokens), 128x128, SwiGLU.

One kernel reads a ``[B, R, C]`` view through its strides and encodes tiles of it with the rules of
``mxfx.block_format`` (bit for bit; the interpreter test in tests/test_block_gemm.py checks it):

* :func:`quantize_1x128`: ``x [..., K]`` -> qdata ``[..., K]``, scales ``[M, ceil(K/128)]`` over the
  leading dims merged, column-major (stride ``(1, M)``: what cuBLAS's blockwise GEMM and the grouped
  kernel read, contiguous along rows);
* :func:`swiglu_quantize_1x128`: the same for ``silu(gate) * up`` formed in FP32 in the same pass
  (mxfx's SiLU, ``mxfx.kernels.silu``);
* :func:`quantize_1x128_colwise`: ``x [T, K]`` tiled along the tokens T (wgrad's operands) ->
  qdata ``[K, T]`` (the transpose, row-major: the K-major operand of ``dW = dY^T X``) and scales
  ``[K, ceil(T/128)]`` column-major;
* :func:`quantize_128x128`: weights ``[..., N, K]`` -> qdata, scales ``[..., ceil(N/128), ceil(K/128)]``.

Tiles are 128 values along the quantized axis and ``BLOCK`` (32 or 128) across it; partial tiles are
masked with zeros, which never raise an amax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.block_format import SCALE_RULES, TILE, check_input, check_rule, group_tile_capacity, n_tiles
from mxfx.kernels.mx_block import silu_f32

ROWWISE_ROWS = 32
"""Rows per program of the 1x128 rowwise kernels (one 128-wide tile each); 4 warps."""
COLWISE_COLS = 64
"""Columns per program of the columnwise kernel (128 tokens deep)."""

_AXIS_ROW, _AXIS_COL, _AXIS_BOTH = 1, 0, 2


@triton.jit
def _scales(amax, bad, RCEIL: tl.constexpr):
    """float32 scales from float32 amax (>= 0, finite where ``bad`` is false): the rules of mxfx.block_format."""
    if RCEIL:
        bits = amax.to(tl.int32, bitcast=True)
        # amax in [2^(E-127), 2^(E-126)); one step up when its significand exceeds 1.75 (field 0x600000)
        e = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.maximum(e, -126)  # subnormal amax lands here too
        s = ((e + 127) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # 2^-126
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where(bad, float("nan"), s)


@triton.jit
def _quantize_kernel(
    x_ptr, u_ptr, q_ptr, s_ptr, offs_ptr,
    R, C, G,
    sxb, sxr, sxc, sqb, sqr, sqc, ssb, ssr, ssc,
    AXIS: tl.constexpr, RCEIL: tl.constexpr, SWIGLU: tl.constexpr, GROUPED: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):
    b = tl.program_id(2)
    if GROUPED:  # program 0-index = scale slot; find the group whose token tiles hold it (no host sync)
        slot = tl.program_id(0)
        r0 = 0
        r_end = 0
        seen = 0
        for g in range(0, G):
            start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            end = tl.load(offs_ptr + g)
            n = tl.cdiv(end - start, BR)
            hit = (slot >= seen) & (slot < seen + n)
            r0 = tl.where(hit, start + (slot - seen) * BR, r0)
            r_end = tl.where(hit, end, r_end)
            seen += n
        rows = r0 + tl.arange(0, BR)
        R = r_end
    else:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    offs = b.to(tl.int64) * sxb + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
    v = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        v = silu_f32(v) * up
    nonfinite = ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
    if AXIS == 1:
        amax, bad = tl.max(tl.abs(v), axis=1), tl.max(nonfinite, axis=1) > 0
        s = _scales(amax, bad, RCEIL)
        sv = s[:, None]
        s_offs = rows.to(tl.int64) * ssr + tl.program_id(1) * ssc
        s_ok = rows < R
    elif AXIS == 0:
        amax, bad = tl.max(tl.abs(v), axis=0), tl.max(nonfinite, axis=0) > 0
        s = _scales(amax, bad, RCEIL)
        sv = s[None, :]
        s_offs = tl.program_id(0) * ssr + cols.to(tl.int64) * ssc
        s_ok = tl.max(ok.to(tl.int32), axis=0) > 0  # a column with a row in range (grouped: unused slots stay)
    else:
        amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
        bad = tl.max(tl.max(nonfinite, axis=1), axis=0) > 0
        s = _scales(amax, bad, RCEIL)
        sv = s
        s_offs = tl.program_id(0) * ssr + tl.program_id(1) * ssc
        s_ok = True
    if RCEIL:
        # 2^-e from the bits of 2^e (exact for e in [-126, 120]; a plain 1 / s would be an approximate division)
        inv = ((254 << 23) - sv.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        scaled = v * inv
    else:
        scaled = tl.math.div_rn(v, sv)
    qbits = tl.minimum(tl.maximum(scaled, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    # the NaN tile: every byte 0x7F (mxfx.block_format.NAN_BYTE); tested on the scale's bits, which no float
    # comparison rewrite can drop
    nan_tile = (sv.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    qbits = tl.where(nan_tile, 0x7F, qbits)
    q_offs = b.to(tl.int64) * sqb + rows[:, None].to(tl.int64) * sqr + cols[None, :].to(tl.int64) * sqc
    tl.store(q_ptr + q_offs, qbits.to(tl.uint8), mask=ok)
    tl.store(s_ptr + b.to(tl.int64) * ssb + s_offs, s, mask=s_ok)


def _rule(rule: str, op: str) -> bool:
    check_rule(rule, op)
    return rule == SCALE_RULES[0]  # rceil


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as a 2D ``[M, K]`` view where strides allow (a copy otherwise)."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def _rowwise(x: torch.Tensor, up: torch.Tensor | None, rule: str, op: str):
    rceil = _rule(rule, op)
    shape = x.shape
    x2 = _as_rows(x)
    u2 = None if up is None else _as_rows(up)
    if u2 is not None and u2.stride() != x2.stride():
        x2, u2 = x2.contiguous(), u2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((n_tiles(k), m), dtype=torch.float32, device=x.device).t()  # [M, K/128] column-major
    if m and k:
        grid = (triton.cdiv(m, ROWWISE_ROWS), n_tiles(k), 1)
        _quantize_kernel[grid](
            x2, x2 if u2 is None else u2, q.view(torch.uint8), s, s, m, k, 0, 0, *x2.stride(), 0, *q.stride(), 0,
            *s.stride(), AXIS=_AXIS_ROW, RCEIL=rceil, SWIGLU=u2 is not None, GROUPED=False, BR=ROWWISE_ROWS, BC=TILE,
            num_warps=4,
        )
    return q.view(shape), s


def quantize_1x128(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 rowwise quantize on the GPU (module docstring): ``(qdata [..., K], scales [M, ceil(K/128)])``."""
    op = "mxfx.block_quantize.quantize_1x128"
    check_input(x, op)
    return _rowwise(x, None, rule, op)


def swiglu_quantize_1x128(gate: torch.Tensor, up: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_1x128(silu(gate) * up)`` in one pass, the product formed in FP32 (mxfx's SiLU)."""
    op = "mxfx.block_quantize.swiglu_quantize_1x128"
    check_input(gate, op)
    check_input(up, op)
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(
            f"{op}: gate of shape {tuple(gate.shape)} on {gate.device} and up of shape {tuple(up.shape)} on "
            f"{up.device} must match"
        )
    return _rowwise(gate, up, rule, op)


def quantize_1x128_colwise(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the tokens of ``x [T, K]``: qdata ``[K, T]`` row-major, scales ``[K, ceil(T/128)]``
    column-major (the wgrad operands of ``scaled_mm``)."""
    op = "mxfx.block_quantize.quantize_1x128_colwise"
    check_input(x, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: needs a 2D [T, K] tensor, got shape {tuple(x.shape)}; merge the token dims first")
    rceil = _rule(rule, op)
    t, k = x.shape
    q = torch.empty((k, t), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((n_tiles(t), k), dtype=torch.float32, device=x.device)  # its transpose is the result
    if t and k:
        grid = (n_tiles(t), triton.cdiv(k, COLWISE_COLS), 1)
        # the tile is [128 tokens, COLWISE_COLS features] of x; q is written through its transpose's strides
        _quantize_kernel[grid](
            x, x, q.view(torch.uint8), s, s, t, k, 0, 0, *x.stride(), 0, q.stride(1), q.stride(0), 0, *s.stride(),
            AXIS=_AXIS_COL, RCEIL=rceil, SWIGLU=False, GROUPED=False, BR=TILE, BC=COLWISE_COLS, num_warps=4,
        )
    return q, s.t()


def quantize_1x128_grouped_tokens(x: torch.Tensor, offs: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped wgrad operand: 1x128 tiles down the tokens of ``x [S, K]`` restarting at each group start
    (``mxfx.block_format.quantize_1x128_grouped_tokens``), written transposed: qdata ``[K, S]`` (columns past
    ``offs[-1]`` unwritten), scales ``[K, group_tile_capacity(S, G)]`` column-major (unused slots 1.0)."""
    op = "mxfx.block_quantize.quantize_1x128_grouped_tokens"
    check_input(x, op)
    if x.dim() != 2 or offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device:
        raise ValueError(
            f"{op}: needs x [S, K] and int32 offs [G] on one device, got x {tuple(x.shape)} on {x.device}, offs "
            f"{offs.dtype} {tuple(offs.shape)} on {offs.device}"
        )
    rceil = _rule(rule, op)
    t, k = x.shape
    slots = group_tile_capacity(t, offs.numel())
    q = torch.empty((k, t), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.ones((slots, k), dtype=torch.float32, device=x.device)
    if t and k and offs.numel():
        grid = (slots, triton.cdiv(k, COLWISE_COLS), 1)
        _quantize_kernel[grid](
            x, x, q.view(torch.uint8), s, offs, t, k, offs.numel(), 0, *x.stride(), 0, q.stride(1), q.stride(0), 0,
            *s.stride(), AXIS=_AXIS_COL, RCEIL=rceil, SWIGLU=False, GROUPED=True, BR=TILE, BC=COLWISE_COLS,
            num_warps=4,
        )
    return q, s.t()


def quantize_128x128(w: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 quantize of ``w [..., N, K]``: ``(qdata [..., N, K], scales [..., ceil(N/128), ceil(K/128)])``."""
    op = "mxfx.block_quantize.quantize_128x128"
    check_input(w, op, min_dim=2)
    rceil = _rule(rule, op)
    *lead, n, k = w.shape
    w3 = w.reshape(-1, n, k)
    q = torch.empty(w3.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((w3.shape[0], n_tiles(n), n_tiles(k)), dtype=torch.float32, device=w.device)
    if q.numel():
        grid = (n_tiles(n), n_tiles(k), w3.shape[0])
        _quantize_kernel[grid](
            w3, w3, q.view(torch.uint8), s, s, n, k, 0, *w3.stride(), *q.stride(), *s.stride(),
            AXIS=_AXIS_BOTH, RCEIL=rceil, SWIGLU=False, GROUPED=False, BR=TILE, BC=TILE, num_warps=8,
        )
    return q.view(w.shape), s.view(*lead, n_tiles(n), n_tiles(k))
