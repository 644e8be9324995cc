"""Bandwidth of the MX Triton kernels against a device-to-device copy and against the movement ceiling of each
kernel's own access pattern, all measured in the same run.

bandwidth = (bytes read + bytes written) / device time per call. Device time: 20
calls, each after an L2 flush (a 256 MiB memset), captured in one CUDA graph and
replayed; minus the same graph with the flushes alone; median of 10 replays. The
graph removes host launch cost from the figure (that cost is what Inductor-launched
kernels save in compiled graphs, see ``mxfx.kernels.common.launch``); the eager column is
``triton.testing.do_bench`` of the Python call, host cost included.
Movement ceiling: the best tile of a movement-only variant of the kernel's access pattern (same loads and stores,
no MX arithmetic; ``bench/movement.py``), as % of the same copy. Goal: each kernel within 2 points of its ceiling.
Also torchao's ``to_mx`` under ``torch.compile``, shapes called in sequence so the
dynamic-shape recompile happens as it would for a user.

Usage: ``python bench/mx_kernels.py`` (CUDA + Triton; ``--format fp8_block`` the fp8_block kernels instead,
``--format mxfp8,fp8_block`` both); ``MXFX_BENCH_SWEEP=1`` also times
alternative tile configs (``MXFX_BENCH_SWEEP=rowwise,dual`` only those kernels), each checked byte for byte against
the kernel's own config on an input with NaN, +-Inf, zero, tiny and large blocks; ``MXFX_BENCH_MAXNREG=96,128``
times every config of the sweep also with those register caps. Prints a markdown table; writes it to
``$MXFX_BENCH_OUT/kernels.md`` when that variable is set.

``python bench/mx_kernels.py --launch KERNEL M K`` only calls sweep kernel ``KERNEL`` four times at ``[M, K]``, for
a profiler to read its third launch (after compilation and one warm call):
``ncu --clock-control none --set full -k regex:^_ --launch-skip 2 --launch-count 1 python bench/mx_kernels.py
--launch dual 65536 2048``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, run as a script

from bench import movement  # noqa: E402
from bench._results import emit  # noqa: E402
from mxfx.kernels.fp8_block import device_path as block_path  # noqa: E402
from mxfx.kernels.mx import device_path  # noqa: E402
from mxfx.kernels.mx import dual
from mxfx.kernels.mx import quantize
from mxfx.kernels.mx import swiglu
from mxfx.numerics.layout import to_blocked  # noqa: E402

SHAPES = [(65536, 2048), (131072, 1024), (16384, 4096)]
GOAL_POINTS = 2.0  # a kernel's goal: within this many points (% of copy) of its movement ceiling
COPY_BYTES = 2 << 30  # 2 GiB source


_FLUSH = None


def _graph_ms(fn, calls: int) -> float:
    """Median ms of one replay of a CUDA graph holding ``calls`` x (L2 flush, fn)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as graph capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            _FLUSH.zero_()
            fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del g
    return sorted(times)[len(times) // 2]


_FLUSH_MS: dict[int, float] = {}


def median_ms(fn, calls: int = 20) -> float:
    """Device ms per call of ``fn`` with a cold L2 (see the module docstring); falls back to do_bench."""
    try:
        if calls not in _FLUSH_MS:  # the graph of flushes alone, timed once
            _FLUSH_MS[calls] = _graph_ms(lambda: None, calls)
        return max(_graph_ms(fn, calls) - _FLUSH_MS[calls], 0.0) / calls
    except RuntimeError as e:  # something in fn cannot be captured: time it eagerly
        print(f"CUDA graph capture failed ({str(e)[:80]}); eager timing", flush=True)
        return eager_ms(fn)


def eager_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = eager_ms(lambda: dst.copy_(src))  # ~1 ms a call: host cost is nil, and a graph of 20 was slower
    src = dst = None  # freed (the lambda above names them)
    return 2 * COPY_BYTES / ms / 1e6  # GB/s (bytes read + written; ms is milliseconds)


def cases(m: int, k: int):
    """(name, fn, bytes moved, ceiling) per kernel at an [m, k] bf16 input; ceiling: a key of :func:`ceilings`."""
    n = m * k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g, u = torch.randn_like(x), torch.randn_like(x)
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(m, device="cuda")
    q, s = device_path.quantize_lastdim(x, "rceil")
    qc, sc = device_path.quantize_dual_source(x, "rceil", row=False)[3:5]
    qm, sm = device_path.quantize_dual_source(x, "rceil", col=False)[:2]  # MN-major scales (mxfx.kernels.mx.views)
    xf = x.float()  # an FP32 main weight of this shape
    q8 = n * (1 + 1 / 32)  # e4m3 payload + E8M0 scales
    return [
        ("quantize rowwise", lambda: device_path.quantize_lastdim(x, "rceil"), 2 * n + q8, "stream bf16 -> 1 B"),
        (
            "quantize columnwise (x.t())",
            lambda: device_path.quantize_lastdim(x.t(), "rceil"),
            2 * n + q8,
            "columnwise tiles",
        ),
        (
            "quantize dual (row + col)",
            lambda: device_path.quantize_dual(x, "rceil"),
            2 * n + 2 * q8,
            "transposed tiles",
        ),
        (
            "quantize dual, source layout",
            lambda: device_path.quantize_dual_source(x, "rceil"),
            2 * n + 2 * q8,
            "source tiles",
        ),
        (
            "quantize dual, blocked scales (native GEMM operands)",
            lambda: device_path.quantize_dual_blocked(x, "rceil"),
            2 * n + 2 * q8,
            "transposed tiles",
        ),
        (
            "quantize dual + to_blocked of both scales",
            lambda: [to_blocked(t) for t in device_path.quantize_dual(x, "rceil")[1::2]],
            2 * n + 2 * q8,
            "transposed tiles",
        ),
        (
            "quantize dual + both dequantized, source layout",
            lambda: device_path.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16),
            2 * n + 2 * q8 + 4 * n,
            "stream bf16 -> 2 x 1 B + 2 x bf16",
        ),
        (
            "weight refresh fp32 -> MX + BF16 forms, source layout",
            lambda: device_path.quantize_dual_source(xf, "rceil", dequantized=torch.bfloat16),
            4 * n + 2 * q8 + 4 * n,
            "stream fp32 -> 2 x 1 B + 2 x bf16",
        ),
        (
            "weight refresh fp32 -> BF16 forms only (keep_dequantized_weights, emulated)",
            lambda: device_path.quantize_dual_source(xf, "rceil", dequantized=torch.bfloat16, mx=False),
            4 * n + 4 * n,
            "stream fp32 -> 2 x bf16",
        ),
        (
            "quantize, blocked scales",
            lambda: device_path.quantize_blocked(x, "rceil"),
            2 * n + q8,
            "stream bf16 -> 1 B",
        ),
        (
            "dequantize -> bf16",
            lambda: device_path.dequantize_lastdim(q, s, torch.bfloat16),
            q8 + 2 * n,
            "stream 1 B -> bf16",
        ),
        (
            "dequantize -> bf16, source layout",
            lambda: device_path.dequantize_lastdim(qc, sc, torch.bfloat16),
            q8 + 2 * n,
            "stream 1 B -> bf16",
        ),
        (
            "dequantize -> bf16, MN-major scales",
            lambda: device_path.dequantize_lastdim(qm, sm, torch.bfloat16),
            q8 + 2 * n,
            "stream 1 B -> bf16",
        ),
        (
            "quantize-dequantize",
            lambda: device_path.quantize_dequantize(x, "rceil", torch.bfloat16),
            2 * n + q8 + 2 * n,
            "stream bf16 -> 1 B + bf16",
        ),
        (
            "swiglu+quantize (gate, up)",
            lambda: device_path.swiglu_quantize(g, u, "rceil"),
            4 * n + q8,
            "stream fp32 -> 1 B",
        ),
        (
            "swiglu+quantize (gate_up halves)",
            lambda: device_path.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil"),
            4 * n + q8,
            "stream fp32 -> 1 B",
        ),
        (
            "swiglu+quantize + values + saved gate/up MX (gate_up halves)",
            lambda: device_path.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil", torch.bfloat16, save_inputs=True),
            4 * n + q8 + 2 * n + 2 * q8,
            "stream fp32 -> bf16 + 3 x 1 B",
        ),
        (
            "route-weight+quantize",
            lambda: device_path.route_weight_quantize(x, w, "rceil"),
            2 * n + 4 * m + q8,
            "stream bf16 -> 1 B",
        ),
    ]


