"""Probe: rows per program x warps of fp8_block's one-read routed dY kernel, against a stream of the same bytes.

``route_grad_operands_1x128`` writes dY's FP8 rows, its BF16 copy and the route weights' gradient from ``dout`` and
the unweighted output ``y``.

Times rows per program x warps at the routed dY of OLMoE and Qwen3 layers (8,192 tokens top-8, d 2,048), in the
two forms the step runs: ``dout`` as FP32 rows ``[S, D]``, and (the default in a compiled HF model, the combine's
backward) the FP32 token gradient ``[T, D]`` with each row's token index (``rows_of``), read where needed. Beside
them a stream that moves the bytes the kernel asks for (an FP32 and a BF16 read, a BF16 and a byte write:
``torch.mul`` of an FP32 and a BF16 tensor into BF16, plus a byte copy). Each launch's FP8 rows, scales and BF16
copy are checked equal to the default launch's, its route gradient within 1e-5 (an FP32 sum in another order).
Prints one table: GB/s and % of the stream. Needs a CUDA GPU.

    python bench/probes/route_grad_configs.py [--rows 16,32,64,128] [--warps 2,4,8]
"""

from __future__ import annotations

import argparse

import torch

try:
    import triton
except ImportError:  # a CPU install without the [gpu] or [test] extra
    raise SystemExit("route_grad_configs: needs Triton and a CUDA GPU (pip install -e '.[gpu]')") from None

from mxfx.kernels.fp8_block import quantize

SHAPES = {"olmoe / qwen3 routed dY": (65536, 2048, 8)}
"""name: (routed rows S, d, top-k): T = S / top-k tokens."""


def _ints(text: str, most: int, powers_of_two: bool) -> list[int]:
    """A comma list of integers in ``[1, most]`` (powers of two where asked), for argparse."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of integers") from None
    bad = [v for v in values if not 1 <= v <= most or (powers_of_two and v & (v - 1))]
    if not values or bad:
        kind = "powers of two" if powers_of_two else "integers"
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {kind} from 1 to {most}")
    return values


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (FP8 compared as bytes)."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        type=lambda t: _ints(t, 1024, True),
        default=[16, 32, 64, 128],
        help="rows per program, a comma list of powers of two up to 1024 (default: 16,32,64,128)",
    )
    p.add_argument(
        "--warps",
        type=lambda t: _ints(t, 16, False),
        default=[2, 4, 8],
        help="warps per program, a comma list from 1 to 16 (default: 2,4,8)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("route_grad_configs: needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | launch | ms | GB/s | % of stream |")
    print("|---|---|---:|---:|---:|")
    for name, (m, k, top_k) in SHAPES.items():
        g = torch.randn(m // top_k, k, device="cuda", dtype=torch.float32)
        rows_of = (torch.randperm(m, device="cuda") // top_k).to(torch.int32)
        y = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(m, device="cuda", dtype=torch.float32)
        moved = m * k * (4 + 2 + 2 + 1)  # dout (FP32), y in; dy (BF16) and qdata out (scales, parts: < 1%)
        prod = torch.empty_like(y)
        rows_fp32 = g[rows_of.long()]
        byte_src = torch.empty(m, k, dtype=torch.uint8, device="cuda")
        byte_dst = torch.empty_like(byte_src)

        def stream():
            torch.mul(rows_fp32, y, out=prod)
            byte_dst.copy_(byte_src)

        t_stream = triton.testing.do_bench(stream, return_mode="median")
        print(f"| {name} | stream (mul + byte copy) | {t_stream:.3f} | {moved / t_stream / 1e6:.0f} | 100.0 |")
        forms = {"FP32 rows": (rows_fp32, None), "FP32 tokens gathered": (g, rows_of)}
        for form, (dout, index) in forms.items():
            ref = quantize.route_grad_operands_1x128(dout, w, y, rows_of=index)
            for rows in args.rows:
                for warps in args.warps:
                    label = f"{form}: {rows} rows, {warps} warps"

                    def launch(dout=dout, index=index, rows=rows, warps=warps):
                        return quantize.route_grad_operands_1x128(dout, w, y, rows_of=index, rows=rows, warps=warps)

                    try:
                        out = launch()
                        if not all(_same(a, b) for a, b in zip(out[:3], ref[:3])):
                            raise RuntimeError("FP8 rows, scales or BF16 copy differ from the default launch")
                        err = ((out[3] - ref[3]).norm() / ref[3].norm()).item()
                        if not err < 1e-5:
                            raise RuntimeError(f"route gradient relative error {err:.2e}")
                        t = triton.testing.do_bench(launch, return_mode="median")
                    except Exception as exc:  # noqa: BLE001 (a launch the GPU refuses is reported, not fatal)
                        print(f"| {name} | {label} | {type(exc).__name__}: {str(exc)[:80]} | | |")
                        continue
                    print(f"| {name} | {label} | {t:.3f} | {moved / t / 1e6:.0f} | {100 * t_stream / t:.1f} |")


if __name__ == "__main__":
    main()
