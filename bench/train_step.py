"""End-to-end training step of the main job's MoE: BF16 (Inductor) vs backend="mxfp8" vs torchao MXFP8 (emulated).

Model: ``examples/moe_model.py`` at GPU scale (defaults: 4 layers, d_model 2048,
64 routed experts top-8 + one shared expert, expert hidden 1024, sequence 2048),
FP32 parameters, BF16 autocast, AdamW. Arms, all in one process, same initial
weights (one seed) and same batches:

  (a) ``bf16``:    ``torch.compile(model)`` (Inductor);
  (b) ``mxfp8``:   ``torch.compile(model, backend="mxfp8")``;
  (b') ``mxfp8dq``: the same with ``keep_dequantized_weights=True`` (the Hopper switch:
      BF16 copies of the cached MX weights kept beside the caches; more memory, no
      weight dequantize per GEMM). Not in the default ``--arms``;
  (b'') ``mxfp8opaque``: (b) with ``MXFX_OPAQUE_KERNELS=1``: the MX ops stay opaque
      custom ops in the graph instead of Triton kernels launched by Inductor
      (``mxfx.kernels.common.launch``); shows what the host cost of custom ops was. Not in the
      default ``--arms``;
  (b''') ``fp8block``: (b) with ``format="fp8_block"`` (1x128/128x128 FP8 blocks, the Hopper-native
      format: cuBLAS blockwise and Triton grouped FP8 GEMMs). Not in the default ``--arms``;
  (c) ``torchao``: torchao 0.18's MXFP8 training functions in emulated mode
      (``KernelPreference.EMULATED``; its CUTLASS/CuTeDSL kernels are sm100-only)
      under ``torch.compile``: routed experts through
      ``_to_mxfp8_then_scaled_grouped_mm`` (BF16 wgrad, token groups padded),
      dense linears (attention, shared expert) through ``_to_mxfp8_then_scaled_mm``.
      torchao's parameter conversion (``quantize_(model, MXFP8TrainingOpConfig)``)
      does not apply to this model: the printout says why (FP32 parameters cast
      with ``.to(bfloat16)`` in the model).

Phase 1, at ``--batch``: tokens/s over ``--steps`` timed steps (after
``--warmup`` steps that include compilation), peak memory, saved activation
memory = memory allocated when forward returns minus memory held just before
it (parameters, AdamW states, weight caches): what forward keeps for backward,
the figure the 0.7x goal judges; and the forward+backward peak above held
memory, which also counts the step's FP32 gradients (equal in every arm,
printed as "grads GiB").
Phase 2: the largest micro-batch each arm fits in ``--budget-gib`` (the
allocator is capped there; first guess from phase 1's activation per sample,
stepped down on OOM and up while memory is left) and its tokens/s. Each new batch size recompiles (static
shapes). The cap limits reserved, not allocated memory, so fragmentation decides the last sequences: the script
runs every arm with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the variable is set already. Then the
goals: (b) >= 0.9x (a) and >= 1.8x (c) tokens/s, (b)'s saved activation memory <= 0.7x (a)'s, and at the max batch
(b) >= 1.05x (a).

    python bench/train_step.py                                # H200, ~4 min
    python bench/train_step.py --phases 1 --arms bf16,mxfp8   # quicker
    python bench/train_step.py --device cpu --quick           # toy size, smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts: every arm alike

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
from moe_model import MoE, MoEConfig, MoETransformer  # noqa: E402

GIB = 2**30


# ----------------------------------------------------------------------------- torchao arm
TORCHAO_CONVERSION_NOTE = (
    "torchao quantize_(model, MXFP8TrainingOpConfig(kernel_preference=EMULATED)) does not apply to this model "
    "(checked on torchao 0.18 / torch 2.13 CPU): the model casts its FP32 expert weights with .to(bfloat16) before "
    "torch._grouped_mm, which under torch.compile graph-breaks on the weight wrapper subclass and then fails in "
    "backward ('Expected a MXFP8TrainingWeightWrapperTensor tangent but got a plain Tensor'); its emulated linear "
    "fails under BF16 autocast with FP32 weights (mm of bf16 and float). Arm (c) therefore calls torchao's MXFP8 "
    "training functions directly at the same ops."
)


def torchao_routed_experts(moe: MoE, x, experts, weights):
    """``MoE.routed_experts`` with torchao's emulated MXFP8 grouped GEMM in place of ``torch._grouped_mm``."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    def gmm(a, b_t, offs):
        return _to_mxfp8_then_scaled_grouped_mm(
            a,
            b_t,
            offs,
            kernel_preference=KernelPreference.EMULATED,
            wgrad_with_hp=True,
            pad_token_groups_for_grouped_mm=True,
        )

    N, d = x.shape
    flat_experts = experts.reshape(-1)
    order = flat_experts.argsort(stable=True)
    token_of_slot = order // moe.top_k
    counts = torch.histc(flat_experts.float(), bins=moe.n_experts, min=-0.5, max=moe.n_experts - 0.5)
    offs = counts.cumsum(0).to(torch.int32).contiguous()
    x_sorted = x.to(torch.bfloat16)[token_of_slot].contiguous()
    g, u = gmm(x_sorted, moe.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs).chunk(2, dim=-1)
    y = gmm((F.silu(g) * u).contiguous(), moe.down_proj.to(torch.bfloat16).transpose(-2, -1), offs)
    y = y * weights.reshape(-1)[order].to(torch.bfloat16).contiguous()[:, None]
    return torch.zeros(N, d, dtype=y.dtype, device=y.device).index_add(0, token_of_slot, y)