def fp8_block_cases(m: int, k: int):
    """:func:`cases` of the fp8_block kernels (1x128 E4M3 tiles, one FP32 scale each) at an [m, k] bf16 input."""
    n = m * k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(m, device="cuda")
    offs = torch.linspace(0, m, 65, device="cuda")[1:].round().to(torch.int32)  # 64 groups
    q8 = n * (1 + 4 / 128)  # e4m3 payload + float32 scales
    return [
        ("fp8_block quantize 1x128", lambda: block_path.quantize_1x128(x), 2 * n + q8, "stream bf16 -> 1 B"),
        (
            "fp8_block quantize dual (row + col, transposed)",
            lambda: block_path.quantize_1x128_dual(x),
            2 * n + 2 * q8,
            "transposed tiles",
        ),
        (
            "fp8_block quantize along tokens (x.t())",
            lambda: block_path.quantize_1x128_colwise(x),
            2 * n + q8,
            "columnwise tiles",
        ),
        (
            "fp8_block quantize along each group's tokens",
            lambda: block_path.quantize_1x128_grouped_tokens(x, offs),
            2 * n + q8,
            "columnwise tiles",
        ),
        (
            "fp8_block route-weight+quantize",
            lambda: block_path.route_weight_quantize_1x128(x, w),
            2 * n + 4 * m + q8,
            "stream bf16 -> 1 B",
        ),
        (
            "fp8_block swiglu+quantize + saved gate/up (gate_up halves)",
            lambda: block_path.swiglu_quantize_1x128_save(gu[:, :k], gu[:, k:]),
            4 * n + 3 * q8,
            "stream fp32 -> 3 x 1 B",
        ),
    ]


