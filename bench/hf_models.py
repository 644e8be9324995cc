"""Real-client training benchmark: HF transformers MoE models as users train them, BF16 vs mxfp8 vs torchao FP8.

Models (random init, ``--layers`` decoder layers at the per-layer shapes of the released checkpoints
(``--dims real``, the default), byte vocabulary 256 since the text is bytes):

* ``olmoe``: ``OlmoeForCausalLM`` at OLMoE-1B-7B's shapes: hidden 2048, 16 heads, 64 experts top-8,
  expert hidden 1024;
* ``qwen3``: ``Qwen3MoeForCausalLM`` at Qwen3-30B-A3B's: hidden 2048, 32 heads / 4 KV heads of
  head_dim 128, 128 experts top-8, expert hidden 768;
* ``mixtral``: ``MixtralForCausalLM`` at Mixtral-8x7B's: hidden 4096, 32 heads / 8 KV heads, 8 experts top-2,
  expert hidden 14336 (1.45B parameters a layer: with FP32 main weights, gradients and AdamW's state, 2 layers
  take about 43 GiB, so an 80 GB card trains ``--layers 2``, not the default 4).

``--dims small`` shrinks each to what a CPU trains in minutes (hidden 128, 2 heads of 64, 16 experts
top-4, expert hidden 128: feature dims multiples of 128, so fp8_block converts every GEMM too);
``--smoke`` uses tiny dims (4 experts top-2), hidden and expert hidden 128 so that fp8_block's 128-blocks tile
the expert GEMMs too.

Arms (:data:`ARMS`; one line each), all in one
process, same initial weights and the same batches of real text (``examples/data.py``),
fused AdamW with linear LR warmup then cosine decay:

* ``bf16-users``: FP32 parameters + ``torch.autocast(bfloat16)``, ``torch.compile`` (Inductor): what
  HF ``Trainer(bf16=True)`` and most training scripts run (transformers then computes the experts
  with its FP32 ``grouped_mm_fallback`` op);
* ``bf16-weights``: parameters cast to BF16, no autocast, Inductor: the fastest BF16 transformers
  offers (``torch._grouped_mm`` experts), without FP32 main weights;
* ``bf16-grouped``: FP32 parameters + autocast, ``backend="mxfp8"`` with ``format="bf16_gemm"``: the same
  recipe as the low-precision arms with BF16 GEMMs (linears and routed experts, transformers' FP32 expert
  fallback included) from BF16 copies of the FP32 main weights cast once per step, the weight caches of the
  other formats. Against ``bf16-users`` it measures what BF16 (not FP32) expert GEMMs cost; against ``mxfp8``
  and ``fp8_block`` what their rounding costs and their GEMMs gain, at equal recipe;
* ``mxfp8``: FP32 parameters + autocast, ``torch.compile(backend="mxfp8")``;
* ``fp8_block``: the same with ``options={"format": "fp8_block"}`` (FP8 1x128/128x128 blocks, native FP8
  GEMMs on Hopper);
* ``fp8_block-triton``: ``fp8_block`` with its routed forward and dgrad on the Triton grouped kernel instead of
  the warp-specialized sm90 one (``MXFX_GROUPED_SM90=0`` while it runs): what that kernel gains in the step;
* ``fp8_block-ungathered``: ``fp8_block`` with the routed dY's token gradient written out per routed row before
  the route-gradient kernel reads it (``MXFX_GATHER_ROUTE_GRAD=0`` while it compiles and runs), not gathered by
  that kernel: what the gather saves in the step;
* ``bf16-grouped-ws``, ``fp8_block-ws``: those arms with the routed wgrad into FP32 on the sm90 ping-pong kernel
  (``MXFX_WGRAD_SM90=1`` while they run) instead of the Triton one;
* ``fp8_block-routed``: ``fp8_block`` with the dense linears left in BF16 (a rule ``{"op": "linear",
  "precision": "bf16"}``): FP8 on the routed experts only;
* ``bf16-grouped-unfused``, ``fp8_block-unfused``: those arms with ``fuse_wgrad_accumulation=False`` (autograd adds
  each microbatch's weight gradient into ``.grad``, the library default being the wgrad GEMM adding into it
  itself): what the fusion gains in the step;
* ``torchao-fp8-rowwise``: torchao's FP8 rowwise grouped GEMMs on the routed experts
  (``quantize_(experts, Float8TrainingOpConfig())``, ``torchao.prototype.moe_training``), BF16
  parameters: torchao's weight wrapper only intercepts ``torch._grouped_mm``, which transformers
  calls under compile only for BF16 weights (with FP32 weights it calls its opaque fallback op and
  the experts stay FP32 GEMMs), so BF16 parameters are the faster, and the only converting, choice.
  Needs CUDA sm89+; elsewhere the arm reports why it could not run and the script goes on. With
  torchao 0.18 on the H200 it stops on a CUDA assert: HF's routed groups are not multiples of 16 rows, and
  torchao refuses its own padding on this path (``bench/moe_layer.py`` pads them for its torchao arm). It
  always runs last, since the assert ends the process's CUDA context.

Each optimizer step runs ``--microbatches`` gradient-accumulation microbatches of ``--tokens`` tokens (the OLMo
recipe's throughput benchmark: 8 per step), the weight caches built once per step and reused by all of them.

Reported per arm: tokens/s (steady state, steps after the first ``--skip`` ones), peak memory,
first-step time (compilation included), held-out loss at the end (mean over ``--eval-batches``
held-out batches, forward only through the same compiled model), and for the arms compiled by mxfx the
precision map's count of expert GEMMs in MX (and their format), of those kept as written, of dense linears in low
precision and kept, and of ops reported ``not rewritten``.
``--phases`` also prints, per step, the wall time (synchronized) of forward, backward and optimizer step and, on
CUDA, the peak and end allocated GiB of each.

Where the step goes (one table per arm, ms per optimizer step): with ``--profile``, the last step (all its
microbatches) under ``torch.profiler``, its GPU busy time by kernel family (``bench/breakdown.py``: routed GEMM,
dense GEMM, quantize/layout, quantization statistics, attention, gradient accumulation, optimizer + refresh, other;
% of the busy time), the families summing to the busy time (the union of the kernels over streams, time on two
streams at once split between them); on CPU, where there are no kernels, every op's self time. Then the busy time
and the host times as % of the step's wall time (steady steps, the profiled one left out; the GPU idles for the
rest): ``host CPU`` is the process's CPU time (``time.process_time``, all threads: the autograd engine's too, and on
CPU the intra-op threads' compute) from the step's start until its last launch returned, the device synchronized
only after; ``host issue`` the wall time of the same span, which also holds any wait on the device inside the step
(a synchronizing op, a full launch queue). Both include ``--phases``' per-phase synchronizations when it is on. The
JSON has them per arm (``step_ms`` and each kept step's ``steady_step_ms``, ``profiled_step_ms``, ``host_cpu_ms``,
``host_issue_ms``, ``breakdown``); each arm prints its kept steps' times (a one-off pause is one outlier).
On CUDA the same profile also gives the host's side: each op's and ``record_function`` range's own time on the
host threads (Python outside any range is charged to the range around it), the costliest side by side across arms.
``--compiler aot_eager_fp32_gemms`` (CPU) runs each BF16 GEMM as an FP32 GEMM of its BF16 operands. A markdown table is
printed last; JSON goes to ``bench/results/hf_models.json`` (``--out`` to change the folder).

    python bench/hf_models.py                      # H200: both models, all arms, 200 steps
    python bench/hf_models.py --model olmoe --arms bf16-users,mxfp8 --steps 50
    python bench/hf_models.py --smoke              # CPU, tiny dims, a few steps, aot_eager (CI)
    python bench/hf_models.py --steps 20           # H200: the recipe's operating point, 8 microbatches per step
    python bench/hf_models.py --microbatches 1 --steps 200  # held-out loss after 200 single-microbatch steps
    python bench/hf_models.py --model qwen3 --arms fp8_block,bf16-weights --steps 4 --phases --profile \
        # where a step goes
    python bench/hf_models.py --smoke --model olmoe --layers 1 --microbatches 2 --arms bf16-grouped,fp8_block --profile
    python bench/hf_models.py --dims small --compiler aot_eager_fp32_gemms --tokens 1024 --seq 128 \
        --arms bf16-users,bf16-grouped,mxfp8,fp8_block   # CPU: a precision study in minutes per arm
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
from functools import partial
import gc
import json
import math
import os
import pstats
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch._inductor.config as inductor_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
import breakdown  # noqa: E402  (bench/breakdown.py)
import peak_memory  # noqa: E402  (bench/peak_memory.py)
import data  # noqa: E402  (examples/data.py)
import mxfx  # noqa: E402
from mxfx.post_grad import route_grad_gather  # noqa: E402
from mxfx.runtime.cache import step_count  # noqa: E402

GIB = 2**30


# ----------------------------------------------------------------------------- models


DIMS = ("real", "small", "smoke")
MODELS = {"olmoe": "OlmoeForCausalLM", "qwen3": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""--model names and the transformers class each one trains."""