def torchao_linear(lin: torch.nn.Linear):
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    def forward(x):
        x = x.to(torch.bfloat16)
        return _to_mxfp8_then_scaled_mm(
            x, lin.weight.to(torch.bfloat16), KernelPreference.EMULATED, ScaleCalculationMode.RCEIL
        )

    return forward


def apply_torchao(model: MoETransformer) -> int:
    """Route the model's MXFP8-eligible GEMMs through torchao (as the mxfp8 backend rewrites them); returns how many."""
    n = 0
    for blk in model.layers:
        moe = blk.moe
        moe.routed_experts = lambda x, e, w, moe=moe: torchao_routed_experts(moe, x, e, w)
        for lin in (blk.attn.qkv, blk.attn.o_proj, moe.shared_gate, moe.shared_up, moe.shared_down):
            lin.forward = torchao_linear(lin)
            n += 1
        n += 2
    return n


# ----------------------------------------------------------------------------- one arm
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def build(arm: str, mcfg: MoEConfig, a) -> tuple:
    """Model (same init in every arm), its compiled form and AdamW."""
    torch.manual_seed(a.seed)
    with torch.device(a.device):
        model = MoETransformer(mcfg)
    if arm == "torchao":
        apply_torchao(model)
    if arm in MX_ARMS:
        options = {"inner": a.inner} if a.inner != "inductor" else {}
        if arm == "mxfp8dq":
            options["keep_dequantized_weights"] = True
        if arm == "fp8block":
            options["format"] = "fp8_block"
        compiled = torch.compile(model, backend="mxfp8", options=options)
    else:
        compiled = torch.compile(model, backend=a.inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=a.device == "cuda")
    return model, compiled, opt


def batches(a, batch: int, n: int):
    gen = torch.Generator().manual_seed(a.data_seed)  # the same batches in every arm
    out = []
    for _ in range(n):
        tok = torch.randint(0, 256, (batch, a.seq + 1), generator=gen)
        out.append((tok[:, :-1].to(a.device), tok[:, 1:].to(a.device)))
    return out


MX_ARMS = ("mxfp8", "mxfp8dq", "mxfp8opaque", "fp8block")


