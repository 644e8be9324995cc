"""Device dispatch for the fp8_block quantize kernels: Triton on CUDA, the ``mxfx.numerics.block`` reference elsewhere.

Both paths give the same values and shapes (tests/test_block_gpu.py compares them byte for byte); scales of the
1x128 operands are column-major on CUDA (what the GEMMs read) and row-major on CPU, which the CPU GEMMs read
through their strides. ``mxfx.kernels.fp8_block.quantize`` (and so Triton) is imported only once a CUDA tensor
arrives.
"""

from __future__ import annotations

import torch

from mxfx.numerics import block as bf
from mxfx.device import triton_available
from mxfx.kernels.common.silu import swiglu_fp32


def _triton():
    from mxfx.kernels.fp8_block import quantize

    return quantize


def quantize_1x128(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 along the last dim: ``(qdata [..., K], scales [M, ceil(K/128)])``, leading dims merged into M."""
    if triton_available(x):
        return _triton().quantize_1x128(x, rule)
    q, s = bf.quantize_1x128(x, rule=rule)
    return q, s.reshape(-1, s.shape[-1])


def route_weight_quantize_1x128(
    dy: torch.Tensor, weight: torch.Tensor, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_1x128` of ``dy [S, D] * weight[:, None]`` (``weight [S]``) formed in float32."""
    if triton_available(dy):
        return _triton().route_weight_quantize_1x128(dy, weight, rule)
    return quantize_1x128(dy.float() * weight.reshape(-1, 1).float(), rule)


def route_grad_operands_1x128(
    dout: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rule: str = "rceil", rows_of: torch.Tensor | None = None
):
    """The backward operands of a route-weighted grouped GEMM from its output gradient ``dout [S, D]``, the route
    weights ``weight [S]`` and its unweighted output ``y [S, D]``: :func:`route_weight_quantize_1x128`'s pair of
    ``dy = dout * weight[:, None]``, ``dy`` in BF16 and ``sum(dout * y, -1)`` in fp32, each formed in fp32 (one
    read of ``dout`` on CUDA): ``(qdata, scales, dy, d_weight)``. With ``rows_of`` (integer ``[S]``), ``dout`` is a
    ``[T, D]`` source whose rows ``dout[rows_of]`` are the gradient (gathered by the kernel on CUDA)."""
    if triton_available(dout):
        return _triton().route_grad_operands_1x128(dout, weight, y, rule, rows_of=rows_of)
    if rows_of is not None:
        dout = dout[rows_of]
    dy = dout.float() * weight.reshape(-1, 1).float()
    return (*quantize_1x128(dy, rule), dy.to(torch.bfloat16), (dout.float() * y.float()).sum(-1))


def swiglu_quantize_1x128(
    gate: torch.Tensor, up: torch.Tensor, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_1x128` of ``silu(gate) * up`` formed in float32 (mxfx's SiLU)."""
    if triton_available(gate):
        return _triton().swiglu_quantize_1x128(gate, up, rule)
    if gate.shape != up.shape:
        raise ValueError(
            f"mxfx.kernels.fp8_block.device_path.swiglu_quantize_1x128: gate {tuple(gate.shape)} "
            f"and up {tuple(up.shape)} differ"
        )
    return quantize_1x128(swiglu_fp32(gate, up), rule)


def swiglu_quantize_1x128_save(gate: torch.Tensor, up: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, ...]:
    """:func:`swiglu_quantize_1x128` plus the 1x128 pairs of gate and up (the SwiGLU inputs saved for backward), from
    one read on CUDA: ``(q, s, gate_q, gate_s, up_q, up_s)``, leading dims merged."""
    if triton_available(gate):
        return _triton().swiglu_quantize_1x128_save(gate, up, rule)
    k = gate.shape[-1]
    q, s = swiglu_quantize_1x128(gate, up, rule)
    return (q.reshape(-1, k), s, *quantize_1x128(gate.reshape(-1, k), rule), *quantize_1x128(up.reshape(-1, k), rule))


def quantize_1x128_dual(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, ...]:
    """:func:`quantize_1x128` and :func:`quantize_1x128_colwise` of ``x [T, K]``, from one read on CUDA:
    ``(q [T, K], s [T, ceil(K/128)], qt [K, T], st [K, ceil(T/128)])``."""
    if triton_available(x):
        return _triton().quantize_1x128_dual(x, rule)
    return (*quantize_1x128(x, rule), *quantize_1x128_colwise(x, rule))


def quantize_1x128_colwise(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 along the tokens of ``x [T, K]``: ``(qdata [K, T], scales [K, ceil(T/128)])``."""
    if triton_available(x):
        return _triton().quantize_1x128_colwise(x, rule)
    return bf.quantize_1x128(x.t(), rule=rule)


def quantize_1x128_grouped_tokens(
    x: torch.Tensor, offs: torch.Tensor, rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 along each group's tokens of ``x [S, K]``: ``(qdata [K, S], scales [K, capacity])``."""
    if triton_available(x):
        return _triton().quantize_1x128_grouped_tokens(x, offs, rule)
    q, s = bf.quantize_1x128_grouped_tokens(x, offs, rule)
    return q.t().contiguous(), s.t()


def quantize_1x128_grouped_dual(
    x: torch.Tensor, offs: torch.Tensor, rule: str = "rceil", route: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_1x128` and :func:`quantize_1x128_grouped_tokens` of ``x [S, K]`` (times ``route[:, None]``,
    ``route [S]``, formed in float32), from one read on CUDA: ``(q [S, K], s [S, ceil(K/128)], qt [K, 128 C],
    st [K, C])``."""
    if triton_available(x):
        return _triton().quantize_1x128_grouped_dual(x, offs, rule, route=route)
    v = x if route is None else x.float() * route.reshape(-1, 1).float()
    return (*quantize_1x128(v, rule), *quantize_1x128_grouped_tokens(v, offs, rule))


def quantize_128x128(w: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks over the last two dims: ``(qdata [..., N, K], scales [..., ceil(N/128), ceil(K/128)])``."""
    if triton_available(w):
        return _triton().quantize_128x128(w, rule)
    return bf.quantize_128x128(w, rule)


def transpose_qdata(q: torch.Tensor) -> torch.Tensor:
    """``q [..., R, C]`` E4M3 qdata -> contiguous ``[..., C, R]``, the same bytes (``mxfx.kernels.common.transpose`` on
    CUDA, torch's strided copy elsewhere)."""
    if triton_available(q):
        from mxfx.kernels.common import transpose

        return transpose.transpose_lastdims(q)
    return q.transpose(-2, -1).contiguous()
