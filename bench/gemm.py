"""fp8_block GEMMs on the GPU against BF16 and rowwise FP8: a dense table and a grouped table, one run.

Dense (16384 tokens; 4096->4096 and 4096->14336), GEMM alone, operands already quantized:

* forward ``Y = X W^T``, dgrad ``dX = dY W``, wgrad ``dW = dY^T X``;
* ``bf16``: cuBLAS BF16 (``torch.mm`` in the layouts a linear uses);
* ``fp8_block``: ``mxfx.kernels.fp8_block.gemm.scaled_mm`` (cuBLAS blockwise FP8: 1x128 x 128x128, wgrad
  1x128 x 1x128 along the tokens);
* ``rowwise``: ``torch._scaled_mm`` with one FP32 scale per row of each operand (torchao's FP8 rowwise).

Grouped, at the routed-expert shapes of four MoE models (``--models``; 16384 tokens, each routed to top-k
experts: rows = 16384 k, the rows per expert in the table), the fused gate/up projection (d -> 2h) and the down
projection (h -> d), equal groups and skewed ones (a few hot experts, 1/8 empty, sizes not multiples of 16),
forward, dgrad and wgrad:

* ``olmoe`` d 2048, h 1024, 64 experts top-8; ``qwen3`` (Qwen3-30B-A3B) d 2048, h 768, 128 top-8;
  ``mixtral`` (Mixtral-8x7B) d 4096, h 14336, 8 top-2; ``deepseek`` (DeepSeek-V3) d 7168, h 2048, 256 top-8;
* ``bf16``: ``torch._grouped_mm``; ``rowwise``: ``torch._scaled_grouped_mm`` (rowwise scales; forward and dgrad);
* ``fp8_block``: the grouped GEMM mxfx runs by default (``mxfx.kernels.fp8_block.gemm.grouped_mm``: the
  warp-specialized sm90 kernel up to K 4096, the Triton kernel above), dgrad reading the weight's transposed
  copy with the same 128x128 scales; wgrad (``grouped_wgrad``, bf16 out) on operands tiled 1x128 along each
  group's tokens; ``sm90 WS``: forward and dgrad on the warp-specialized sm90 kernel (``grouped_gemm_sm90``)
  whatever K, timed beside it; ``Triton``: the Triton grouped kernel (``grouped_gemm_triton``, autotuned on first
  call), timed beside it.

On CUDA a third table times the routed BF16 wgrad into an FP32 gradient with accumulation on (a microbatch
after the first): today's three trips (``torch._grouped_mm``'s BF16 result, its widening, autograd's ``add_``)
against the kernels whose epilogue adds into the gradient: ``mxfx.kernels.common.grouped_wgrad_triton`` and, on
sm90, the ping-pong Gluon kernel ``mxfx.kernels.common.grouped_wgrad_sm90``.

Every FP8 result is first checked against its reference decode (dequantize exactly, FP32 GEMM):
relative Frobenius error below 1e-2 (bf16 output rounding is ~2e-3), or the script stops.
Times are ``triton.testing.do_bench`` medians (ms); ratios are BF16 time / arm time (> 1: faster).

    python bench/gemm.py                        # H200: every model's shapes, a few minutes
    python bench/gemm.py --models olmoe,qwen3   # some models' shapes
    python bench/gemm.py --quick                # smaller shapes, seconds
    python bench/gemm.py --tables wgrad-into    # only the routed wgrad into FP32
    python bench/gemm.py --device cpu --quick   # toy shapes on CPU (reference paths; a smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._results import emit  # noqa: E402
from mxfx.kernels.fp8_block import gemm as block_gemm  # noqa: E402
from mxfx.kernels.fp8_block import device_path as bq  # noqa: E402
from mxfx.kernels.fp8_block import grouped_gemm_triton  # noqa: E402
from mxfx.kernels.fp8_block.gemm import _sm90_kernel as sm90_kernel  # noqa: E402

E4M3 = torch.float8_e4m3fn


DEVICE = "cuda"


def bench(fn) -> float | None:
    """Median ms of ``fn`` (``triton.testing.do_bench`` on CUDA, a few wall-clock runs on CPU); None when the
    op refuses this device or shape (the arm is left out)."""
    try:
        fn()
    except (RuntimeError, NotImplementedError) as err:
        print(f"left out: {str(err).splitlines()[0][:120]}")
        return None
    if DEVICE != "cuda":
        import time

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def check(name: str, out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"bench/gemm.py: {name}: relative error {err:.3e} against the reference decode")
    return err


def rowwise(x: torch.Tensor, chunk: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rowwise: one FP32 scale per row (amax / 448), E4M3 payload; ``chunk`` rows at a time (a DeepSeek-V3
    expert stack in FP32 at once would take 28 GiB)."""
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk):
        xf = x[i : i + chunk].float()
        s[i : i + chunk] = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
        q[i : i + chunk] = (xf / s[i : i + chunk]).clamp(-448, 448).to(E4M3)
    return q, s