def profile_step(step, *args, path: str | None = None) -> str:
    """One call ``step(*args)`` under torch.profiler: host (CPU) time, device kernel time, top device ops.

    With ``path``, every device op of the step (time, calls, name) is written there too.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(*args)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in ev)
    ranked = [e for e in sorted(ev, key=lambda e: -e.self_device_time_total) if e.self_device_time_total > 0]
    row = lambda e: f"  {e.self_device_time_total / 1e3:7.2f} ms  {e.count:5d}x  {e.key[:110]}"  # noqa: E731
    lines = [
        f"profile: host returns after {host * 1e3:.1f} ms, step wall {wall * 1e3:.1f} ms, "
        f"device busy {device_us / 1e3:.1f} ms (profiler overhead included)"
    ]
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines + [row(e) for e in ranked]) + "\n")
    return "\n".join(lines + [row(e) for e in ranked[:20]])


def run_arm(arm: str, mcfg: MoEConfig, a, batch: int) -> dict:
    """Warmup (compile) then timed steps at ``batch``; tokens/s, peak and activation memory."""
    dev = a.device
    torch._dynamo.reset()
    opaque_before = os.environ.pop("MXFX_OPAQUE_KERNELS", None)
    if arm == "mxfp8opaque":
        os.environ["MXFX_OPAQUE_KERNELS"] = "1"
    model, compiled, opt = build(arm, mcfg, a)
    data = batches(a, batch, a.warmup + a.steps)
    losses = []

    def step(x, y, measure=False):
        held = torch.cuda.memory_allocated() if dev == "cuda" else 0
        if measure and dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16):
            _, loss = compiled(x, y)
        saved = torch.cuda.memory_allocated() if dev == "cuda" else 0  # what forward left for backward
        loss.backward()
        fb_peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        return held, saved, fb_peak

    try:
        t0 = time.perf_counter()
        for x, y in data[: a.warmup]:
            step(x, y)
        sync(dev)
        warm_s = time.perf_counter() - t0
        held, saved, fb_peak = step(*data[a.warmup], measure=True)  # memory from one steady-state step
        if dev == "cuda":
            step_peak = torch.cuda.max_memory_allocated()
        sync(dev)
        t0 = time.perf_counter()
        for x, y in data[a.warmup + 1 :]:
            step(x, y)
        sync(dev)
        dt = time.perf_counter() - t0
        n_timed = len(data) - a.warmup - 1
        res = dict(
            arm=arm,
            batch=batch,
            tokens_per_s=batch * a.seq * n_timed / dt if n_timed else float("nan"),
            step_ms=dt / max(n_timed, 1) * 1e3,
            warmup_s=warm_s,
            held_gib=held / GIB if dev == "cuda" else float("nan"),
            peak_gib=step_peak / GIB if dev == "cuda" else float("nan"),
            act_gib=(fb_peak - held) / GIB if dev == "cuda" else float("nan"),
            saved_gib=(saved - held) / GIB if dev == "cuda" else float("nan"),
            grad_gib=sum(p.numel() * p.element_size() for p in model.parameters()) / GIB,
            losses=[float(v) for v in torch.stack(losses).tolist()],
        )
        if arm in a.profile.split(",") and dev == "cuda":
            res["profile"] = profile_step(step, *data[-1], path=os.path.join(a.out, f"profile_{arm}_b{batch}.txt"))
            print(f"{arm} {res['profile']}", flush=True)
        if arm in MX_ARMS:
            import mxfx

            res["rewritten"] = sum(pm.count(rewritten=True) for pm in mxfx.all_reports())
        return res
    finally:
        model = compiled = opt = data = None  # freed before the next arm
        os.environ.pop("MXFX_OPAQUE_KERNELS", None)
        if opaque_before is not None:
            os.environ["MXFX_OPAQUE_KERNELS"] = opaque_before
        if arm in MX_ARMS:
            from mxfx.runtime import cache

            cache.clear()
        free(dev)


def max_batch(arm: str, mcfg: MoEConfig, a, first: dict) -> dict:
    """Largest micro-batch within the memory budget.

    First guess from phase 1's memory per sample; stepped down by 15% on OOM, and up again
    while a run leaves more than 8% of the budget unused (the next size predicted from that
    run's own peak per sample). Every size tried costs a compile; at most ``--oom-tries`` runs.
    Returns the largest size that ran, with the sizes that ran out of memory ("tried") and the
    smaller sizes that fitted ("fitted").
    """
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib * GIB / total))
    grads = first["grad_gib"]  # FP32 gradients: part of the activation figure, but not per sample
    per_sample = max(first["act_gib"] - grads, first["saved_gib"], 1e-3) / first["batch"]
    b = max(1, min(int((a.budget_gib - first["held_gib"] - grads) / per_sample / 1.05), a.max_batch_cap))
    tried, best, fitted = [], None, []
    for _ in range(a.oom_tries):
        try:
            res = run_arm(arm, mcfg, a, b)
        except torch.OutOfMemoryError:
            tried.append(b)
            free(a.device)
            nxt = max(1, int(b * 0.85))
            if best is not None and nxt <= best["batch"]:
                nxt = best["batch"] + (b - best["batch"]) // 2
                if nxt <= best["batch"]:
                    break
            b = nxt
            continue
        if best is not None:
            fitted.append(best["batch"])
        best = res
        if res["peak_gib"] > 0.92 * a.budget_gib or b >= a.max_batch_cap:
            break
        per_sample = max(res["peak_gib"] - res["held_gib"] - grads, 1e-3) / b
        nxt = min(int((a.budget_gib * 0.97 - res["held_gib"] - grads) / per_sample), a.max_batch_cap)
        if tried:
            nxt = min(nxt, min(tried) - 1)
        if nxt <= b:
            break
        b = nxt
    if best is None:
        return dict(arm=arm, batch=None, tokens_per_s=float("nan"), tried=tried, fitted=fitted)
    best.update(tried=tried, fitted=fitted)
    return best


# ----------------------------------------------------------------------------- report
def goals(p1: dict, p2: dict) -> list[str]:
    lines = []

    def check(name, value, target, better="higher"):
        if value != value:  # nan
            lines.append(f"  {name}: not measured")
            return
        ok = value >= target if better == "higher" else value <= target
        gap = "" if ok else f"  (gap {value - target:+.2f})"
        lines.append(
            f"  {name}: {value:.2f} vs goal {'>=' if better == 'higher' else '<='} {target}  "
            f"{'MET' if ok else 'NOT MET'}{gap}"
        )

    a, c = p1.get("bf16"), p1.get("torchao")
    for arm in MX_ARMS:  # every MX arm that ran is held to the goals of (b)
        b, tag = p1.get(arm), f"{arm} (b)" if arm == "mxfp8" else arm
        if a and b:
            check(f"{tag}/(a) tokens/s", b["tokens_per_s"] / a["tokens_per_s"], 0.9)
            check(
                f"{tag}/(a) saved activation memory",
                b["saved_gib"] / a["saved_gib"] if a["saved_gib"] else float("nan"),
                0.7,
                "lower",
            )
            if a["act_gib"] == a["act_gib"]:
                lines.append(
                    f"  (info) forward+backward peak above held memory {tag}/(a): {b['act_gib'] / a['act_gib']:.2f}"
                )
            if a["act_gib"] == a["act_gib"] and a["act_gib"] > a["grad_gib"]:
                lines.append(
                    f"  (info) activation memory without the FP32 gradients: {tag}/(a) "
                    f"{(b['act_gib'] - b['grad_gib']) / (a['act_gib'] - a['grad_gib']):.2f}"
                )
        if b and c and "tokens_per_s" in c:
            check(f"{tag}/(c) tokens/s", b["tokens_per_s"] / c["tokens_per_s"], 1.8)
        if p2.get("bf16") and p2.get(arm):
            check(f"max batch {tag}/(a) tokens/s", p2[arm]["tokens_per_s"] / p2["bf16"]["tokens_per_s"], 1.05)
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="toy model and batch (CPU smoke run)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=1024)
    p.add_argument("--shared-hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="phase-1 micro-batch (sequences)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=int, default=4, help="steps after warmup: one for memory, the rest timed")
    p.add_argument("--arms", default="bf16,mxfp8,torchao")
    p.add_argument("--phases", default="1,2", help="1: fixed batch; 2: max batch in the budget (CUDA only)")
    p.add_argument("--budget-gib", type=float, default=60.0)
    p.add_argument("--max-batch-cap", type=int, default=64)
    p.add_argument("--oom-tries", type=int, default=4)
    p.add_argument("--profile", default="", help="comma-separated arms to profile for one extra step (CUDA)")
    p.add_argument("--inner", default="inductor", help="compiler for every arm (aot_eager for fast smoke runs)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("MXFX_BENCH_OUT", "runs/train_step"))
    a = p.parse_args()
    if a.quick:
        a.layers, a.d_model, a.head_dim, a.experts, a.topk = 1, 64, 32, 4, 2
        a.expert_hidden, a.shared_hidden, a.seq, a.batch, a.warmup, a.steps = 64, 64, 64, 2, 1, 2
    torch._dynamo.config.automatic_dynamic_shapes = False  # each micro-batch size: its own static graph
    torch._dynamo.config.cache_size_limit = 64
    mcfg = MoEConfig(
        vocab_size=256,
        d_model=a.d_model,
        n_layers=a.layers,
        head_dim=a.head_dim,
        n_experts=a.experts,
        top_k=a.topk,
        expert_hidden=a.expert_hidden,
        shared_hidden=a.shared_hidden,
        max_seq=a.seq,
    )
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    phases = {int(x) for x in a.phases.split(",")}
    dev_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"model: {mcfg}\ndevice: {dev_name}, torch {torch.__version__}, inner compiler {a.inner}")
    if "torchao" in arms:
        print("note (c): " + TORCHAO_CONVERSION_NOTE)
    t_start = time.perf_counter()

    p1, p2 = {}, {}
    if 1 in phases:
        for arm in arms:
            try:
                p1[arm] = run_arm(arm, mcfg, a, a.batch)
            except Exception as e:  # an arm that cannot run here is reported, not fatal
                p1[arm] = dict(arm=arm, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(
                f"phase 1 {arm}: {json.dumps({k: v for k, v in p1[arm].items() if k != 'losses'})} "
                f"({time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
    if 2 in phases:
        if a.device != "cuda":
            print("phase 2 (max batch in a memory budget) needs CUDA memory statistics: skipped")
        else:
            for arm in arms:
                if "act_gib" not in p1.get(arm, {}):
                    continue
                try:
                    p2[arm] = max_batch(arm, mcfg, a, p1[arm])
                except Exception as e:
                    p2[arm] = dict(arm=arm, error=f"{type(e).__name__}: {str(e)[:300]}")
                print(
                    f"phase 2 {arm}: {json.dumps({k: v for k, v in p2[arm].items() if k != 'losses'})} "
                    f"({time.perf_counter() - t_start:.0f} s)",
                    flush=True,
                )
            torch.cuda.set_per_process_memory_fraction(1.0)

    names = {
        "bf16": f"(a) bf16 {a.inner}",
        "mxfp8": "(b) backend=mxfp8",
        "mxfp8dq": "(b') mxfp8, keep_dequantized_weights",
        "mxfp8opaque": "(b'') mxfp8, MX ops as opaque custom ops",
        "torchao": "(c) torchao MXFP8 emulated",
    }
    lines = [
        f"MoE train step: {a.layers} layers, d {a.d_model}, {a.experts} experts top-{a.topk} + shared, "
        f"expert hidden {a.expert_hidden}, seq {a.seq}; {dev_name}; torch {torch.__version__}; "
        f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}",
        "",
        f"phase 1, micro-batch {a.batch} ({a.batch * a.seq} tokens):",
        "| arm | tokens/s | vs (a) | step ms | peak GiB | saved activations GiB | fwd+bwd peak above held GiB "
        "| grads GiB | held GiB | warmup s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = p1.get("bf16", {}).get("tokens_per_s")
    for arm, r in p1.items():
        if "error" in r:
            lines.append(f"| {names[arm]} | failed: {r['error']} |||||||||")
            continue
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {names[arm]} | {r['tokens_per_s']:.0f} | {rel} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | "
            f"{r['saved_gib']:.2f} | {r['act_gib']:.2f} | {r['grad_gib']:.2f} | {r['held_gib']:.2f} | "
            f"{r['warmup_s']:.0f} |"
        )
    if p2:
        lines += [
            "",
            f"phase 2, largest micro-batch within {a.budget_gib:g} GiB:",
            "| arm | micro-batch | tokens/s | vs (a) | peak GiB | OOM at |",
            "|---|---|---|---|---|---|",
        ]
        base2 = p2.get("bf16", {}).get("tokens_per_s")
        for arm, r in p2.items():
            if "error" in r or r.get("batch") is None:
                lines.append(
                    f"| {names[arm]} | failed: {r.get('error', 'OOM at every try')} | | | | {r.get('tried')} |"
                )
                continue
            rel = f"{r['tokens_per_s'] / base2:.2f}x" if base2 else "-"
            lines.append(
                f"| {names[arm]} | {r['batch']} | {r['tokens_per_s']:.0f} | {rel} | {r['peak_gib']:.2f} | "
                f"{r['tried'] or '-'} |"
            )
    ok1 = {k: v for k, v in p1.items() if "error" not in v}
    ok2 = {k: v for k, v in p2.items() if v.get("batch") is not None and "error" not in v}
    lines += ["", "goals:", *goals(ok1, ok2)]
    if ok1:
        lines.append(
            "first-step loss per arm (same init and batch): "
            + ", ".join(f"{k} {v['losses'][0]:.4f}" for k, v in ok1.items())
        )
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train_step.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "train_step.json"), "w") as f:
        json.dump(dict(args=vars(a), phase1=p1, phase2=p2), f, indent=1)
    print(f"wrote {a.out}/train_step.md and .json; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
