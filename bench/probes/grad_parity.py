"""Probe: every parameter's gradient of one microbatch under each arm of ``bench/hf_models.py``, against FP32 eager.

One microbatch of real text through a Hugging Face MoE model (``bench/hf_models.py``'s models and dims), forward and
backward: first in FP32 without autocast or compile (the reference), then under each arm from the same weights and
batch. Prints each arm's loss and, per parameter, the relative error ``|g - g_ref| / |g_ref|`` (Frobenius) of its
gradient: the parameters where any arm is worst, and the median and worst by parameter kind (the name without its
layer index); and per MoE layer, the share of tokens routed to other experts than under FP32 (a forward with the
router logits returned). BF16 arms land near 1e-2; FP8 arms some times that, evenly across kinds. A kind far above
the rest names the path that computes its gradient wrongly (a loss curve that falls behind BF16 says only that one
does); many tokens routed elsewhere point at the routing's sensitivity instead.

    python -m bench.probes.grad_parity --model mixtral --layers 2 [--dims real] [--arms bf16-grouped,fp8_block]
        [--tokens 8192] [--top 12]

An arm may carry environment switches after a ``+``: ``fp8_block+MXFX_GROUPED_SM90=1`` runs ``fp8_block`` with that
variable set (the kernel switches of ``mxfx.kernels``). CUDA where present, else the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import statistics

import torch

from bench import hf_models

data = hf_models.data  # examples/data.py, as the benchmark imports it


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME[+KEY=VALUE...]`` -> ``(NAME, {KEY: VALUE})``; raises ValueError naming the spec."""
    name, *switches = spec.split("+")
    env = {}
    for s in switches:
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise ValueError(f"grad_parity: arm {spec!r}: a switch must read KEY=VALUE, got {s!r}")
        env[key] = value
    if name not in hf_models.ARMS:
        raise ValueError(f"grad_parity: unknown arm {name!r}; choose from {', '.join(hf_models.ARMS)}")
    return name, env


def kind(name: str) -> str:
    """A parameter's name with its layer index as ``*`` (``model.layers.*.mlp.gate.weight``)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def gradients(model: torch.nn.Module, run, autocast: bool, device: str, x, y) -> tuple[float, dict]:
    """Loss and ``{name: FP32 gradient on the CPU}`` of one forward and backward of ``run`` on ``(x, y)``."""
    amp = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        loss = run(input_ids=x, labels=y).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.float().cpu()
    return loss.item(), grads


def router_logits(run, autocast: bool, device: str, x) -> list[torch.Tensor]:
    """Each MoE layer's router logits ``[tokens, experts]`` (FP32) of a forward of ``run`` on ``x``, without grad."""
    amp = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), amp:
        return [t.float() for t in run(input_ids=x, output_router_logits=True).router_logits]


def flipped(logits: torch.Tensor, ref: torch.Tensor, k: int) -> float:
    """Share of tokens whose top-``k`` experts (as a set) differ between two ``[tokens, experts]`` logit tensors."""
    mine, theirs = (t.topk(k, dim=-1).indices.sort(dim=-1).values for t in (logits, ref))
    return (mine != theirs).any(dim=-1).float().mean().item()


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """``|g - ref| / |ref|`` (Frobenius, FP32 sums: ample at the errors read here), 0 / 0 read as 0."""
    return ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mixtral", choices=sorted(hf_models.MODELS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dims", default="real", choices=hf_models.DIMS)
    p.add_argument("--arms", default="bf16-grouped,fp8_block")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=12, help="parameters listed, worst first")
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(s.strip()) for s in args.arms.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    for flag, value in (("--layers", args.layers), ("--seq", args.seq), ("--top", args.top)):
        if value < 1:
            p.error(f"argument {flag}: {value} must be >= 1")
    if args.tokens < args.seq or args.tokens % args.seq:
        p.error(f"argument --tokens: {args.tokens} is not a positive multiple of --seq {args.seq} (whole sequences)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train, _ = data.load_splits()
    gen = torch.Generator().manual_seed(1234 + args.seed)
    x, y = data.get_batch(train, args.tokens // args.seq, args.seq, gen, device)

    model = hf_models.build_model(args.model, args.layers, args.dims, device, args.seed)
    top_k = model.config.num_experts_per_tok
    ref_loss, ref = gradients(model, model, False, device, x, y)
    ref_routing = router_logits(model, False, device, x)
    del model
    losses, errors, routing = {"fp32 eager": ref_loss}, {}, {}
    for name, env in arms:
        label = "+".join([name, *(f"{k}={v}" for k, v in env.items())])
        arm = hf_models.ARMS[name]
        saved = {k: os.environ.get(k) for k in [*env, *dict(arm.env)]}
        os.environ.update({**dict(arm.env), **env})
        try:
            gc.collect()
            torch._dynamo.reset()
            model = hf_models.build_model(args.model, args.layers, args.dims, device, args.seed).to(arm.param_dtype)
            run = arm.prepare(model, "inductor")
            losses[label], grads = gradients(model, run, arm.autocast, device, x, y)
            routing[label] = [
                (flipped(mine, theirs, top_k), relative_error(mine, theirs))
                for mine, theirs in zip(router_logits(run, arm.autocast, device, x), ref_routing, strict=True)
            ]
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        del model
        missing = sorted(set(ref) - set(grads))
        if missing:
            raise SystemExit(f"grad_parity: {label} left {len(missing)} parameters without a gradient: {missing[:4]}")
        errors[label] = {n: relative_error(grads[n], ref[n]) for n in ref}
        del grads
        if device == "cuda":
            torch.cuda.empty_cache()

    labels = list(errors)
    print(f"\n{args.model}, {args.layers} layers, {args.dims} dims, {args.tokens} tokens, {device}")
    print("| | " + " | ".join(losses) + " |\n|---|" + "---:|" * len(losses))
    print("| loss | " + " | ".join(f"{v:.5f}" for v in losses.values()) + " |")
    print(f"\nrouting against FP32 eager: tokens whose top-{top_k} experts differ; the router logits' relative error")
    print("| layer | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels))
    for layer in range(len(ref_routing)):
        cells = [f"{100 * routing[lab][layer][0]:.2f}%; {routing[lab][layer][1]:.2e}" for lab in labels]
        print(f"| {layer} | " + " | ".join(cells) + " |")
    print(f"\nrelative error of each gradient against FP32 eager, worst {args.top}:")
    print("| parameter | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels))
    worst = sorted(ref, key=lambda n: -max(errors[lab][n] for lab in labels))[: args.top]
    for n in worst:
        print(f"| {n} | " + " | ".join(f"{errors[lab][n]:.2e}" for lab in labels) + " |")
    print("\nby parameter kind, median / worst:")
    print("| kind | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels))
    kinds: dict[str, list[str]] = {}
    for n in ref:
        kinds.setdefault(kind(n), []).append(n)
    for k, names in kinds.items():
        cells = [
            f"{statistics.median(errors[lab][n] for n in names):.2e} / {max(errors[lab][n] for n in names):.2e}"
            for lab in labels
        ]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