def rowwise_mm(a, sa, b, sb):
    """``A @ B^T`` for rowwise operands A [M, K], B [N, K] (scales [M, 1], [N, 1])."""
    return torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16)


def rowwise_arm(name, a, sa, b, sb):
    """Time of the rowwise FP8 GEMM after a check against its decode, or None where it is refused or wrong."""
    try:
        out = rowwise_mm(a, sa, b, sb)
    except (RuntimeError, NotImplementedError) as err:
        print(f"{name}: refused ({str(err).splitlines()[0][:100]})")
        return None
    ref = (a.float() * sa) @ (b.float() * sb).t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:  # not this library's kernel: report it and leave the arm out rather than stop
        print(f"{name}: relative error {err:.3e} against its decode; left out")
        return None
    return bench(lambda: rowwise_mm(a, sa, b, sb))


def dense_rows(m: int, k: int, n: int, g: torch.Generator) -> list[tuple]:
    dev = DEVICE
    x = torch.randn(m, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).bfloat16()
    dy = torch.randn(m, n, device=dev, generator=g).bfloat16()
    # fp8_block operands, as the layer would hold them: activations 1x128, weight 128x128 (one grid, both copies)
    xa = bq.quantize_1x128(x)
    dya = bq.quantize_1x128(dy)
    wq, ws = bq.quantize_128x128(w)
    wt = (wq.t().contiguous(), ws.t().contiguous())
    dy_t, x_t = bq.quantize_1x128_colwise(dy), bq.quantize_1x128_colwise(x)
    gemms = {
        "forward": (lambda: x @ w.t(), (*xa, wq, ws)),
        "dgrad": (lambda: dy @ w, (*dya, *wt)),
        "wgrad": (lambda: dy.t() @ x, (*dy_t, *x_t)),
    }
    # rowwise FP8 operands: each operand's rows along the reduction dim
    rw = {
        "forward": (*rowwise(x), *rowwise(w)),
        "dgrad": (*rowwise(dy), *rowwise(w.t().contiguous())),
        "wgrad": (*rowwise(dy.t().contiguous()), *rowwise(x.t().contiguous())),
    }
    rows = []
    for name, (bf16_fn, ops) in gemms.items():
        out = block_gemm.scaled_mm(*ops)
        err = check(f"dense {k}->{n} {name} fp8_block", out, block_gemm.reference_mm(*ops, torch.float32))
        t_row = rowwise_arm(f"dense {k}->{n} {name} rowwise", *rw[name])
        t_bf16 = bench(bf16_fn)
        t_block = bench(lambda: block_gemm.scaled_mm(*ops))
        flops = 2 * m * k * n
        rows.append((f"{m}x{k}->{n}", name, t_bf16, t_block, t_row, flops, err))
    return rows


