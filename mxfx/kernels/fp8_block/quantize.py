"""Triton fp8_block quantize kernels: 1x128 rowwise, 1x128 columnwise (along tokens), 128x128, SwiGLU.

One kernel reads a ``[B, R, C]`` view through its strides and encodes tiles of it with the rules of
``mxfx.numerics.block`` (bit for bit; the interpreter test in tests/test_block_gemm.py checks it):

* :func:`quantize_1x128`: ``x [..., K]`` -> qdata ``[..., K]``, scales ``[M, ceil(K/128)]`` over the
  leading dims merged, column-major (stride ``(1, M)``: what cuBLAS's blockwise GEMM and the grouped
  kernel read, contiguous along rows);
* :func:`swiglu_quantize_1x128`: the same for ``silu(gate) * up`` formed in FP32 in the same pass
  (mxfx's SiLU, ``mxfx.kernels.common.silu``);
* :func:`route_weight_quantize_1x128`: the same for ``dy * weight[:, None]`` (one route weight per row),
  formed in FP32 in the same pass;
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

from mxfx.numerics.block import SCALE_RULES, TILE, check_rule, group_tile_capacity, n_tiles
from mxfx.numerics.mx import check_input
from mxfx.kernels.common.e4m3_triton import E4M3_NAN_BYTE, HW_E4M3_CONVERSION
from mxfx.kernels.common.launch import launch
from mxfx.kernels.common.silu_triton import silu_f32
from mxfx.kernels.fp8_block.slots_triton import slot_rows

ROWWISE_ROWS = 32
"""Rows per program of the 1x128 rowwise kernels (one 128-wide tile each); 4 warps."""
COLWISE_COLS = 64
"""Columns per program of the columnwise kernel (128 tokens deep)."""

_AXIS_ROW, _AXIS_COL, _AXIS_BOTH = 1, 0, 2


@triton.jit
def _scales(amax, bad, RCEIL: tl.constexpr):
    """float32 scales from float32 amax (>= 0, finite where ``bad`` is false): the rules of mxfx.numerics.block."""
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
def _encode(v, sv, RCEIL: tl.constexpr):
    """E4M3 bytes (uint8) of the float32 tile ``v`` divided by its scales ``sv`` (broadcast against ``v``); every byte
    0x7F (``mxfx.numerics.block.NAN_BYTE``) in a tile whose scale is NaN.

    Compiled (``HW_E4M3_CONVERSION``), a NaN tile's values are made NaN (its inverse scale, or the division by its NaN
    scale) and the conversion makes them 0x7F and saturates the rest: no clamp, no select per value."""
    nan_tile = (sv.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000  # on the scale's bits: no rewrite drops it
    if RCEIL:
        # 2^-e from the bits of 2^e (exact for e in [-126, 120]; a plain 1 / s would be an approximate division);
        # |v| / 2^e <= 448 by the rule (amax's significand above 1.75 takes the next power): nothing to clamp
        inv = ((254 << 23) - sv.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        if HW_E4M3_CONVERSION:
            inv = tl.where(nan_tile, float("nan"), inv)
        scaled = v * inv
    else:  # amax / 448 rounded to nearest may round down: a quotient a little above 448 saturates
        scaled = tl.math.div_rn(v, sv)
        if not HW_E4M3_CONVERSION:
            scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    qbits = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if HW_E4M3_CONVERSION:
        return qbits
    return tl.where(nan_tile, E4M3_NAN_BYTE, qbits).to(tl.uint8)


@triton.jit
def _amax_bad(v, axis: tl.constexpr):
    """``(amax, bad)`` of float32 tile ``v`` along ``axis`` (None: the whole tile): the largest magnitude and whether
    a NaN or an infinity is among the values, from one integer max of the magnitudes' bits (non-negative floats
    order as their bits do, and NaN and infinity have the largest bits)."""
    mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if axis is None:
        m = tl.max(tl.max(mag, axis=1), axis=0)
    else:
        m = tl.max(mag, axis=axis)
    return m.to(tl.float32, bitcast=True), m >= 0x7F800000


@triton.jit
def _row_tiles(v, RCEIL: tl.constexpr):
    """``(qbits, scales [BR])`` of a ``[BR, 128]`` tile, one 1x128 tile per row."""
    amax, bad = _amax_bad(v, 1)
    s = _scales(amax, bad, RCEIL)
    return _encode(v, s[:, None], RCEIL), s


@triton.jit
def _col_tiles(v, RCEIL: tl.constexpr):
    """``(qbits, scales [BC])`` of a ``[128, BC]`` tile, one 1x128 tile per column."""
    amax, bad = _amax_bad(v, 0)
    s = _scales(amax, bad, RCEIL)
    return _encode(v, s[None, :], RCEIL), s


def _quantize_kernel(
    x_ptr,
    u_ptr,
    q_ptr,
    s_ptr,
    offs_ptr,
    R,
    C,
    G,
    sxb,
    sxr,
    sxc,
    sqb,
    sqr,
    sqc,
    ssb,
    ssr,
    ssc,
    AXIS: tl.constexpr,
    RCEIL: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROUTE: tl.constexpr,
    GROUPED: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    G_PAD: tl.constexpr,
):
    b = tl.program_id(2)
    if GROUPED:  # program 0-index = scale slot; the group whose token tiles hold it (no host sync)
        slot = tl.program_id(0)
        r0, _, r_end = slot_rows(offs_ptr, G, slot, G_PAD, BR)
        rows = r0 + tl.arange(0, BR)
        R = r_end
        q_rows = slot * BR + tl.arange(0, BR)  # the slot's own rows of qdata: +0 past the group's end
    else:
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        q_rows = rows
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    offs = b.to(tl.int64) * sxb + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
    v = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        v = silu_f32(v) * up
    if ROUTE:  # u_ptr holds one route weight per row (rows of a 2D input): the product formed in fp32
        v = v * tl.load(u_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[:, None]
    if AXIS == 1:
        qbits, s = _row_tiles(v, RCEIL)
        s_offs = rows.to(tl.int64) * ssr + tl.program_id(1) * ssc
        s_ok = rows < R
    elif AXIS == 0:
        qbits, s = _col_tiles(v, RCEIL)
        s_offs = tl.program_id(0) * ssr + cols.to(tl.int64) * ssc
        s_ok = tl.max(ok.to(tl.int32), axis=0) > 0  # a column with a row in range (grouped: unused slots stay)
    else:
        amax, bad = _amax_bad(v, None)
        s = _scales(amax, bad, RCEIL)
        qbits = _encode(v, s, RCEIL)
        s_offs = tl.program_id(0) * ssr + tl.program_id(1) * ssc
        s_ok = True
    q_offs = b.to(tl.int64) * sqb + q_rows[:, None].to(tl.int64) * sqr + cols[None, :].to(tl.int64) * sqc
    q_ok = (cols[None, :] < C) if GROUPED else ok  # grouped: every row of the slot, its padding's +0 too
    tl.store(q_ptr + q_offs, qbits, mask=q_ok)
    tl.store(s_ptr + b.to(tl.int64) * ssb + s_offs, s, mask=s_ok)


@triton.jit
def _route_grad_kernel(
    d_ptr,
    i_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    dy_ptr,
    p_ptr,
    R,
    C,
    RCEIL: tl.constexpr,
    GATHER: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """One ``[BR, 128]`` tile of a route-weighted grouped GEMM's output gradient ``dout`` (contiguous ``[R, C]``,
    as the saved unweighted output ``y``): ``dy = dout * w[:, None]`` formed in fp32, its 1x128 rows quantized
    (qdata ``[R, C]``, scale storage ``[ceil(C/128), R]``), ``dy`` in BF16 (the BF16 wgrad's operand), and the
    tile's part of each row's route-weight gradient ``sum(dout * y)`` (fp32 ``[R, ceil(C/128)]``). ``GATHER``:
    row r of ``dout`` is row ``i[r]`` of a contiguous ``[T, C]`` source (``i``: ``[R]`` integers in range)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok = rows < R
    ok = row_ok[:, None] & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    if GATHER:
        src = tl.load(i_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        d = tl.load(d_ptr + src[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        d = tl.load(d_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    n_tiles = tl.num_programs(1)
    tl.store(p_ptr + rows.to(tl.int64) * n_tiles + tl.program_id(1), tl.sum(d * y, axis=1), mask=row_ok)
    v = d * tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(dy_ptr + offs, v.to(tl.bfloat16), mask=ok)
    qbits, s = _row_tiles(v, RCEIL)
    tl.store(q_ptr + offs, qbits, mask=ok)
    tl.store(s_ptr + tl.program_id(1).to(tl.int64) * R + rows, s, mask=row_ok)


# The 128x128 weight quantize stores one scale per program: the strides of its scale grid (ceil(K/128) and
# ceil(N/128) * ceil(K/128)) change nothing in its code, so weights of every shape share one compile of it.
_weight_quantize_kernel = triton.jit(do_not_specialize=["ssb", "ssr", "ssc"])(_quantize_kernel)
_quantize_kernel = triton.jit(_quantize_kernel)  # the activation quantizes: specialized on every size and stride


@triton.jit
def _swiglu_save_kernel(
    g_ptr,
    u_ptr,
    q_ptr,
    s_ptr,
    gq_ptr,
    gs_ptr,
    uq_ptr,
    us_ptr,
    R,
    C,
    sxr,
    sxc,
    ssr,
    ssc,
    RCEIL: tl.constexpr,
    BR: tl.constexpr,
):
    """1x128 rows of ``silu(gate) * up``, of gate and of up from one read: qdata ``[R, C]`` contiguous, scales
    ``[R, ceil(C/128)]`` through ``(ssr, ssc)``, the same layout for all three."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
    gate = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    q_offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    s_offs = rows.to(tl.int64) * ssr + tl.program_id(1) * ssc
    s_ok = rows < R
    qbits, s = _row_tiles(silu_f32(gate) * up, RCEIL)
    tl.store(q_ptr + q_offs, qbits, mask=ok)
    tl.store(s_ptr + s_offs, s, mask=s_ok)
    qbits, s = _row_tiles(gate, RCEIL)
    tl.store(gq_ptr + q_offs, qbits, mask=ok)
    tl.store(gs_ptr + s_offs, s, mask=s_ok)
    qbits, s = _row_tiles(up, RCEIL)
    tl.store(uq_ptr + q_offs, qbits, mask=ok)
    tl.store(us_ptr + s_offs, s, mask=s_ok)


@triton.jit
def _dual_kernel(
    x_ptr,
    w_ptr,
    offs_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    T,
    K,
    G,
    QT_ROW,
    sxr,
    sxc,
    ssr,
    ssc,
    sstr,
    sstc,
    RCEIL: tl.constexpr,
    ROUTE: tl.constexpr,
    GROUPED: tl.constexpr,
    G_PAD: tl.constexpr,
):
    """Both 1x128 tilings of a ``[128 tokens, 128 features]`` tile of ``x [T, K]`` (times ``w[t]`` per row with
    ``ROUTE``, in fp32) from one read: along K into ``q [T, K]`` / ``s [T, ceil(K/128)]``, along the tokens into
    ``qt [K, QT_ROW]`` / ``st [K, tiles]`` (scales through their strides).

    ``GROUPED``: the token tiles restart at each group start of ``offs [G]``; program 0-index ``p`` below the slot
    count (``num_programs(0) - ceil(T/128)``) takes slot ``p``'s tile (its rows, and all 128 columns of the slot in
    ``qt``: +0 past the group's end, scale 1 in an unused slot); the ``ceil(T/128)`` programs after them write the
    row tiles of the rows past ``offs[G-1]``, which no slot holds, and nothing else."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    if GROUPED:
        slots = tl.num_programs(0) - tl.cdiv(T, 128)
        in_slot = p < slots
        s0, s_lo, s_end = slot_rows(offs_ptr, G, p, G_PAD, 128)  # (0, 0, 0) for an unused slot: no rows
        r0 = tl.where(in_slot, s0, (p - slots) * 128)  # a tail program: its rows past the last group end
        r_lo = tl.where(in_slot, s_lo, tl.load(offs_ptr + G - 1))
        r_end = tl.where(in_slot, s_end, T)
    else:
        in_slot = True
        r0 = p * 128
        r_lo = 0
        r_end = T
    rows = r0 + tl.arange(0, 128)
    row_ok = (rows >= r_lo) & (rows < r_end)
    if r0 + 128 > r_lo:  # false only for a tail program wholly before the last group end
        ok = row_ok[:, None] & (cols[None, :] < K)
        v = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=ok, other=0.0).to(
            tl.float32
        )
        if ROUTE:
            v = v * tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        qbits, s = _row_tiles(v, RCEIL)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], qbits, mask=ok)
        tl.store(s_ptr + rows.to(tl.int64) * ssr + tl.program_id(1) * ssc, s, mask=row_ok)
        if in_slot:
            qbits, s = _col_tiles(v, RCEIL)
            qt_rows = qt_ptr + cols[None, :].to(tl.int64) * QT_ROW
            if GROUPED:  # every column of the slot, its +0 too
                tl.store(qt_rows + (p * 128 + tl.arange(0, 128))[:, None], qbits, mask=cols[None, :] < K)
            else:
                tl.store(qt_rows + rows[:, None], qbits, mask=ok)
            tl.store(st_ptr + cols.to(tl.int64) * sstr + p * sstc, s, mask=cols < K)


def _rule(rule: str, op: str) -> bool:
    check_rule(rule, op)
    return rule == SCALE_RULES[0]  # rceil


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as a 2D ``[M, K]`` view where strides allow (a copy otherwise)."""
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def _rows_with(x: torch.Tensor, up: torch.Tensor | None):
    """``x`` (and ``up``) as 2D ``[M, K]`` views sharing one set of strides (copies where they would not)."""
    x2 = _as_rows(x)
    u2 = None if up is None else _as_rows(up)
    if u2 is not None and u2.stride() != x2.stride():
        x2, u2 = x2.contiguous(), u2.contiguous()
    return x2, u2


def _new_rows_pair(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ``(qdata uint8 [M, K], scale storage float32 [ceil(K/128), M])``: the kernels write the bytes and the
    storage; callers return ``q.view(e4m3)`` and ``s.t()`` (column-major ``[M, ceil(K/128)]``), views made after the
    launch so that a traced launch mutates whole tensors."""
    return (
        torch.empty((m, k), dtype=torch.uint8, device=device),
        torch.empty((n_tiles(k), m), dtype=torch.float32, device=device),
    )


def _rowwise(x: torch.Tensor, up: torch.Tensor | None, rule: str, op: str, route: torch.Tensor | None = None):
    """The 1x128 rowwise launch: of ``x``, of ``silu(x) * up`` (``up`` given) or of ``x * route[:, None]``
    (``route``: one weight per row of a 2D ``x``), the combination formed in fp32."""
    rceil = _rule(rule, op)
    shape = x.shape
    x2, u2 = _rows_with(x, up)
    if route is not None:
        u2 = route
    m, k = x2.shape
    q, s = _new_rows_pair(m, k, x.device)
    if m * k > 0:
        grid = (triton.cdiv(m, ROWWISE_ROWS), n_tiles(k), 1)
        launch(
            _quantize_kernel,
            grid,
            x2,
            s if u2 is None else u2,  # u_ptr: unread without up or route (an output: no second copy of x)
            q,
            s,
            s,
            m,
            k,
            0,
            0,
            *x2.stride(),
            0,
            k,
            1,
            0,
            1,
            m,
            AXIS=_AXIS_ROW,
            RCEIL=rceil,
            SWIGLU=up is not None,
            ROUTE=route is not None,
            GROUPED=False,
            G_PAD=1,
            BR=ROWWISE_ROWS,
            BC=TILE,
            num_warps=4,
        )
    return q.view(torch.float8_e4m3fn).view(shape), s.t()


def _check_pair(gate: torch.Tensor, up: torch.Tensor, op: str) -> None:
    check_input(gate, op, "fp8_block", min_dim=1)
    check_input(up, op, "fp8_block", min_dim=1)
    if gate.shape != up.shape or gate.device != up.device:
        raise ValueError(
            f"{op}: gate of shape {tuple(gate.shape)} on {gate.device} and up of shape {tuple(up.shape)} on "
            f"{up.device} must match"
        )


def quantize_1x128(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 rowwise quantize on the GPU (module docstring): ``(qdata [..., K], scales [M, ceil(K/128)])``."""
    op = "mxfx.block_quantize.quantize_1x128"
    check_input(x, op, "fp8_block", min_dim=1)
    return _rowwise(x, None, rule, op)


def route_weight_quantize_1x128(dy: torch.Tensor, weight: torch.Tensor, rule: str = "rceil"):
    """:func:`quantize_1x128` of ``dy [S, D] * weight[:, None]`` (``weight [S]``, one route weight per row) formed
    in fp32 in the same pass: the dgrad operand of a route-weighted grouped GEMM without its product in memory."""
    op = "mxfx.block_quantize.route_weight_quantize_1x128"
    check_input(dy, op, "fp8_block", min_dim=2)
    if dy.dim() != 2 or weight.shape != (dy.shape[0],) or weight.device != dy.device or not weight.is_floating_point():
        raise ValueError(
            f"{op}: needs dy [S, D] and one floating route weight per row [S] on its device, got dy "
            f"{tuple(dy.shape)} on {dy.device} and weight {weight.dtype} {tuple(weight.shape)} on {weight.device}; "
            "flatten the weights to [S]"
        )
    return _rowwise(dy, None, rule, op, route=weight.contiguous())


def route_grad_operands_1x128(
    dout: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    rule: str = "rceil",
    *,
    rows_of: torch.Tensor | None = None,
    rows: int = ROWWISE_ROWS,
    warps: int = 4,
):
    """The backward operands of a route-weighted grouped GEMM ``out = y * weight[:, None]`` from one read of its
    output gradient ``dout [S, D]``: :func:`route_weight_quantize_1x128`'s pair of ``dy = dout * weight[:, None]``,
    ``dy`` in BF16 (the BF16 wgrad's operand) and the route weights' gradient ``sum(dout * y, -1)`` in fp32 ``[S]``
    (``y``: the unweighted output, ``[S, D]``), each formed in fp32: ``(qdata, scales, dy, d_weight)``. With
    ``rows_of`` (integer ``[S]``), ``dout`` is a ``[T, D]`` source and its rows ``dout[rows_of]`` are read where the
    kernel needs them, never written out as ``[S, D]`` (a combine's backward: each token's gradient read once per
    expert it went to); every index must be in ``[0, T)``, as for ``dout[rows_of]``. ``rows`` (a power of two) and
    ``warps`` per program of one 128-wide tile: the same values at any launch but for the route weights' gradient, an
    FP32 sum whose order they change.

    Raises:
        TypeError / ValueError: dout or y not a bf16 / fp16 / fp32 tensor; dout not 2D, y not of its shape and
            device, weight not one floating value per row on its device; an unknown rule; rows or warps out of range
            (each naming this op)."""
    op = "mxfx.block_quantize.route_grad_operands_1x128"
    check_input(dout, op, "fp8_block", min_dim=2)
    check_input(y, op, "fp8_block", min_dim=2)
    rows_shape = tuple(dout.shape) if rows_of is None else (rows_of.shape[0], dout.shape[-1])
    if dout.dim() != 2 or tuple(y.shape) != rows_shape or y.device != dout.device:
        raise ValueError(
            f"{op}: needs dout [S, D] (or a [T, D] source and rows_of [S]) and the unweighted output y [S, D] on its "
            f"device, got dout {tuple(dout.shape)} on {dout.device} and y {tuple(y.shape)} on {y.device}"
        )
    if rows_of is not None and (
        rows_of.dim() != 1 or rows_of.dtype not in (torch.int32, torch.int64) or rows_of.device != dout.device
    ):
        raise ValueError(
            f"{op}: rows_of must be an int32 or int64 index [S] on {dout.device}, got {rows_of.dtype} "
            f"{tuple(rows_of.shape)} on {rows_of.device}"
        )
    weight_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if weight.shape != (y.shape[0],) or weight.device != dout.device or weight.dtype not in weight_dtypes:
        raise ValueError(
            f"{op}: needs one fp32/bf16/fp16 route weight per row of y {tuple(y.shape)} on its device, got "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}; flatten the weights to [S]"
        )
    if not (type(rows) is int and 1 <= rows <= 1024 and rows & (rows - 1) == 0) or not (
        type(warps) is int and warps in (1, 2, 4, 8, 16)
    ):
        raise ValueError(
            f"{op}: rows must be a power of two from 1 to 1024 and warps one of 1, 2, 4, 8, 16, got rows={rows!r}, "
            f"warps={warps!r} for dout {tuple(dout.shape)}"
        )
    rceil = _rule(rule, op)
    m, k = y.shape
    d, y = dout.contiguous(), y.contiguous()
    q, s = _new_rows_pair(m, k, dout.device)
    dy = torch.empty((m, k), dtype=torch.bfloat16, device=dout.device)
    parts = torch.empty((m, n_tiles(k)), dtype=torch.float32, device=dout.device)
    if m * k > 0:
        grid = (triton.cdiv(m, rows), n_tiles(k), 1)
        launch(
            _route_grad_kernel,
            grid,
            d,
            parts if rows_of is None else rows_of.contiguous(),  # i_ptr: unread without rows_of (an output, so
            # that no second copy of a traced dout is made for it)
            weight.contiguous(),
            y,
            q,
            s,
            dy,
            parts,
            m,
            k,
            RCEIL=rceil,
            GATHER=rows_of is not None,
            BR=rows,
            BC=TILE,
            num_warps=warps,
        )
    return q.view(torch.float8_e4m3fn), s.t(), dy, parts.sum(-1)


def swiglu_quantize_1x128(
    gate: torch.Tensor, up: torch.Tensor, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_1x128(silu(gate) * up)`` in one pass, the product formed in FP32 (mxfx's SiLU)."""
    op = "mxfx.block_quantize.swiglu_quantize_1x128"
    _check_pair(gate, up, op)
    return _rowwise(gate, up, rule, op)


def swiglu_quantize_1x128_save(gate: torch.Tensor, up: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, ...]:
    """:func:`swiglu_quantize_1x128` and the 1x128 pairs of ``gate`` and ``up`` themselves (what the SwiGLU
    backward keeps), from one read: ``(q, s, gate_q, gate_s, up_q, up_s)``, qdata ``[M, K]`` (leading dims merged),
    scales ``[M, ceil(K/128)]`` column-major. Raises TypeError / ValueError naming this function for inputs that
    are not bf16/fp16/fp32, shapes or devices that differ, or an unknown rule."""
    op = "mxfx.block_quantize.swiglu_quantize_1x128_save"
    _check_pair(gate, up, op)
    rceil = _rule(rule, op)
    g2, u2 = _rows_with(gate, up)
    m, k = g2.shape
    out = [t for _ in range(3) for t in _new_rows_pair(m, k, gate.device)]
    if m * k > 0:
        launch(
            _swiglu_save_kernel,
            (triton.cdiv(m, ROWWISE_ROWS), n_tiles(k)),
            g2,
            u2,
            *out,
            m,
            k,
            *g2.stride(),
            1,
            m,
            RCEIL=rceil,
            BR=ROWWISE_ROWS,
            num_warps=4,
        )
    return tuple(t.view(torch.float8_e4m3fn) if i % 2 == 0 else t.t() for i, t in enumerate(out))


def _tokens_input(x: torch.Tensor, rule: str, op: str) -> tuple[bool, tuple[int, int]]:
    """Checks of a ``[T, K]`` input tiled along its tokens: ``(rceil, (T, K))``; ValueError naming ``op`` otherwise."""
    check_input(x, op, "fp8_block", min_dim=1)
    if x.dim() != 2:
        raise ValueError(f"{op}: needs a 2D [T, K] tensor, got shape {tuple(x.shape)}; merge the token dims first")
    return _rule(rule, op), tuple(x.shape)


DUAL_WARPS = 8
"""Warps of a dual-quantize program (one 128 x 128 tile)."""


def quantize_1x128_dual(x: torch.Tensor, rule: str = "rceil", *, warps: int = DUAL_WARPS) -> tuple[torch.Tensor, ...]:
    """Both 1x128 tilings of ``x [T, K]`` from one read: :func:`quantize_1x128` (along K) and
    :func:`quantize_1x128_colwise` (along the tokens), ``(q [T, K], s [T, ceil(K/128)], qt [K, T],
    st [K, ceil(T/128)])``, both scale matrices column-major; ``warps`` per 128 x 128 tile (the same bytes at any
    count). Raises TypeError / ValueError naming this function for
    an input that is not 2D bf16/fp16/fp32, or an unknown rule."""
    rceil, (t, k) = _tokens_input(x, rule, "mxfx.block_quantize.quantize_1x128_dual")
    q, s = _new_rows_pair(t, k, x.device)
    qt, st = _new_rows_pair(k, t, x.device)
    if t * k > 0:
        launch(
            _dual_kernel,
            (n_tiles(t), n_tiles(k)),
            x,
            s,  # w_ptr, offs_ptr: unread (outputs, so that no second copy of a traced x is made for them)
            s,
            q,
            s,
            qt,
            st,
            t,
            k,
            0,
            t,
            *x.stride(),
            1,
            t,
            1,
            k,
            RCEIL=rceil,
            ROUTE=False,
            GROUPED=False,
            G_PAD=1,
            num_warps=warps,
        )
    return q.view(torch.float8_e4m3fn), s.t(), qt.view(torch.float8_e4m3fn), st.t()


def quantize_1x128_grouped_dual(
    x: torch.Tensor, offs: torch.Tensor, rule: str = "rceil", *, route: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Both fp8_block operands of a routed gradient from one read of ``x [S, K]`` (times ``route[:, None]``, one
    weight per row, formed in fp32, with ``route``): :func:`quantize_1x128` (the dgrad operand) and
    :func:`quantize_1x128_grouped_tokens` (the wgrad operand), ``(q [S, K], s [S, ceil(K/128)], qt [K, 128 C],
    st [K, C])``, both scale matrices column-major. Raises TypeError / ValueError naming this function for an
    input that is not 2D bf16/fp16/fp32, ``offs`` not int32 ``[G]`` or ``route`` not ``[S]`` floats on x's
    device, or an unknown rule."""
    op = "mxfx.block_quantize.quantize_1x128_grouped_dual"
    rceil, (t, k) = _tokens_input(x, rule, op)
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device:
        raise ValueError(
            f"{op}: needs int32 offs [G] on {x.device}, got {offs.dtype} {tuple(offs.shape)} on {offs.device}"
        )
    if route is not None and (route.shape != (t,) or route.device != x.device or not route.is_floating_point()):
        raise ValueError(
            f"{op}: route must be one floating weight per row of x {tuple(x.shape)} on {x.device}, got "
            f"{route.dtype} {tuple(route.shape)} on {route.device}; flatten the route weights to [S]"
        )
    g = offs.numel()
    slots = group_tile_capacity(t, g)
    q, s = _new_rows_pair(t, k, x.device)
    qt, st = _new_rows_pair(k, TILE * slots, x.device)
    if g == 0 or t * k == 0:  # no group: every row past the (absent) last end, every slot unused
        q, s_t = _rowwise(x, None, rule, op, route=None if route is None else route.contiguous())
        return q, s_t, qt.zero_().view(torch.float8_e4m3fn), st.fill_(1.0).t()
    launch(
        _dual_kernel,
        (slots + n_tiles(t), n_tiles(k)),
        x,
        s if route is None else route.contiguous(),  # w_ptr: unread without route
        offs,
        q,
        s,
        qt,
        st,
        t,
        k,
        g,
        TILE * slots,
        *x.stride(),
        1,
        t,
        1,
        k,
        RCEIL=rceil,
        ROUTE=route is not None,
        GROUPED=True,
        G_PAD=triton.next_power_of_2(g),
        num_warps=DUAL_WARPS,
    )
    return q.view(torch.float8_e4m3fn), s.t(), qt.view(torch.float8_e4m3fn), st.t()


def quantize_1x128_colwise(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the tokens of ``x [T, K]``: qdata ``[K, T]`` row-major, scales ``[K, ceil(T/128)]``
    column-major (the wgrad operands of ``scaled_mm``)."""
    rceil, (t, k) = _tokens_input(x, rule, "mxfx.block_quantize.quantize_1x128_colwise")
    q, s = _new_rows_pair(k, t, x.device)  # s: [ceil(T/128), K], its transpose is the result
    if t * k > 0:
        grid = (n_tiles(t), triton.cdiv(k, COLWISE_COLS), 1)
        # the tile is [128 tokens, COLWISE_COLS features] of x; q is written through its transpose's strides
        launch(
            _quantize_kernel,
            grid,
            x,
            s,  # u_ptr, unread: an output, so that no second copy of a traced x is made for it
            q,
            s,
            s,
            t,
            k,
            0,
            0,
            *x.stride(),
            0,
            1,
            t,
            0,
            k,
            1,
            AXIS=_AXIS_COL,
            RCEIL=rceil,
            SWIGLU=False,
            ROUTE=False,
            GROUPED=False,
            G_PAD=1,
            BR=TILE,
            BC=COLWISE_COLS,
            num_warps=4,
        )
    return q.view(torch.float8_e4m3fn), s.t()


def quantize_1x128_grouped_tokens(
    x: torch.Tensor, offs: torch.Tensor, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped wgrad operand: 1x128 tiles down the tokens of ``x [S, K]`` restarting at each group start, each in a
    128-column slot (``mxfx.numerics.block.quantize_1x128_grouped_tokens``), written transposed: qdata
    ``[K, 128 * C]`` (+0 past each group's end and in unused slots), scales ``[K, C]`` column-major (unused slots
    1.0), ``C = group_tile_capacity(S, G)``."""
    op = "mxfx.block_quantize.quantize_1x128_grouped_tokens"
    check_input(x, op, "fp8_block", min_dim=1)
    if x.dim() != 2 or offs.dtype != torch.int32 or offs.dim() != 1 or offs.device != x.device:
        raise ValueError(
            f"{op}: needs x [S, K] and int32 offs [G] on one device, got x {tuple(x.shape)} on {x.device}, offs "
            f"{offs.dtype} {tuple(offs.shape)} on {offs.device}"
        )
    rceil = _rule(rule, op)
    t, k = x.shape
    slots = group_tile_capacity(t, offs.numel())
    q = torch.empty((k, TILE * slots), dtype=torch.uint8, device=x.device)
    s = torch.ones((slots, k), dtype=torch.float32, device=x.device)
    if t * k * offs.numel() == 0:
        q.zero_()
    else:
        grid = (slots, triton.cdiv(k, COLWISE_COLS), 1)
        launch(
            _quantize_kernel,
            grid,
            x,
            s,  # u_ptr, unread: an output, so that no second copy of a traced x is made for it
            q,
            s,
            offs,
            t,
            k,
            offs.numel(),
            0,
            *x.stride(),
            0,
            1,
            TILE * slots,
            0,
            k,
            1,
            AXIS=_AXIS_COL,
            RCEIL=rceil,
            SWIGLU=False,
            ROUTE=False,
            GROUPED=True,
            G_PAD=triton.next_power_of_2(offs.numel()),
            BR=TILE,
            BC=COLWISE_COLS,
            num_warps=4,
        )
    return q.view(torch.float8_e4m3fn), s.t()


def quantize_128x128(w: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 quantize of ``w [..., N, K]``: ``(qdata [..., N, K], scales [..., ceil(N/128), ceil(K/128)])``."""
    op = "mxfx.block_quantize.quantize_128x128"
    check_input(w, op, "fp8_block", min_dim=2)
    rceil = _rule(rule, op)
    *lead, n, k = w.shape
    w3 = w.reshape(-1, n, k)
    q = torch.empty(w3.shape, dtype=torch.uint8, device=w.device)
    s = torch.empty((w3.shape[0], n_tiles(n), n_tiles(k)), dtype=torch.float32, device=w.device)
    if q.numel():
        grid = (n_tiles(n), n_tiles(k), w3.shape[0])
        launch(
            _weight_quantize_kernel,
            grid,
            w3,
            s,  # u_ptr, unread
            q,
            s,
            s,
            n,
            k,
            0,
            *w3.stride(),
            *q.stride(),
            *s.stride(),
            AXIS=_AXIS_BOTH,
            RCEIL=rceil,
            SWIGLU=False,
            ROUTE=False,
            GROUPED=False,
            G_PAD=1,
            BR=TILE,
            BC=TILE,
            num_warps=8,
        )
    return q.view(torch.float8_e4m3fn).view(w.shape), s.view(*lead, n_tiles(n), n_tiles(k))