def _transformers():
    """Hugging Face transformers, the client this benchmark trains (an optional dependency of mxfx)."""
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise SystemExit(
            "hf_models: needs Hugging Face transformers, which mxfx itself does not install: pip install -e '.[bench]'"
        ) from e
    return transformers


def model_config(name: str, layers: int, dims: str = "real"):
    """The transformers config of ``name`` (one of :data:`MODELS`) with ``layers`` layers at ``dims`` (:data:`DIMS`)."""
    T = _transformers()

    if dims not in DIMS:
        raise SystemExit(f"hf_models: unknown --dims {dims!r}; choose one of {', '.join(DIMS)}")
    common = dict(
        vocab_size=data.VOCAB_SIZE, num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False
    )
    if name == "olmoe":
        dims_of = {
            "real": dict(
                hidden_size=2048,
                intermediate_size=1024,
                num_attention_heads=16,
                num_key_value_heads=16,
                num_experts=64,
                num_experts_per_tok=8,
            ),
            "small": dict(
                hidden_size=128,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_experts=16,
                num_experts_per_tok=4,
            ),
            "smoke": dict(
                hidden_size=128,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        }
        return T.OlmoeConfig(**dims_of[dims], **common)
    if name == "qwen3":
        dims_of = {
            "real": dict(
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
            ),
            "small": dict(
                hidden_size=128,
                intermediate_size=384,
                moe_intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=64,
                num_experts=16,
                num_experts_per_tok=4,
            ),
            "smoke": dict(
                hidden_size=128,
                intermediate_size=128,
                moe_intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=64,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        }
        return T.Qwen3MoeConfig(**dims_of[dims], **common)
    if name == "mixtral":
        dims_of = {
            "real": dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_attention_heads=32,
                num_key_value_heads=8,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            "small": dict(
                hidden_size=128,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_local_experts=16,
                num_experts_per_tok=4,
            ),
            "smoke": dict(
                hidden_size=128,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
            ),
        }
        return T.MixtralConfig(**dims_of[dims], **common)
    raise SystemExit(f"hf_models: unknown --model {name!r}; choose one of {', '.join(MODELS)}")


def build_model(name: str, layers: int, dims: str, device: str, seed: int = 0) -> torch.nn.Module:
    T = _transformers()

    cfg = model_config(name, layers, dims)
    cls = getattr(T, MODELS[name])
    torch.manual_seed(seed)  # every arm starts from the same weights (initialized on the device: seconds, not a minute)
    with torch.device(device):
        return cls(cfg)


# ----------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """One way to train: parameter dtype, autocast or not, and how the model is compiled.

    ``prepare(model, compiler) -> callable`` returns the model compiled with ``compiler`` ("inductor";
    "aot_eager" in the CPU smoke run, no C++ builds) behind it; it may convert the model in place
    (torchao) and raises where the arm cannot run here.
    """

    name: str
    param_dtype: torch.dtype
    autocast: bool
    prepare: Callable
    env: tuple[tuple[str, str], ...] = ()  # environment variables set while the arm runs
    expert_format: str | None = None  # the routed experts' format where mxfx compiles the arm (its maps are read)


BF16_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
"""ATen GEMMs that ``--compiler aot_eager_fp32_gemms`` runs in FP32 when they are given BF16 operands."""


def _fp32_gemms(gm: torch.fx.GraphModule, example_inputs):
    """An ATen graph with every BF16 GEMM of :data:`BF16_GEMMS` run as an FP32 GEMM of the same (exactly
    converted) BF16 operands, its result rounded to BF16: a BF16 GEMM's products and FP32 accumulation, up to
    summation order, on CPUs without BF16 matmul instructions (AVX2 only), where BF16 GEMMs run ~50x slower."""
    from functorch.compile import make_boxed_func

    convert = torch.ops.prims.convert_element_type.default
    targets = {getattr(torch.ops.aten, name).default for name in BF16_GEMMS}
    graph = gm.graph
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or node.target not in targets or getattr(val, "dtype", None) != torch.bfloat16:
            continue
        with graph.inserting_before(node):
            node.args = tuple(
                graph.call_function(convert, (a, torch.float32))
                if isinstance(a, torch.fx.Node) and a.meta["val"].is_floating_point()
                else a
                for a in node.args
            )
        if "out_dtype" in node.kwargs:
            node.kwargs = {**node.kwargs, "out_dtype": torch.float32}
        with graph.inserting_after(node):
            out = graph.call_function(convert, (node, torch.bfloat16))
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
    gm.recompile()
    return make_boxed_func(gm.forward)


COMPILERS = ("inductor", "aot_eager", "aot_eager_fp32_gemms")
"""``--compiler`` choices; ``aot_eager_fp32_gemms`` is aot_eager with :func:`_fp32_gemms` on both graphs (CPU)."""


def _backend(compiler: str):
    """The torch.compile backend of a ``--compiler`` name (mxfp8's ``inner``)."""
    if compiler == "aot_eager_fp32_gemms":
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=_fp32_gemms, bw_compiler=_fp32_gemms)
    return compiler


def _inductor(model, compiler: str):
    return torch.compile(model, backend=_backend(compiler))


def _bf16_grouped(model, compiler: str, fused: bool = True):
    options = {"inner": _backend(compiler), "format": "bf16_gemm", "fuse_wgrad_accumulation": fused}
    return torch.compile(model, backend="mxfp8", options=options)


def _mxfp8(model, compiler: str):
    return torch.compile(model, backend="mxfp8", options={"inner": _backend(compiler)})


def _fp8_block(
    model,
    compiler: str,
    fused: bool = True,
    dense: bool = True,
    kernels: str | None = None,
    routed_wgrad: str | None = None,
):
    options = {"inner": _backend(compiler), "format": "fp8_block", "fuse_wgrad_accumulation": fused}
    if kernels is not None:  # "opaque": the kernels stay mxfx ops in the graph instead of Inductor launching them
        options["kernels"] = kernels
    rules = [] if dense else [{"op": "linear", "precision": "bf16"}]  # dense linears as the model wrote them
    if routed_wgrad is not None:  # the routed experts' weight gradients in the format ("mxfp8") instead of BF16
        rules.append({"op": "grouped_mm", "wgrad": routed_wgrad})
    if rules:
        options["rules"] = rules
    return torch.compile(model, backend="mxfp8", options=options)


def _torchao_fp8_rowwise(model, compiler: str):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise RuntimeError("torchao FP8 rowwise grouped GEMMs need a CUDA GPU with FP8 tensor cores (sm89+)")
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    # torchao 0.18's FP8 rowwise path asserts on its own group padding, and cuBLAS's FP8 grouped GEMM asserts on
    # groups that are not multiples of 16 rows, as HF routes them (measured on the H200); the arm is kept so a later
    # torchao shows what it can do, and runs last (main)
    config = Float8TrainingOpConfig()
    quantize_(model, config, filter_fn=lambda mod, fqn: fqn.endswith("mlp.experts"))
    return torch.compile(model, backend=_backend(compiler))


ARMS = {
    arm.name: arm
    for arm in (
        Arm("bf16-users", torch.float32, True, _inductor),
        Arm("bf16-weights", torch.bfloat16, False, _inductor),
        Arm("bf16-grouped", torch.float32, True, _bf16_grouped, expert_format="bf16_gemm"),
        Arm("mxfp8", torch.float32, True, _mxfp8, expert_format="MX"),
        Arm("torchao-fp8-rowwise", torch.bfloat16, False, _torchao_fp8_rowwise),
        Arm("fp8_block", torch.float32, True, _fp8_block, expert_format="fp8_block"),
        Arm("fp8_block-triton", torch.float32, True, _fp8_block, (("MXFX_GROUPED_SM90", "0"),), "fp8_block"),
        Arm("fp8_block-ungathered", torch.float32, True, _fp8_block, ((route_grad_gather.ENV, "0"),), "fp8_block"),
        Arm(
            "bf16-grouped-unfused", torch.float32, True, partial(_bf16_grouped, fused=False), expert_format="bf16_gemm"
        ),
        Arm("fp8_block-unfused", torch.float32, True, partial(_fp8_block, fused=False), expert_format="fp8_block"),
        Arm("fp8_block-routed", torch.float32, True, partial(_fp8_block, dense=False), expert_format="fp8_block"),
        Arm("fp8_block-opaque", torch.float32, True, partial(_fp8_block, kernels="opaque"), expert_format="fp8_block"),
        Arm(
            "fp8_block-inductor",
            torch.float32,
            True,
            partial(_fp8_block, kernels="inductor"),
            expert_format="fp8_block",
        ),
        Arm(
            "fp8_block-wgrad8",
            torch.float32,
            True,
            partial(_fp8_block, routed_wgrad="mxfp8"),
            expert_format="fp8_block",
        ),
    )
}
for _arm in ("bf16-grouped", "fp8_block"):  # the same arm, its routed wgrad on the sm90 ping-pong kernel
    ARMS[f"{_arm}-ws"] = replace(ARMS[_arm], name=f"{_arm}-ws", env=(("MXFX_WGRAD_SM90", "1"),))
POST_GRAD_SWITCHES = (route_grad_gather.ENV,)
"""Arm switches read by mxfx's passes on Inductor's post-grad graphs: under another ``--compiler`` they do nothing."""
ARMS["fp8_block-wgrad8-ws"] = replace(  # the FP8 routed wgrad on the warp-specialized sm90 kernel
    ARMS["fp8_block-wgrad8"], name="fp8_block-wgrad8-ws", env=(("MXFX_BLOCK_WGRAD_SM90", "1"),)
)
OPTIONAL_ARMS = (
    "fp8_block-triton",
    "fp8_block-ungathered",
    "bf16-grouped-unfused",
    "fp8_block-unfused",
    "bf16-grouped-ws",
    "fp8_block-ws",
    "fp8_block-routed",
    "fp8_block-opaque",
    "fp8_block-inductor",
    "fp8_block-wgrad8",
    "fp8_block-wgrad8-ws",
)
"""Arms run only when ``--arms`` names them: the unfused arms set ``Policy(fuse_wgrad_accumulation=False)``;
``fp8_block-routed`` keeps the dense linears (attention projections) in BF16; ``fp8_block-opaque`` and
``fp8_block-inductor`` fix how the kernels enter the graph (``Policy(kernels=...)``: mxfx ops, a shorter compile
and more host work a call; or launched by Inductor's code) where ``fp8_block`` lets ``kernels="auto"`` choose;
``fp8_block-wgrad8`` runs the routed experts' wgrad in FP8 too (a rule ``wgrad="mxfp8"``; BF16 by default), and
``fp8_block-wgrad8-ws`` that wgrad on the warp-specialized sm90 kernel (``MXFX_BLOCK_WGRAD_SM90=1``)."""


# ----------------------------------------------------------------------------- training


def lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 10% of ``lr`` at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Phases:
    """The phases of a training step, timed and measured when ``on`` (``--phases``).

    ``run(label, fn)`` returns ``fn()``; when on, it also records the phase's wall ms (synchronized) and, on CUDA,
    its peak and end allocated GiB in ``parts``. ``peak_bytes`` keeps the run's peak across the per-phase resets.
    """

    def __init__(self, on: bool, device: str):
        self.on, self.cuda, self.parts, self.peak_bytes = on, device == "cuda", [], 0

    def run(self, label: str, fn):
        if not self.on:
            return fn()
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        part = f"{label} {(time.perf_counter() - t0) * 1e3:.1f} ms"
        if self.cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
            part += (
                f", peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB, "
                f"end {torch.cuda.memory_allocated() / GIB:.2f} GiB"
            )
        self.parts.append(part)
        return out


def _profiler(device: str):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


HOST_FUNCTIONS = 30
"""Python functions ``--host-profile`` lists per arm."""


def host_functions(prof: cProfile.Profile, n: int = HOST_FUNCTIONS) -> list[dict]:
    """The ``n`` Python functions with the most own time in a ``cProfile`` run: ``{"function", "calls", "own_ms",
    "cumulative_ms"}`` each, costliest first."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [
        {
            "function": f"{os.path.relpath(f, ROOT) if f.startswith(ROOT) else f}:{line}({name})",
            "calls": c,
            "own_ms": 1e3 * own,
            "cumulative_ms": 1e3 * cum,
        }
        for (f, line, name), (_, c, own, cum, _) in ranked
    ]


def host_table(title: str, functions: list[dict]) -> str:
    """A markdown table of :func:`host_functions`' rows (the function's location cut to its last 100 characters)."""
    lines = [f"| {title}: function | calls | own ms | cumulative ms |", "|---|---:|---:|---:|"]
    lines += [
        f"| {f['function'][-100:]} | {f['calls']} | {f['own_ms']:.2f} | {f['cumulative_ms']:.2f} |" for f in functions
    ]
    return "\n".join(lines)


def run_arm(arm: Arm, args, train, val, device: str) -> dict:
    """Train one arm for ``args.steps`` steps; returns its measurements (or the reason it could not run)."""
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(args.model, args.layers, args.dims, device, args.seed).to(arm.param_dtype)
    n_maps = len(mxfx.report.all_reports())
    res: dict = {"arm": arm.name, "param_dtype": str(arm.param_dtype).removeprefix("torch."), "autocast": arm.autocast}
    try:
        fn = arm.prepare(model, args.compiler)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    except Exception as e:  # the arm cannot run here: say why, go on
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return res
    amp = torch.autocast(device, torch.bfloat16) if arm.autocast else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(1234 + args.seed)  # same batches in every arm
    batch = max(1, args.tokens // args.seq)
    times, host_cpu, host_issue, losses, sampled = [], [], [], [], []
    # the step before the profiled one (or the last): cProfile's (--host-profile) and the allocator history's
    host_profiled_step = args.steps - 2 if args.profile else args.steps - 1
    sampled_loss: list = []
    phases = Phases(args.phases, device)
    try:
        for step in range(args.steps):
            # a step whose forward samples quantization statistics (--stats-every; Policy.stats)
            sampled.append(bool(args.stats_every) and step_count() % args.stats_every == 0)
            micro = [data.get_batch(train, batch, args.seq, gen, device) for _ in range(args.microbatches)]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
            profiled = args.profile and step == args.steps - 1
            host_prof = cProfile.Profile() if args.host_profile and step == host_profiled_step else None
            if host_prof:
                host_prof.enable()

            def one_step():
                for x, _ in micro:  # gradient accumulation: the weight caches are built once per step, then reused
                    with amp:  # labels=x: the model shifts its labels by one itself (next-byte targets)
                        loss = phases.run("forward", lambda: fn(input_ids=x, labels=x).loss)
                    phases.run("backward", lambda: (loss / args.microbatches).backward())
                phases.run("optimizer step", opt.step)
                opt.zero_grad(set_to_none=True)
                return loss

            with _profiler(device) if profiled else contextlib.nullcontext() as prof:
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                if args.peak_sites and device == "cuda" and step == host_profiled_step:
                    phases.peak_bytes = max(phases.peak_bytes, torch.cuda.max_memory_allocated())  # it resets it
                    recorded, _ = peak_memory.record_peak(lambda: sampled_loss.append(one_step()))
                    loss = sampled_loss.pop()
                    res["peak_sites"] = peak_memory.peak_table(recorded, top=args.peak_sites)
                else:
                    loss = one_step()
                host_cpu.append(time.process_time() - c0)
                host_issue.append(time.perf_counter() - t0)
                _sync(device)
            times.append(time.perf_counter() - t0)
            if host_prof:
                host_prof.disable()
                res["host_profile"] = host_functions(host_prof)
            if phases.parts:
                print(f"  {args.model} {arm.name} step {step}: " + "; ".join(phases.parts), flush=True)
                phases.parts = []
            if profiled:
                trace = breakdown.profile_trace(prof)
                res["breakdown"] = breakdown.step_breakdown(trace, device, top=60)
                if device == "cuda":  # where the host time goes: each op's and range's own time on the host threads
                    res["host_breakdown"] = breakdown.step_breakdown(trace, "cpu", top=60)
                res["profiled_step_ms"] = 1e3 * times[-1]
                print(
                    f"  {args.model} {arm.name} step {step} profiled: {res['breakdown']['total_ms']:.1f} ms of "
                    f"{res['breakdown']['source']} in a {res['profiled_step_ms']:.1f} ms step",
                    flush=True,
                )
            if step % args.log_every == 0 or step == args.steps - 1:
                losses.append((step, loss.item()))
                print(
                    f"  {args.model} {arm.name} step {step}: loss {losses[-1][1]:.4f}, {times[-1] * 1e3:.0f} ms",
                    flush=True,
                )
        eval_gen = torch.Generator().manual_seed(99)
        held = []
        for _ in range(args.eval_batches):  # forward only, through the same compiled graph
            x, _ = data.get_batch(val, batch, args.seq, eval_gen, device)
            with amp:
                held.append(fn(input_ids=x, labels=x).loss.item())
    except Exception as e:
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return res
    # steady steps: past the first --skip, the profiled step left out (the profiler slows it); at least one step
    last = len(times) - 1  # the profiled step, and the host-profiled one before it, are left out
    slowed = {last} if args.profile else set()
    slowed |= {host_profiled_step} if args.host_profile or (args.peak_sites and device == "cuda") else set()
    kept = [i for i in range(args.skip, len(times)) if i not in slowed]
    fallback = not kept  # no steady step left: the last one stands in, slowed or not (said below)
    kept = kept or [last]
    steady = [times[i] for i in kept]
    if args.stats_every:  # sampled against unsampled steady steps (the sampling overhead's <= 10% goal)
        on = [times[i] for i in kept if sampled[i]]
        off = [times[i] for i in kept if not sampled[i]]
        if on and off:
            res["stats_sampled_step_s"], res["stats_unsampled_step_s"] = sum(on) / len(on), sum(off) / len(off)
            res["stats_sampled_over_unsampled"] = res["stats_sampled_step_s"] / res["stats_unsampled_step_s"]
            res["stats_path"] = args.stats_path
            print(
                f"  {args.model} {arm.name} ({args.stats_path} statistics): "
                f"sampled steps {res['stats_sampled_step_s'] * 1e3:.1f} ms ({len(on)}), "
                f"unsampled {res['stats_unsampled_step_s'] * 1e3:.1f} ms ({len(off)}): "
                f"x{res['stats_sampled_over_unsampled']:.3f}",
                flush=True,
            )
    res.update(
        tokens_per_s=args.microbatches * batch * args.seq / (sum(steady) / len(steady)),
        microbatches=args.microbatches,
        first_step_s=times[0],
        step_ms=1e3 * sum(steady) / len(steady),
        steady_step_ms=[round(1e3 * t, 1) for t in steady],  # each kept step: a one-off pause shows as one outlier
        host_cpu_ms=1e3 * sum(host_cpu[i] for i in kept) / len(kept),
        host_issue_ms=1e3 * sum(host_issue[i] for i in kept) / len(kept),
        peak_gib=max(phases.peak_bytes, torch.cuda.max_memory_allocated()) / GIB if device == "cuda" else None,
        heldout_loss=sum(held) / len(held),
        train_losses=losses,
    )
    if arm.expert_format:  # the precision maps of this arm's graphs (training and held-out forward)
        maps = mxfx.report.all_reports()[n_maps:]
        train_map = max(maps, key=lambda pm: pm.count("grouped_mm", True), default=None)
        res["expert_gemms_mx"] = max((pm.count("grouped_mm", True) for pm in maps), default=0)
        res["expert_format"] = train_map.formats("grouped_mm") if train_map is not None else arm.expert_format
        res["expert_gemms_kept"] = max((pm.count("grouped_mm", False) for pm in maps), default=0)
        res["linears"] = (  # the dense linears of the training graph: in low precision, kept as written
            (train_map.count("linear", True), train_map.formats("linear"), train_map.count("linear", False))
            if train_map is not None
            else None
        )
        res["not_rewritten"] = sum(pm.count("not_rewritten") for pm in maps)
    which = (
        f"step {last} only, no other left past --skip {args.skip}: give more --steps"
        if fallback
        else f"steps {kept[0]}-{kept[-1]}" + (", the profiled one left out" if args.profile else "")
    )
    print(
        f"  {args.model} {arm.name}: steady steps {', '.join(f'{t:.0f}' for t in res['steady_step_ms'])} ms ({which})",
        flush=True,
    )
    fn = opt = model = None  # freed before the next arm (closures above still name them)
    return res


def table(results: list[dict]) -> str:
    """Markdown table of every arm of every model, tokens/s relative to that model's bf16-users arm."""
    lines = [
        "| model | arm | params | tokens/s | vs bf16-users | peak GiB | first step s | held-out loss | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['arm']} | {r['param_dtype']} | - | - | - | - | - | could not run: {r['error']} |"
            )
            continue
        base = next(
            (b for b in results if b["model"] == r["model"] and b["arm"] == "bf16-users" and "error" not in b), None
        )
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        note = (
            f"{r['expert_gemms_mx']} expert GEMMs {r.get('expert_format', 'MX')}, {r['expert_gemms_kept']} kept, "
            f"{r['not_rewritten']} not rewritten"
            if "expert_gemms_mx" in r
            else ""
        )
        if r.get("linears"):
            low, fmt, kept = r["linears"]
            note += f"; linears {low} {fmt if low else 'low precision'}, {kept} kept"
        lines.append(
            f"| {r['model']} | {r['arm']} | {r['param_dtype']} | {r['tokens_per_s']:,.0f} | {rel} | {peak} | "
            f"{r['first_step_s']:.1f} | {r['heldout_loss']:.4f} | {note} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="olmoe,qwen3", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument(
        "--arms",
        default=",".join(a for a in ARMS if a not in OPTIONAL_ARMS),
        help=f"comma list of {', '.join(ARMS)} (default: all but {', '.join(OPTIONAL_ARMS)})",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="LR warmup steps")
    p.add_argument("--skip", type=int, default=5, help="steps left out of tokens/s (compilation, allocator warmup)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch")
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="gradient-accumulation microbatches per optimizer step (default: 8, the recipe's operating "
        "point, on CUDA; 1 elsewhere)",
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--compiler",
        default="inductor",
        choices=COMPILERS,
        help="torch.compile backend behind every arm (mxfp8's inner); aot_eager_fp32_gemms: CPUs without BF16 GEMMs",
    )
    p.add_argument(
        "--dims",
        default="real",
        choices=DIMS,
        help="model dims: the checkpoints' (real), CPU-sized (small), tiny (smoke)",
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights (seed) and batches (seed + 1234)")
    p.add_argument(
        "--phases",
        action="store_true",
        help="print each step's forward, backward and optimizer step: ms and, on CUDA, peak / end GiB",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the last step: its device time by kernel family and its costliest kernels (the "
        "profiler slows that step, left out of tokens/s)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="run the step before the profiled one (or the last) under cProfile and print the Python "
        "functions with the most own time in it (left out of tokens/s)",
    )
    p.add_argument(
        "--peak-sites",
        type=int,
        default=0,
        help="CUDA: record the allocator's history over the step before the profiled one (or the last) and "
        "print the N allocation sites with the most bytes live at its peak (bench/peak_memory.py; that step "
        "is left out of tokens/s)",
    )
    p.add_argument(
        "--cpp-wrapper",
        action="store_true",
        help="CUDA: every arm's Inductor graphs call their kernels from generated C++ instead of Python "
        "(torch._inductor.config.cpp_wrapper): less host time a launch, a longer first compile",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny dims, a few steps (CI): sets --steps, --warmup, --skip, --tokens, --seq, --eval-batches, "
        "--log-every, --compiler aot_eager and --dims smoke, whatever they were given",
    )
    p.add_argument(
        "--stats-every",
        type=int,
        default=0,
        help="quantization statistics of the mxfx arms every N optimizer steps (MXFX_STATS; 0: off); reports "
        "the mean time of sampled and unsampled steps",
    )
    p.add_argument(
        "--stats-path",
        default="fused",
        choices=("fused", "plain"),
        help="with --stats-every: samples from the fused statistics kernels where they cover a site "
        "(CUDA), or all from the plain-torch reference (MXFX_STATS_FUSED=0)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if args.peak_sites < 0:
        p.error(f"argument --peak-sites: {args.peak_sites} must be >= 0 (0: off)")
    if args.smoke:
        args.steps, args.warmup, args.skip, args.tokens, args.seq, args.eval_batches, args.log_every = (
            3,
            1,
            1,
            64,
            32,
            1,
            1,
        )
        args.compiler, args.dims = "aot_eager", "smoke"
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--layers", args.layers, 1),
        ("--tokens", args.tokens, 1),
        ("--seq", args.seq, 1),
        ("--eval-batches", args.eval_batches, 1),
        ("--log-every", args.log_every, 1),
        ("--warmup", args.warmup, 0),
        ("--skip", args.skip, 0),
        ("--stats-every", args.stats_every, 0),
    ):
        if value < least:
            p.error(f"argument {flag}: {value} must be >= {least}")
    if args.skip >= args.steps:
        p.error(f"argument --skip: {args.skip} leaves none of --steps {args.steps} to time; give more steps")
    if args.tokens % args.seq:
        p.error(
            f"argument --tokens: {args.tokens} is not a multiple of --seq {args.seq} (whole sequences a microbatch)"
        )
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"argument --lr: {args.lr} must be finite and > 0")
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown_models = sorted(set(models) - set(MODELS))
    if not models or unknown_models:
        what = f"unknown model(s) {unknown_models}" if unknown_models else "names no model"
        p.error(f"argument --model: {args.model!r} {what}; give a comma list of {', '.join(MODELS)}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms:
        p.error(f"argument --arms: {args.arms!r} names no arm; choose from {', '.join(ARMS)}")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        p.error(f"argument --arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    repeated = sorted({a for a in arms if arms.count(a) > 1})
    if repeated:  # the tables key each arm's results by its name
        p.error(f"argument --arms: {repeated} named more than once; name each arm once")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.microbatches is None:
        args.microbatches = 8 if device == "cuda" else 1
    if args.microbatches < 1:
        p.error(f"--microbatches {args.microbatches}: give at least 1")
    if args.stats_every:  # every mxfx arm's policy takes it (Policy.stats from MXFX_STATS)
        os.environ["MXFX_STATS"] = f"every={args.stats_every}"
        os.environ["MXFX_STATS_FUSED"] = "1" if args.stats_path == "fused" else "0"
    if args.cpp_wrapper:
        if device != "cuda":  # torch 2.13's C++ wrapper ended the bf16-grouped arm in a segfault on the CPU
            p.error("--cpp-wrapper: CUDA only (this run is on the CPU); leave it out")
        inductor_config.cpp_wrapper = True
    # torchao's FP8 grouped GEMM can hit a CUDA assert on HF's unpadded groups, which ends the process's CUDA
    # context: it runs after every other arm
    arms.sort(key=lambda a: a == "torchao-fp8-rowwise")
    train, val = data.load_splits(code_bytes=400_000 if args.smoke else 4_000_000)
    results = []
    os.makedirs(args.out, exist_ok=True)
    for model in models:
        for name in arms:
            print(f"== {model} / {name}", flush=True)
            arm_args = argparse.Namespace(**{**vars(args), "model": model})
            inert = sorted(k for k, _ in ARMS[name].env if k in POST_GRAD_SWITCHES and args.compiler != "inductor")
            if inert:  # the switch acts on Inductor's post-grad graphs only
                print(f"note: {name}: {', '.join(inert)} changes nothing under --compiler {args.compiler}", flush=True)
            saved = {k: os.environ.get(k) for k, _ in ARMS[name].env}
            os.environ.update(dict(ARMS[name].env))
            try:
                results.append({"model": model, **run_arm(ARMS[name], arm_args, train, val, device)})
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            with open(os.path.join(args.out, "hf_models.json"), "w") as f:  # after every arm: a cut run keeps its arms
                json.dump(
                    {
                        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "args": vars(args),
                        "results": results,
                    },
                    f,
                    indent=1,
                )
    print(table(results))
    for r in results:
        if "error" not in r:
            print(
                f"\nwhere the step goes, {r['model']} / {r['arm']} ({args.microbatches} microbatch(es) per step; "
                f"device: {device}):"
            )
            print(breakdown.breakdown_table(f"{r['model']} / {r['arm']}", r))
    for r in results:
        if "peak_sites" in r:
            print(f"\nlive at the peak of one step, {r['model']} / {r['arm']}:")
            print(r["peak_sites"])
    for r in results:
        if "host_profile" in r:
            print(f"\nhost time, {r['model']} / {r['arm']}: one step under cProfile")
            print(host_table(f"{r['model']} / {r['arm']}", r["host_profile"]))
    for model in models:
        profiled = [(r["arm"], r["breakdown"]) for r in results if r["model"] == model and "breakdown" in r]
        if profiled:
            print(f"\ncostliest kernels, {model}, ms per step (calls):")
            print(breakdown.kernel_comparison(profiled))
        hosts = [(r["arm"], r["host_breakdown"]) for r in results if r["model"] == model and "host_breakdown" in r]
        if hosts:
            print(f"\ncostliest host ops and ranges, {model}, own ms per profiled step (calls; profiler overhead in):")
            print(breakdown.kernel_comparison(hosts, what="host op"))
            print(
                "| **host self time, all threads** | | " + " | ".join(f"{h['total_ms']:.1f}" for _, h in hosts) + " |"
            )
    return results


if __name__ == "__main__":
    main()