def group_sizes(total: int, groups: int, equal: bool, g: torch.Generator) -> list[int]:
    if equal:
        return [total // groups] * groups
    # skewed routing: a few hot experts, some empty ones, sizes not multiples of 16
    w = torch.rand(groups, generator=g) ** 3
    w[torch.randperm(groups, generator=g)[: groups // 8]] = 0.0
    sizes = (w / w.sum() * total).floor().long()
    sizes[int(w.argmax())] += total - int(sizes.sum())
    return sizes.tolist()


MODELS = {  # name: (d, h, experts, top-k), the routed experts of each model's MoE layers
    "olmoe": (2048, 1024, 64, 8),
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "deepseek": (7168, 2048, 256, 8),
}


WGRAD_CHECK_ELEMENTS = 2**30
"""Largest ``experts x N x K`` whose wgrad is checked against the reference for every expert."""
WGRAD_CHECK_GROUPS = 8
"""Experts checked where the gradient is larger than :data:`WGRAD_CHECK_ELEMENTS`."""
WGRAD_INTO_ELEMENTS = 2**32
"""Largest ``experts x N x K`` gradient of the wgrad-into table (16 GiB in FP32); larger models keep fewer experts at
the same rows per expert."""


def wgrad_into_shape(s: int, e: int, n: int, k: int) -> tuple[int, int]:
    """``(routed rows, experts)`` of a wgrad-into case of ``e`` experts of ``n x k`` over ``s`` rows: the same, or
    fewer experts at the same rows per expert where the gradient would pass :data:`WGRAD_INTO_ELEMENTS` (the
    gradient, its copy and the widened GEMM result must fit beside each other: DeepSeek-V3)."""
    if e * n * k <= WGRAD_INTO_ELEMENTS:
        return s, e
    kept = WGRAD_INTO_ELEMENTS // (n * k)
    return s * kept // e, kept


def grouped_rows(model: str, s: int, e: int, k: int, n: int, equal: bool, g: torch.Generator) -> list[tuple]:
    dev = DEVICE
    sizes = group_sizes(s, e, equal, torch.Generator().manual_seed(7))
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(s, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(e, n, k, device=dev, generator=g) * 0.02).bfloat16()
    dy = torch.randn(s, n, device=dev, generator=g).bfloat16()
    xa, dya = bq.quantize_1x128(x), bq.quantize_1x128(dy)
    wq, ws = bq.quantize_128x128(w)
    wt = (wq.transpose(1, 2).contiguous(), ws.transpose(1, 2).contiguous())  # the dgrad copy: same scales
    cases = {
        "forward": (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), (*xa, wq, ws)),
        "dgrad": (lambda: torch._grouped_mm(dy, w, offs=offs), (*dya, *wt)),
        # dW[e] = dY_e^T X_e: both operands in 1x128 tiles along each group's tokens
        "wgrad": (
            lambda: torch._grouped_mm(dy.t(), x, offs=offs),
            (*bq.quantize_1x128_grouped_tokens(dy, offs), *bq.quantize_1x128_grouped_tokens(x, offs)),
        ),
    }
    groups = f"equal {s // e}" if equal else f"skewed {min(sizes)}-{max(sizes)}"
    label = f"{model} {k}->{n}"
    rows = []
    for name, (bf16_fn, ops) in cases.items():
        if name == "wgrad":
            block_fn = lambda: block_gemm.grouped_wgrad(*ops, offs, torch.bfloat16)  # noqa: E731 (bf16 out, as BF16's)
            # the float32 reference of every expert's gradient would not fit beside the rest (DeepSeek-V3: 28 GiB):
            # checked on the first WGRAD_CHECK_GROUPS experts there (a prefix of offs keeps their tile slots)
            c = e if e * n * k <= WGRAD_CHECK_ELEMENTS else WGRAD_CHECK_GROUPS
            ref = block_gemm.reference_grouped_wgrad(*ops, offs[:c], torch.float32)
            err = check(f"grouped {label} {groups} {name} fp8_block", block_fn()[:c], ref)
        else:
            block_fn = lambda: block_gemm.grouped_mm(*ops, offs)  # noqa: E731
            ref = block_gemm.reference_grouped_mm(*ops, offs, torch.float32)
            err = check(f"grouped {label} {groups} {name} fp8_block", block_fn(), ref)
        t_row = _rowwise_grouped(name, x, w, dy, offs, label) if name != "wgrad" else None
        t_bf16 = bench(bf16_fn)
        t_block = bench(block_fn)
        t_sm90 = t_triton = None
        if name != "wgrad" and sm90_kernel() is not None and sm90_kernel().supported(ops[0], ops[2], torch.bfloat16):
            sm90_fn = lambda: sm90_kernel().grouped_mm(*ops, offs)  # noqa: E731
            check(f"grouped {label} {groups} {name} fp8_block sm90", sm90_fn(), ref)
            t_sm90 = bench(sm90_fn)
            triton_fn = lambda: grouped_gemm_triton.grouped_mm(*ops, offs)  # noqa: E731
            check(f"grouped {label} {groups} {name} fp8_block Triton", triton_fn(), ref)
            t_triton = bench(triton_fn)
        flops = 2 * s * k * n
        rows.append((f"{label}, {groups} rows/expert", name, t_bf16, t_block, t_row, flops, err, t_sm90, t_triton))
        del ref
    return rows


def wgrad_into_rows(model: str, s: int, e: int, k: int, n: int, g: torch.Generator) -> tuple:
    """The routed wgrad into an FP32 gradient at one microbatch after the first (accumulate on), equal groups:
    today's three trips (BF16 grouped GEMM, its widening, autograd's add) against the GEMM whose epilogue adds into
    the gradient (``mxfx.kernels.common.grouped_wgrad_triton``), each checked against an FP32 product on 4 groups."""
    from mxfx.kernels.common import grouped_wgrad_triton
    from mxfx.kernels.common.custom_ops import _wgrad_sm90

    sm90 = _wgrad_sm90()
    s, e = wgrad_into_shape(s, e, n, k)
    sizes = group_sizes(s, e, True, g)
    offs = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    dy = torch.randn(s, n, device=DEVICE, generator=g).bfloat16()
    x = torch.randn(s, k, device=DEVICE, generator=g).bfloat16()
    grad = torch.randn(e, n, k, device=DEVICE, generator=g)
    first = grad.clone()

    def three_trips():
        grad.add_(torch._grouped_mm(dy.t(), x, offs=offs).float())

    def fused():
        grouped_wgrad_triton.grouped_wgrad_into(dy, x, offs, grad, True)

    def pingpong():
        sm90.grouped_wgrad_into(dy, x, offs, grad, True)

    arms = (three_trips, fused) + ((pingpong,) if sm90 is not None and sm90.supported(dy, x, grad) else ())
    errs = []
    for fn in arms:
        grad.copy_(first)
        fn()
        start = 0
        for gi, end in enumerate(offs.tolist()[:4]):
            ref = first[gi] + dy[start:end].float().t() @ x[start:end].float()
            errs.append(((grad[gi] - ref).norm() / ref.norm()).item())
            start = end
    if not max(errs) < 1e-2:
        raise SystemExit(f"bench/gemm.py: wgrad into FP32 {model}: relative error {max(errs):.3e}")
    return (
        f"{model} {k}->{n}, {e} experts of {s // e} rows",
        bench(lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
        bench(three_trips),
        bench(fused),
        bench(pingpong) if pingpong in arms else None,
        2 * s * k * n,
        max(errs),
    )


def wgrad_table(rows) -> str:
    lines = [
        "### Routed wgrad into the FP32 gradient (accumulate on; equal groups)",
        "",
        "| shape | BF16 GEMM alone ms | BF16 + widen + add ms | Triton epilogue ms | sm90 ping-pong ms "
        "| best vs three trips | best TFLOP/s | rel. err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, t_gemm, t_three, t_fused, t_pp, flops, err in rows:
        fused = [t for t in (t_fused, t_pp) if t is not None]
        if None in (t_gemm, t_three) or not fused:
            lines.append(f"| {shape} | n/a | n/a | n/a | n/a | n/a | n/a | {err:.1e} |")
            continue
        pp = f"{t_pp:.3f}" if t_pp is not None else "n/a"
        tf = f"{t_fused:.3f}" if t_fused is not None else "n/a"
        lines.append(
            f"| {shape} | {t_gemm:.3f} | {t_three:.3f} | {tf} | {pp} | {t_three / min(fused):.2f}x "
            f"| {flops / min(fused) / 1e9:.0f} | {err:.1e} |"
        )
    return "\n".join(lines)


def _rowwise_grouped(name, x, w, dy, offs, label):
    """``torch._scaled_grouped_mm`` time with rowwise scales, or None where it refuses the case."""
    if name == "forward":
        a, b3 = x, w  # A [S, K], B [E, N, K]: per-row scales along K
    else:
        a, b3 = dy, w.transpose(1, 2).contiguous()
    aq, sa = rowwise(a)
    e, n, k = b3.shape
    bq_, sb = rowwise(b3.reshape(e * n, k))
    bq_, sb = bq_.view(e, n, k), sb.view(e, n)
    fn = lambda: torch._scaled_grouped_mm(aq, bq_.transpose(1, 2), sa.view(-1), sb, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        out = fn()
    except (RuntimeError, NotImplementedError) as err:
        print(f"rowwise grouped {label} {name}: refused ({str(err).splitlines()[0][:100]})")
        return None
    few = min(e, 8)  # checked on the first experts' rows: a DeepSeek-V3 stack decoded at once takes 28 GiB
    rows = int(offs[few - 1])
    ref = torch._grouped_mm(
        (aq[:rows].float() * sa[:rows]).bfloat16(),
        (bq_[:few].float() * sb[:few, :, None]).bfloat16().transpose(1, 2),
        offs=offs[:few],
    )
    err = ((out[:rows].float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 1e-2:  # not this library's kernel: report it and leave the arm out rather than stop
        print(f"rowwise grouped {label} {name}: relative error {err:.3e} against its decode; left out")
        return None
    return bench(fn)


def table(title: str, rows: list[tuple]) -> str:
    grouped = any(len(r) > 7 for r in rows)
    extra = " | sm90 WS TFLOP/s | Triton TFLOP/s" if grouped else ""
    lines = [
        f"### {title}",
        "",
        "| shape | GEMM | bf16 ms | fp8_block ms | rowwise ms | fp8_block vs bf16 | rowwise vs bf16 "
        f"| bf16 TFLOP/s | fp8_block TFLOP/s | rowwise TFLOP/s | fp8_block rel. err{extra} |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if grouped else ""),
    ]

    def ms(t):
        return f"{t:.3f}" if t is not None else "n/a"

    def ratio(base, t):
        return f"{base / t:.2f}x" if base is not None and t is not None else "n/a"

    def tflops(flops, t):
        return f"{flops / t / 1e9:.0f}" if t is not None else "n/a"

    for shape, name, tb, tk, tr, flops, err, *tt in rows:
        last = f" {tflops(flops, tt[0])} | {tflops(flops, tt[1])} |" if grouped else ""
        lines.append(
            f"| {shape} | {name} | {ms(tb)} | {ms(tk)} | {ms(tr)} | {ratio(tb, tk)} | {ratio(tb, tr)} "
            f"| {tflops(flops, tb)} | {tflops(flops, tk)} | {tflops(flops, tr)} | {err:.1e} |{last}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)} (grouped shapes)")
    p.add_argument(
        "--tables",
        default="dense,grouped,wgrad-into",
        help="comma list of the tables to time: dense, grouped, wgrad-into (CUDA only)",
    )
    args = p.parse_args()
    tables = set(args.tables.split(","))
    if not tables <= {"dense", "grouped", "wgrad-into"}:
        p.error(f"--tables: unknown {sorted(tables - {'dense', 'grouped', 'wgrad-into'})}")
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gemm.py needs a CUDA GPU (sm90+); --device cpu --quick runs the reference paths")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=DEVICE).manual_seed(0)
    toy = DEVICE == "cpu"
    m = 128 if toy else 2048 if args.quick else 16384
    dense_shapes = ((128, 256),) if toy else ((4096, 4096), (4096, 14336))
    dense = []
    for k, n in dense_shapes if "dense" in tables else ():
        dense += dense_rows(m, k, n, g)
    tokens = 256 if toy else 4096 if args.quick else 16384
    grouped = []
    for model in args.models.split(",") if "grouped" in tables else ():
        d, h, experts, topk = (256, 128, 4, 2) if toy else MODELS[model]
        for k, n in ((d, 2 * h), (h, d)):  # gate/up, down
            for equal in (True, False):
                grouped += grouped_rows(model, tokens * topk, experts, k, n, equal, g)
                torch.cuda.empty_cache() if DEVICE == "cuda" else None
    if grouped:
        print(table("Grouped GEMMs", grouped), flush=True)  # kept if the wgrad-into table fails
    wgrad_into = []
    if DEVICE == "cuda" and "wgrad-into" in tables:
        for model in args.models.split(","):
            d, h, experts, topk = MODELS[model]
            for k, n in ((d, 2 * h), (h, d)):
                wgrad_into.append(wgrad_into_rows(model, tokens * topk, experts, k, n, g))
                torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    out = "\n\n".join(
        [
            f"bench/gemm.py on {dev}, torch {torch.__version__}" + (" (--quick)" if args.quick else ""),
            *([table("Dense GEMMs (operands pre-quantized)", dense)] if dense else []),
            *(
                [
                    table(
                        f"Grouped GEMMs ({tokens} tokens routed top-k; fp8_block = the kernel mxfx runs by default, "
                        f"sm90 WS = the warp-specialized sm90 kernel, Triton = the Triton kernel, rowwise = "
                        f"torch._scaled_grouped_mm)",
                        grouped,
                    )
                ]
                if grouped
                else []
            ),
            *([wgrad_table(wgrad_into)] if wgrad_into else []),
        ]
    )
    emit("gemm.md", out)


if __name__ == "__main__":
    main()
