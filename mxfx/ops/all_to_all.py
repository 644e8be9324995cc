"""MXFP8 all-to-all: like ``all_to_all_single`` on token rows, but the rows travel as MXFP8 qdata + scales.

Expert-parallel dispatch and combine move one hidden row per routed token-expert
assignment (the recipe, "Smaller Dispatch and Combine Payloads"). A row of width ``d`` (a multiple of 32) crosses the
wire as ``d`` E4M3 bytes plus ``d/32`` E8M0 scale bytes, 33/32 bytes per value
instead of BF16's 2 (48.4% less payload). Split sizes, route indices and route
weights are not touched.

* forward: quantize rowwise (blocks of 32 along the hidden dim), send qdata and
  scales as uint8 views with the same splits (collectives refuse float8 dtypes),
  dequantize on receive to the input dtype.
* backward: the gradient of an all-to-all is an all-to-all with the splits
  swapped; it can travel as MXFP8 the same way, chosen separately.

:func:`all_to_all_mx` is the transport of an already quantized pair, for a
consumer that reads the received (qdata, scales) directly (a grouped MX GEMM)
instead of the dequantized rows :func:`mx_all_to_all` returns.

Everything here runs under Dynamo/AOTAutograd tracing with unbacked split sizes
(``counts.tolist()`` under ``capture_scalar_outputs``): no branch depends on them,
so one compiled graph serves every routing outcome, zero-row sends included.
"""

from __future__ import annotations

import torch

from mxfx.numerics.mx import BLOCK_SIZE, SCALE_RULES
from mxfx.kernels.mx import custom_ops
from mxfx.runtime import stats as quant_stats

PRECISIONS = ("mxfp8", "bf16")
PAYLOAD_FORMAT = "mxfp8"
"""The format the rows travel in (the name its statistics are filed under)."""
_c10d = torch.ops._c10d_functional


def _group_name(group) -> str:
    if isinstance(group, str):
        return group
    from torch.distributed._functional_collectives import _resolve_group_name

    return _resolve_group_name(group)


def _all_to_all(t: torch.Tensor, output_split_sizes, input_split_sizes, group_name: str) -> torch.Tensor:
    """One functional all-to-all along dim 0, waited on (the same ops Dynamo records for user code)."""
    out = _c10d.all_to_all_single(t.contiguous(), list(output_split_sizes), list(input_split_sizes), group_name)
    return _c10d.wait_tensor(out)