CASES = {"mxfp8": cases, "fp8_block": fp8_block_cases}
"""The kernel rows of each format (``--format``)."""


CEILINGS = {  # ceiling key -> movement-only variants (bench/movement.py) at an [m, k] input
    "stream bf16 -> 1 B": lambda m, k: movement.stream(m * k, torch.bfloat16, 0, 1),
    "stream bf16 -> 1 B + bf16": lambda m, k: movement.stream(m * k, torch.bfloat16, 1, 1),
    "stream bf16 -> 2 x 1 B + 2 x bf16": lambda m, k: movement.stream(m * k, torch.bfloat16, 2, 2),
    "stream fp32 -> 2 x 1 B + 2 x bf16": lambda m, k: movement.stream(m * k, torch.float32, 2, 2),
    "stream fp32 -> 2 x bf16": lambda m, k: movement.stream(m * k, torch.float32, 2, 0),
    "stream fp32 -> 1 B": lambda m, k: movement.stream(m * k, torch.float32, 0, 1),  # gate + up: 4 B read per value
    "stream fp32 -> bf16 + 3 x 1 B": lambda m, k: movement.stream(m * k, torch.float32, 1, 3),
    "stream fp32 -> 3 x 1 B": lambda m, k: movement.stream(m * k, torch.float32, 0, 3),
    "stream 1 B -> bf16": lambda m, k: movement.stream(m * k, torch.uint8, 1, 0),
    "transposed tiles": lambda m, k: movement.tiles(m, k, transposed=True),
    "columnwise tiles": lambda m, k: movement.tiles(m, k, transposed=True, row=False),
    "source tiles": lambda m, k: movement.tiles(m, k, transposed=False),
}


def ceiling_fraction(key: str, m: int, k: int, copy_gbs: float) -> float:
    """Best fraction of copy bandwidth of the movement-only variants of ``key`` at ``[m, k]``."""
    best = 0.0
    for fn, nbytes in CEILINGS[key](m, k):
        best = max(best, nbytes / median_ms(fn) / 1e6 / copy_gbs)
    torch.cuda.empty_cache()
    return best


def torchao_cases():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    fn = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL))
    for m, k in SHAPES:  # in sequence: the second shape triggers the dynamic-shape recompile
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fn(x)
        yield (m, k), "torchao to_mx RCEIL (torch.compile)", (lambda x=x: fn(x)), 2 * m * k + m * k * (1 + 1 / 32), None


