"""One OLMoE-like routed MoE layer, forward+backward: BF16 (inductor) vs mxfx vs torchao (FP8 rowwise, MXFP8 emulated).

Shape (default): 8192 tokens, d=2048, 64 experts top-8, expert hidden 1024 -> 65536 routed rows.
All arms run in one process on the same inputs, weights and routing. Reports median time
(triton.testing.do_bench when CUDA is present), peak memory, activation memory
(peak minus memory held before the forward), and the bytes the autograd graph saved for backward
(storages held by the graph after the forward, less the inputs, parameters and weight caches: on any
device, so a CPU run shows it too). Weights are BF16 parameters in every arm;
mxfx's weight caches are rebuilt once per optimizer step, so in this loop (no optimizer
step) its weight quantization is amortized away, as it is across microbatches in training.

    python bench/moe_layer.py                # H200
    python bench/moe_layer.py --arms bf16,mxfx,mxfxopaque   # also mxfx with its MX ops kept as custom ops
    python bench/moe_layer.py --arms bf16,mxfx,mxfxdq       # also mxfx with keep_dequantized_weights
    python bench/moe_layer.py --arms bf16,fp8block,torchao8 # fp8_block against BF16 and torchao FP8 rowwise
    python bench/moe_layer.py --arms bf16,fp8block --peak-sites 12 # also what is live at each arm's peak
    python bench/moe_layer.py --device cpu --tokens 256 --d 128 --experts 8 --hidden 64 --topk 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
import peak_memory  # noqa: E402  (bench/ is on sys.path when a script runs)
from _results import emit  # noqa: E402

from mxfx.runtime import cache
from mxfx.report import saved_for_backward


def routed_layer(grouped_mm):
    """The routed-expert block written as HF transformers writes it, with a pluggable grouped GEMM."""

    def layer(x, router_w, w_gate_up, w_down, topk):
        probs = F.linear(x, router_w).float().softmax(-1)
        weights, experts = probs.topk(topk, dim=-1)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        offs = (
            torch.histc(flat.float(), bins=w_down.shape[0], min=-0.5, max=w_down.shape[0] - 0.5)
            .cumsum(0)
            .to(torch.int32)
        )
        xs = x[order // topk]
        g, u = grouped_mm(xs, w_gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
        y = grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs)
        y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
        return torch.zeros_like(x).index_add(0, order // topk, y)

    return layer


def torchao_grouped_mm():
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    def mm(a, b_t, offs):
        return _to_mxfp8_then_scaled_grouped_mm(
            a,
            b_t,
            offs,
            kernel_preference=KernelPreference.EMULATED,
            wgrad_with_hp=True,
            pad_token_groups_for_grouped_mm=True,
        )

    return mm


def padded_groups(grouped_mm, align: int = 16):
    """``grouped_mm(a, b, offs)`` run on groups padded with zero rows to multiples of ``align`` rows.

    ``a [S, K]`` rows sorted by group, ``offs`` int32 ``[G]`` cumulative group ends. The rows go to a zero buffer of
    ``S + align * G`` rows (a static bound, so no host sync) at their padded group's place; the result's rows come
    back in ``a``'s order. Zero rows add nothing to any group's product or weight gradient, so this is exact.
    """

    def mm(a, b, offs):
        S, G = a.shape[0], offs.shape[0]
        ends = offs.long()
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        padded_ends = ((sizes + align - 1) // align * align).cumsum(0)
        group = torch.searchsorted(ends, torch.arange(S, device=a.device), right=True).clamp_(max=G - 1)
        dest = (
            torch.arange(S, device=a.device)
            - (ends - sizes)[group]
            + (padded_ends - sizes.add(align - 1) // align * align)[group]
        )
        buf = a.new_zeros(S + align * G, a.shape[1]).index_copy(0, dest, a)
        return grouped_mm(buf, b, padded_ends.to(torch.int32))[dest]

    return mm


def torchao_fp8_rowwise_grouped_mm():
    """torchao's FP8 rowwise grouped GEMM (cuBLAS ``torch._scaled_grouped_mm``), the Hopper peer of fp8_block.

    cuBLAS's FP8 grouped GEMM asks for groups of a multiple of 16 rows, and torchao 0.18 refuses its own padding
    option on this path, so the groups are padded here (:func:`padded_groups`, counted in this arm's time), as
    trainers that use it do.
    """
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    def mm(a, b_t, offs):
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, pad_token_groups_for_grouped_mm=False)

    return padded_groups(mm)


def saved_bytes(out: torch.Tensor, held: list[torch.Tensor]) -> int:
    """Bytes of the storages the autograd graph behind ``out`` saved for backward, less those of ``held`` (inputs,
    parameters) and of their weight caches (:func:`mxfx.runtime.cache.entry_forms`)."""
    skip = {t.untyped_storage().data_ptr() for t in held}
    skip |= {f.untyped_storage().data_ptr() for t in held for pair in cache.entry_forms(t).values() for f in pair}
    return sum(
        t.untyped_storage().nbytes() for t in saved_for_backward(out) if t.untyped_storage().data_ptr() not in skip
    )


def measure(fn, args, device, profile_path=None, peak_sites=0):
    """Median ms of forward+backward, peak, activation and saved-for-backward bytes, and what is live at the
    peak by allocation site (``peak_sites`` > 0 on CUDA: one more call with the allocator's history, its
    :func:`peak_memory.peak_table`; else ""); with ``profile_path``, every device op of one more call written
    there."""

    def step():
        out = fn(*args)
        out.float().square().mean().backward()

    step()  # compile
    out = fn(*args)
    saved = saved_bytes(out, [a for a in args if isinstance(a, torch.Tensor)])
    out.float().square().mean().backward()
    del out
    if device == "cuda":
        import triton.testing

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        ms = triton.testing.do_bench(step, warmup=5, rep=40)
        if profile_path:
            from train_step import profile_step

            print(profile_step(step, path=profile_path), flush=True)
        sites = ""
        if peak_sites:
            recorded, _ = peak_memory.record_peak(step)
            sites = peak_memory.peak_table(recorded, top=peak_sites)
        return ms, peak, peak - base, saved, sites
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    return (time.perf_counter() - t0) / 3 * 1e3, float("nan"), float("nan"), saved, ""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--arms", default="bf16,mxfx,fp8block,torchao,torchao8")
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated arms to profile for one more call (CUDA); "
        "every device op goes to $MXFX_BENCH_OUT/profile_layer_<arm>.txt",
    )
    p.add_argument(
        "--peak-sites",
        type=int,
        default=0,
        help="CUDA: after each arm's table row, the N allocation sites with the most bytes live at its peak "
        "(one more call with the allocator's history; bench/peak_memory.py)",
    )
    a = p.parse_args()
    if a.peak_sites < 0:
        p.error(f"argument --peak-sites: {a.peak_sites} must be >= 0 (0: off)")
    torch.manual_seed(0)
    dev, bf16 = a.device, torch.bfloat16
    x = torch.randn(a.tokens, a.d, device=dev, dtype=bf16, requires_grad=True)
    params = [
        (torch.randn(a.experts, a.d, device=dev) * a.d**-0.5).to(bf16).requires_grad_(),
        (torch.randn(a.experts, 2 * a.hidden, a.d, device=dev) * a.d**-0.5).to(bf16).requires_grad_(),
        (torch.randn(a.experts, a.d, a.hidden, device=dev) * a.hidden**-0.5).to(bf16).requires_grad_(),
    ]
    args = (x, *params, a.topk)
    arms = {
        "bf16 (inductor)": lambda: torch.compile(routed_layer(lambda m, b, o: torch._grouped_mm(m, b, offs=o))),
        "mxfx (backend=mxfp8)": lambda: torch.compile(
            routed_layer(lambda m, b, o: torch._grouped_mm(m, b, offs=o)), backend="mxfp8"
        ),
        "mxfx, keep_dequantized_weights": lambda: torch.compile(
            routed_layer(lambda m, b, o: torch._grouped_mm(m, b, offs=o)),
            backend="mxfp8",
            options={"keep_dequantized_weights": True},
        ),
        "mxfx fp8_block (format=fp8_block)": lambda: torch.compile(
            routed_layer(lambda m, b, o: torch._grouped_mm(m, b, offs=o)),
            backend="mxfp8",
            options={"format": "fp8_block"},
        ),
        "torchao MXFP8 emulated (compile)": lambda: torch.compile(routed_layer(torchao_grouped_mm())),
        "torchao FP8 rowwise (compile)": lambda: torch.compile(routed_layer(torchao_fp8_rowwise_grouped_mm())),
    }
    arms["mxfx, MX ops as opaque custom ops"] = arms["mxfx (backend=mxfp8)"]
    keep = {
        "bf16": "bf16 (inductor)",
        "mxfx": "mxfx (backend=mxfp8)",
        "torchao": "torchao MXFP8 emulated (compile)",
        "mxfxopaque": "mxfx, MX ops as opaque custom ops",
        "mxfxdq": "mxfx, keep_dequantized_weights",
        "fp8block": "mxfx fp8_block (format=fp8_block)",
        "torchao8": "torchao FP8 rowwise (compile)",
    }
    rows, details, base_ms = [], [], None
    for key in a.arms.split(","):
        name = keep[key]
        torch._dynamo.reset()
        cache.clear()  # an earlier arm's weight caches on these same weights would count in this arm's peak
        if key == "mxfxopaque":  # read when the graph is traced (mxfx.kernels.common.launch)
            os.environ["MXFX_OPAQUE_KERNELS"] = "1"
        try:
            path = None
            if key in a.profile.split(","):
                path = os.path.join(os.environ.get("MXFX_BENCH_OUT", "."), f"profile_layer_{key}.txt")
            ms, peak, act, saved, sites = measure(arms[name](), args, dev, path, a.peak_sites)
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            rows.append(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
            continue
        finally:
            os.environ.pop("MXFX_OPAQUE_KERNELS", None)
        base_ms = base_ms or ms
        if sites:
            details.append(f"Live at the peak, {name}: {sites}")
        rows.append(
            f"| {name} | {ms:.3f} | {base_ms / ms:.2f}x | {peak / 2**30:.2f} | {act / 2**30:.2f} "
            f"| {saved / 2**30:.3f} |"
        )
        for t in (x, *params):
            t.grad = None
    head = (
        f"MoE layer fwd+bwd: {a.tokens} tokens, d={a.d}, {a.experts} experts top-{a.topk}, hidden {a.hidden}, "
        f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    table = "\n".join(
        [
            head,
            "",
            "| arm | ms | speed vs bf16 | peak GiB | activation GiB | saved for backward GiB |",
            "|---|---|---|---|---|---|",
            *rows,
            *("\n" + d for d in details),
        ]
    )
    emit("moe_layer.md", table)


if __name__ == "__main__":
    main()