def all_to_all_mx(
    qdata: torch.Tensor,
    scales: torch.Tensor,
    output_split_sizes: list,
    input_split_sizes: list,
    group: "str | torch.distributed.ProcessGroup",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send the rows of an MX pair to their ranks; return the received pair (no autograd).

    Two collectives with the same splits, each on a uint8 view: qdata
    ``[N, ..., D]`` (D bytes a row) and scales ``[N, ..., D/32]`` (D/32 bytes a row).
    Source: the recipe, "Smaller Dispatch and Combine Payloads" (qdata and scales need transfers of their own).

    Args:
        qdata: ``torch.float8_e4m3fn [N_send, ..., D]``, rows blocked along the last dim.
        scales: E8M0 bytes, ``uint8`` or ``float8_e8m0fnu`` ``[N_send, ..., D/32]``.
        output_split_sizes: rows received from each rank (ints or SymInts), summing to N_recv.
        input_split_sizes: rows sent to each rank, summing to N_send.
        group: process group or its registered name.

    Returns:
        ``(qdata e4m3 [N_recv, ..., D], scales uint8 [N_recv, ..., D/32])``.

    Raises:
        TypeError: qdata is not float8_e4m3fn or scales are not one-byte E8M0.
    """
    if qdata.dtype != torch.float8_e4m3fn or scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(
            f"mxfx.all_to_all_mx: expected qdata float8_e4m3fn and scales uint8/float8_e8m0fnu, "
            f"got {qdata.dtype} and {scales.dtype}"
        )
    name = _group_name(group)
    q = _all_to_all(qdata.view(torch.uint8), output_split_sizes, input_split_sizes, name)
    s = _all_to_all(scales.view(torch.uint8), output_split_sizes, input_split_sizes, name)
    return q.view(torch.float8_e4m3fn), s


def _observe(site: tuple, direction: str, rule: str, source, pair, combine: str = "") -> None:
    """Statistics of a payload quantize (:func:`mxfx.runtime.stats.observe`) at ``<site prefix>_<direction>``;
    ``site``: ``(prefix, every)``, prefix "" for none."""
    if site[0]:
        quant_stats.observe(f"{site[0]}_{direction}", PAYLOAD_FORMAT, rule, "rows", source, pair, site[1], combine)


def _transport(x, output_split_sizes, input_split_sizes, group_name, precision, rule, site=("", 1), direction="fwd"):
    if precision != "mxfp8":
        return _all_to_all(x, output_split_sizes, input_split_sizes, group_name)
    q, s = custom_ops.quantize(x.contiguous(), rule)
    _observe(site, direction, rule, (x,), (q, s))
    rq, rs = all_to_all_mx(q, s, output_split_sizes, input_split_sizes, group_name)
    return custom_ops.dequantize(rq, rs, x.dtype)


def _weighted_transport(
    dy, rw, x_dtype, output_split_sizes, input_split_sizes, group_name, precision, rule, site=("", 1)
):
    """Send ``dy * rw`` (rows scaled in fp32) back along the route; MXFP8 forms the product inside the quantize."""
    if precision != "mxfp8":
        scaled = (dy.float() * rw.float().reshape(-1, 1)).to(x_dtype)
        return _all_to_all(scaled, output_split_sizes, input_split_sizes, group_name)
    q, s = custom_ops.route_weight_quantize(dy.contiguous(), rw.reshape(-1).contiguous(), rule)
    _observe(site, "bwd", rule, (dy, rw), (q, s), "route_weight")
    rq, rs = all_to_all_mx(q, s, output_split_sizes, input_split_sizes, group_name)
    return custom_ops.dequantize(rq, rs, x_dtype)


class _MXAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group_name, fwd, bwd, rule, return_mx, rw, site):
        ctx.route = (output_split_sizes, input_split_sizes, group_name, bwd, rule, x.dtype, site)
        if return_mx:
            q, s = custom_ops.quantize(x.contiguous(), rule)
            _observe(site, "fwd", rule, (x,), (q, s))
            rq, rs = all_to_all_mx(q, s, output_split_sizes, input_split_sizes, group_name)
            ctx.mark_non_differentiable(rq, rs)
            return custom_ops.dequantize(rq, rs, x.dtype), rq, rs
        rows = _transport(x, output_split_sizes, input_split_sizes, group_name, fwd, rule, site)
        if rw is None:
            return rows
        ctx.save_for_backward(rows, rw)
        return rows.float() * rw.float().reshape(-1, 1)

    @staticmethod
    def backward(ctx, dy, *_):
        out_splits, in_splits, group_name, bwd, rule, x_dtype, site = ctx.route
        d_rw = None
        if ctx.saved_tensors:  # route-weighted combine: the weight multiply is formed in the backward quantize
            rows, rw = ctx.saved_tensors
            d_rw = (dy.float() * rows.float()).sum(-1).reshape(rw.shape).to(rw.dtype)
            dx = _weighted_transport(dy, rw, x_dtype, in_splits, out_splits, group_name, bwd, rule, site)
        else:
            dx = _transport(dy, in_splits, out_splits, group_name, bwd, rule, site, "bwd")  # the reverse route
        return dx, None, None, None, None, None, None, None, d_rw, None


def mx_all_to_all(
    x: torch.Tensor,
    output_split_sizes: list,
    input_split_sizes: list,
    group: "str | torch.distributed.ProcessGroup",
    *,
    forward: str = "mxfp8",
    backward: str = "mxfp8",
    scale_rule: str = "rceil",
    return_mx: bool = False,
    route_weight: torch.Tensor | None = None,
    stats: str = "",
    stats_every: int = 100,
):
    """``all_to_all_single`` of token rows with MXFP8 transport: ``x [N_send, ..., D]`` -> ``[N_recv, ..., D]``.

    Differentiable; the backward sends the gradient back along the reverse route
    (splits swapped). Each direction travels as MXFP8 (rows quantized with
    ``scale_rule``, dequantized on receive, so the result is ``dequantize(quantize(row))``
    of the row sent) or as written (``"bf16"``: the tensor's own dtype, unchanged).
    Source: the recipe, "Smaller Dispatch and Combine Payloads" and "Routed Experts" (dispatch and combine, forward and
    backward).

    Args:
        x: bf16/fp16/fp32 rows, any trailing shape; last dim D a multiple of 32
            when either direction is MXFP8. Zero rows are fine.
        output_split_sizes: rows received from each rank (ints or SymInts).
        input_split_sizes: rows sent to each rank; their sum is ``x.shape[0]``.
        group: process group or its registered name (graphs carry the name).
        forward / backward: transport precision of each direction, "mxfp8" or "bf16".
        scale_rule: "rceil" (default) or "floor".
        return_mx: also return the received MX pair (needs ``forward="mxfp8"``), for a
            consumer that takes MX operands (a grouped MX GEMM) and so need not
            quantize the dequantized rows again.
        route_weight: optional per-received-row weights ``[N_recv]`` or ``[N_recv, 1]``
            (the combine's route weights): the result is the received rows times them,
            in fp32, and the backward sends ``dy * route_weight`` formed inside the
            transport quantize (``mxfx::route_weight_quantize``, the recipe, "Kernel Problems and Fusions" (Table 25)),
            so no weighted gradient is materialized in BF16 first. Not with ``return_mx``.
        stats, stats_every: quantization statistics of the MXFP8 payloads (:mod:`mxfx.runtime.stats`) every
            ``stats_every`` optimizer steps, at sites ``<stats>_fwd`` and ``<stats>_bwd`` (the pass gives
            ``<module>/all_to_all/<role>``); "" (default): none.

    Returns:
        The received rows in ``x.dtype`` (fp32 rows scaled by ``route_weight`` when given); with ``return_mx``,
        ``(rows, qdata e4m3 [N_recv, ..., D], scales uint8 [N_recv, ..., D/32])`` where ``rows`` is exactly
        ``dequantize(qdata, scales)`` and the pair carries no gradient.

    Raises:
        ValueError: unknown precision or scale rule, or D not a multiple of 32 with
            an MXFP8 direction (keep such rows in BF16), or ``stats_every`` not an int >= 1.
    """
    for what, value, valid in (
        ("forward", forward, PRECISIONS),
        ("backward", backward, PRECISIONS),
        ("scale_rule", scale_rule, SCALE_RULES),
    ):
        if value not in valid:
            raise ValueError(
                f"mxfx.mx_all_to_all: {what}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}"
            )
    if "mxfp8" in (forward, backward) and (x.dim() < 2 or x.shape[-1] % BLOCK_SIZE):
        raise ValueError(
            f"mxfx.mx_all_to_all: rows of shape {tuple(x.shape)} need a last dim that is a multiple of "
            f"{BLOCK_SIZE} for MXFP8 transport; send them in BF16 (forward='bf16', backward='bf16')"
        )
    if return_mx and forward != "mxfp8":
        raise ValueError(f"mxfx.mx_all_to_all: return_mx=True needs forward='mxfp8', got forward={forward!r}")
    if route_weight is not None and (
        return_mx or route_weight.dim() > 2 or route_weight.numel() != route_weight.shape[0]
    ):
        raise ValueError(
            f"mxfx.mx_all_to_all: route_weight of shape {tuple(route_weight.shape)} must be [N_recv] or [N_recv, 1] "
            f"(one weight per received row) and cannot be combined with return_mx"
        )
    if (
        not isinstance(stats, str)
        or not isinstance(stats_every, int)
        or isinstance(stats_every, bool)
        or stats_every < 1
    ):
        raise ValueError(
            f"mxfx.mx_all_to_all: stats={stats!r} must be a site prefix string ('' for none) and "
            f"stats_every={stats_every!r} an int >= 1"
        )
    return _MXAllToAll.apply(
        x,
        list(output_split_sizes),
        list(input_split_sizes),
        _group_name(group),
        forward,
        backward,
        scale_rule,
        return_mx,
        route_weight,
        (stats, stats_every),
    )