def _variants():
    """(kernel, config module, fn(x), bytes per input element, configs to try, config attribute[, input dtype])."""
    flat = [(64, 32, 2), (128, 32, 4), (256, 32, 4), (256, 32, 8), (512, 32, 8)]
    small = [(16, 32, 1), (32, 32, 1), (32, 32, 2), (64, 32, 2), (64, 32, 4), (128, 32, 4)]  # 8 values/thread: slow
    tiles = [
        (64, 32, 1),
        (128, 32, 1),
        (64, 64, 1),
        (256, 32, 2),
        (128, 64, 2),
        (128, 64, 4),
        (256, 32, 4),
        (256, 64, 4),
        (32, 64, 1),
        (128, 64, 1),
        (64, 128, 2),
        (128, 128, 4),
    ]
    strided = [
        (16, 256, 8),
        (8, 256, 4),
        (8, 512, 4),
        (4, 1024, 8),
        (4, 512, 4),
        (2, 1024, 4),
        (1, 2048, 4),
        (8, 256, 2),
        (4, 256, 1),
        (2, 512, 2),
    ]
    q = lambda x: device_path.quantize_lastdim(x, "rceil")  # noqa: E731
    col = lambda x: device_path.quantize_lastdim(x.t(), "rceil")  # noqa: E731
    dl = lambda x: device_path.quantize_dual(x, "rceil")  # noqa: E731
    dls = lambda x: device_path.quantize_dual_source(x, "rceil")  # noqa: E731
    refresh = lambda x: device_path.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16)  # noqa: E731
    source = [(32, 64, 1), (32, 128, 1), (32, 32, 1), (64, 64, 1), (32, 64, 2), (32, 128, 2), (32, 256, 2)]
    partner = {}  # a second input per shape: gate and up must not share cache lines

    def sw(x):
        if x.shape not in partner:
            partner[x.shape] = torch.randn_like(x)
        return device_path.swiglu_quantize(x, partner[x.shape], "rceil")

    def route(x):
        if x.shape[0] not in partner:
            partner[x.shape[0]] = torch.rand(x.shape[0], device=x.device)
        return device_path.route_weight_quantize(x, partner[x.shape[0]], "rceil")

    # tall tiles: BM / 32 column scales per K row per program, the transposed scale store's unit
    transposed = [
        (32, 64, 1),
        (32, 32, 1),
        (32, 128, 2),
        (64, 64, 1),
        (64, 64, 2),
        (128, 32, 1),
        (128, 32, 2),
        (256, 32, 2),
        (128, 64, 2),
        (256, 32, 4),
        (128, 64, 4),
        (64, 32, 1),
    ]
    col_dual = lambda x: dual._quantize_both(  # noqa: E731  (the columnwise pair alone, transposed)
        x, "rceil", "probe", row=False, col=True, dequantized=None, transposed=True
    )

    forms = [(False, False), (True, False), (False, True), (True, True)]  # dual.ADDRESS_FORMS

    def sw_halves(x, save=False):
        gu = x.view(x.shape[0] // 2, 2 * x.shape[1])
        k = x.shape[1]
        return device_path.swiglu_quantize(
            gu[:, :k], gu[:, k:], "rceil", torch.bfloat16 if save else None, save_inputs=save
        )

    return [
        ("rowwise", quantize, q, 2 + 33 / 32, flat, "FLAT_CONFIG"),
        (
            "blocked",
            quantize,
            lambda x: device_path.quantize_blocked(x, "rceil"),
            2 + 33 / 32,
            [None, (128, 128, 8), (128, 128, 4), (128, 64, 4), (128, 256, 8), (128, 32, 4)],
            "BLOCKED_CONFIG",
        ),
        (
            "qdq",
            quantize,
            lambda x: device_path.quantize_dequantize(x, "rceil", torch.bfloat16),
            4 + 33 / 32,
            flat,
            "FLAT_CONFIG",
        ),
        ("route", quantize, route, 2 + 33 / 32, flat, "FLAT_CONFIG"),
        ("columnwise", quantize, col, 2 + 33 / 32, tiles, "COLWISE_CONFIG"),
        ("dual", dual, dl, 2 + 66 / 32, transposed, "TRANSPOSED_CONFIG"),
        ("columnwise_dual", dual, col_dual, 2 + 33 / 32, transposed, "TRANSPOSED_CONFIG"),
        ("dual_source", dual, dls, 2 + 66 / 32, source, "SOURCE_CONFIG[source]"),
        ("refresh", dual, refresh, 4 + 66 / 32 + 4, source, "SOURCE_CONFIG[source fp32]", torch.float32),
        ("dual_source_form", dual, dls, 2 + 66 / 32, forms, "ADDRESS_FORMS[source]"),
        ("dual_form", dual, dl, 2 + 66 / 32, forms, "ADDRESS_FORMS[transposed]"),
        (
            "dual_blocked_form",
            dual,
            lambda x: device_path.quantize_dual_blocked(x, "rceil"),
            2 + 66 / 32,
            forms,
            "ADDRESS_FORMS[blocked]",
        ),
        (
            "dual_hat_form",
            dual,
            lambda x: device_path.quantize_dual_source(x, "rceil", dequantized=torch.bfloat16),
            2 + 66 / 32 + 4,
            forms,
            "ADDRESS_FORMS[source]",
        ),
        ("refresh_form", dual, refresh, 4 + 66 / 32 + 4, forms, "ADDRESS_FORMS[source fp32]", torch.float32),
        ("swiglu_even", swiglu, sw, 4 + 33 / 32, [False, True], "STREAM_EVEN"),
        ("swiglu_even halves", swiglu, sw_halves, (4 + 33 / 32) / 2, [False, True], "STREAM_EVEN"),
        (
            "swiglu_even saved halves",
            swiglu,
            lambda x: sw_halves(x, True),
            (4 + 33 / 32 + 2 + 66 / 32) / 2,
            [False, True],
            "STREAM_EVEN",
        ),
        ("swiglu", swiglu, sw, 4 + 33 / 32, small, "FLAT_CONFIG"),
        ("swiglu gate_up halves", swiglu, sw_halves, (4 + 33 / 32) / 2, small, "FLAT_CONFIG"),
        (
            "swiglu saved halves",
            swiglu,
            lambda x: sw_halves(x, True),
            (4 + 33 / 32 + 2 + 66 / 32) / 2,
            small,
            "FLAT_WIDE_CONFIG",
        ),
        (
            "swiglu strided",
            swiglu,
            lambda x: device_path.swiglu_quantize(
                x[:, ::2], partner.setdefault(("odd", x.shape), torch.randn_like(x))[:, 1::2], "rceil"
            ),
            (4 + 33 / 32) / 2,
            strided,
            "SWIGLU_CONFIG",
        ),
    ]


def config_slot(mod, spec: str):
    """``(current value, setter)`` of the config ``spec`` of module ``mod``: an attribute ``NAME``, or one entry
    ``NAME[key]`` of a dict of configs (a key of digits is an int)."""
    attr, _, key = spec.partition("[")
    table = getattr(mod, attr)
    key = key.rstrip("]")
    if not key:
        return table, lambda cfg: setattr(mod, attr, cfg)
    key = int(key) if key.isdigit() else key
    return table[key], lambda cfg: table.__setitem__(key, cfg)


def special_input(dtype) -> torch.Tensor:
    """[256, 512] with NaN, +-Inf, all-zero, tiny and large blocks in both orientations, on the GPU."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=g) * torch.exp2(torch.randint(-20, 20, (256, 512), generator=g).float())
    x[3, 7], x[40, 100], x[77, 300] = float("nan"), float("inf"), float("-inf")
    x[64:96, 32:64], x[128:160, 64:96], x[200, 480:512] = 0.0, 1e-30, 3e4
    return x.to(dtype).cuda()


def output_bytes(out) -> list[torch.Tensor]:
    """Every tensor of ``out`` (a tensor or a sequence) as CPU bytes, for a byte-for-byte comparison."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [t.contiguous().view(torch.uint8).cpu() for t in outs if isinstance(t, torch.Tensor)]


def register_cap(mod, cap: int | None) -> None:
    """Launch every kernel of ``mod`` with ``maxnreg=cap`` (None: the module's own launch)."""
    own = getattr(mod, "_own_launch", mod.launch)
    mod._own_launch = own
    mod.launch = own if cap is None else (lambda k, g, *a, _own=own, **kw: _own(k, g, *a, **{**kw, "maxnreg": cap}))


def sweep(copy_gbs: float) -> list[str]:
    """Time alternative tile configs (and register caps) of each kernel (MXFX_BENCH_SWEEP); prints the best of each."""
    lines = ["", "| config sweep | shape | (BR, BC, warps) | maxnreg | % of copy | bytes |", "|" + "---|" * 6]
    best = {}
    only = os.environ.get("MXFX_BENCH_SWEEP", "1")
    caps = [None] + [int(c) for c in os.environ.get("MXFX_BENCH_MAXNREG", "").split(",") if c]
    for name, mod, fn, per_elem, configs, attr, *dtype in _variants():
        if only != "1" and name not in only.split(","):
            continue
        dtype = (dtype or [torch.bfloat16])[0]
        keep, use = config_slot(mod, attr)
        want = output_bytes(fn(special_input(dtype)))
        try:
            for cfg, cap in [(cfg, cap) for cfg in configs for cap in caps]:
                use(cfg)
                register_cap(mod, cap)
                same = all(torch.equal(a, b) for a, b in zip(output_bytes(fn(special_input(dtype))), want))
                fracs = []
                for m, k in SHAPES:
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    frac = per_elem * m * k / median_ms(lambda: fn(x)) / 1e6 / copy_gbs
                    fracs.append(frac)
                    lines.append(
                        f"| {name} | {m}x{k} | {cfg} | {cap} | {100 * frac:.1f}% | {'same' if same else 'DIFFER'} |"
                    )
                worst = min(fracs)
                if same and worst > best.get(name, (0,))[0]:
                    best[name] = (worst, (cfg, cap))
                print("\n".join(lines[-len(SHAPES) :]), flush=True)
        finally:
            use(keep)
            register_cap(mod, None)
            torch.cuda.empty_cache()
    lines += [
        "",
        "best (config, maxnreg) per kernel (highest worst-shape %, same bytes): "
        + "; ".join(f"{n}: {c} {100 * w:.1f}%" for n, (w, c) in best.items()),
    ]
    print(lines[-1], flush=True)
    return lines


def launch_only(name: str, m: int, k: int, calls: int = 4) -> None:
    """Call sweep kernel ``name`` (a name of :func:`_variants`) ``calls`` times at ``[m, k]`` and nothing else."""
    kernels = {v[0]: v for v in _variants()}
    if name not in kernels:
        raise SystemExit(f"mx_kernels: unknown kernel {name!r}; choose from {', '.join(kernels)}")
    _, _, fn, _, _, _, *dtype = kernels[name]
    x = torch.randn(m, k, device="cuda", dtype=(dtype or [torch.bfloat16])[0])
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()


def main(formats: list[str]) -> None:
    t0 = time.time()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    rows = [
        f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}. "
        f"Copy (2 GiB, read + write): **{copy_gbs:.0f} GB/s**. Device time per call from CUDA graph "
        f"replays with L2 flushed before each call; eager = do_bench of the Python call (host cost included). "
        f"Ceiling: movement-only variant of the kernel's access pattern, same run; "
        f"goal: gap <= {GOAL_POINTS:g} points.",
        "",
        "| kernel | shape (bf16 in) | time (us) | GB/s | % of copy | movement ceiling (% of copy) | gap (points) "
        "| goal | eager (us) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ceiling = {}

    def add(name, shape, fn, nbytes, key):
        ms = median_ms(fn)
        pct = 100 * nbytes / ms / 1e6 / copy_gbs
        if key is not None and (key, shape) not in ceiling:
            ceiling[(key, shape)] = 100 * ceiling_fraction(key, *shape, copy_gbs)
        top = ceiling.get((key, shape))
        gap = "-" if top is None else f"{top - pct:.1f}"
        ok = "-" if top is None else ("ok" if top - pct <= GOAL_POINTS else "missed")
        rows.append(
            f"| {name} | {shape[0]}x{shape[1]} | {ms * 1e3:.0f} | {nbytes / ms / 1e6:.0f} | {pct:.1f} | "
            f"{'-' if top is None else f'{top:.1f}'} | {gap} | {ok} | {eager_ms(fn) * 1e3:.0f} |"
        )
        print(rows[-1], flush=True)

    for fmt in formats:
        for shape in SHAPES:
            for name, fn, nbytes, key in CASES[fmt](*shape):
                add(name, shape, fn, nbytes, key)
            torch.cuda.empty_cache()
    if "mxfp8" in formats:  # the peer and the MX tile sweep
        try:
            for shape, name, fn, nbytes, key in torchao_cases():
                add(name, shape, fn, nbytes, key)
        except ImportError as e:
            rows.append(f"\ntorchao not importable ({e}); its rows are missing.")
    print(f"main table done in {time.time() - t0:.0f} s", flush=True)
    if "mxfp8" in formats and os.environ.get("MXFX_BENCH_SWEEP"):
        rows += sweep(copy_gbs)
    table = "\n".join(rows)
    emit("kernels.md", table)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Bandwidth of the MX kernels against a copy and their movement ceilings.")
    cli.add_argument(
        "--launch",
        nargs=3,
        metavar=("KERNEL", "M", "K"),
        help="only call sweep kernel KERNEL four times at [M, K] (for a profiler)",
    )
    cli.add_argument(
        "--format", default="mxfp8", help="comma list of the formats whose kernels to time: " + ", ".join(CASES)
    )
    args = cli.parse_args()
    if args.launch:
        launch_only(args.launch[0], int(args.launch[1]), int(args.launch[2]))
    else:
        main(args.format.split(","))
