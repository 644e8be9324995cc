"""Probe: every parameter's gradient of one microbatch under each arm of ``bench/hf_models.py``, against FP32 eager.

One microbatch of real text through a Hugging Face MoE model (``bench/hf_models.py``'s models and dims), forward and
backward: first in FP32 without autocast or compile (the reference), then under each arm (compiled with Inductor)
from the same weights and batch. Prints each arm's next-byte loss and, per parameter, the relative error
``|g - g_ref| / |g_ref|`` (Frobenius) of its gradient: the parameters where any arm is worst, and the median and worst
by parameter kind (the name with its layer index as ``*``); and per MoE layer, the share of tokens routed to other
experts than under FP32 (a forward with the router logits returned). BF16 arms land near 1e-2, FP8 arms about ten
times that. Every token routed elsewhere raises the error of the router, the experts and the norm before them (at a
few hundred tokens one such token moves those kinds several times above the rest); a kind far above the rest with
few tokens routed elsewhere names a path that computes its gradient wrongly.

    python -m bench.probes.grad_parity --model mixtral --layers 2 --arms bf16-grouped,fp8_block  # GPU, real dims
    python -m bench.probes.grad_parity --model mixtral --dims smoke --tokens 256 --seq 128  # CPU, a few minutes

The defaults (Mixtral's real width, 8,192 tokens) need a GPU of 80 GB. An arm may carry environment switches after a
``+``: ``fp8_block+MXFX_GROUPED_SM90=1`` runs ``fp8_block`` with that variable set; only variables mxfx reads are
taken (some act on CUDA only). Run from the repository's root.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import re
import statistics
from pathlib import Path

import torch

import mxfx
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
    unknown = sorted(set(env) - mxfx_variables())
    if unknown:
        raise ValueError(
            f"grad_parity: arm {spec!r}: mxfx reads no environment variable {', '.join(unknown)}; "
            f"choose from {', '.join(sorted(mxfx_variables()))}"
        )
    return name, env


@functools.cache
def mxfx_variables() -> frozenset[str]:
    """The ``MXFX_*`` environment variable names mxfx's source mentions (the switches an arm may set)."""
    root = Path(mxfx.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        names.update(re.findall(r"\"(MXFX_[A-Z0-9_]+)\"", path.read_text(encoding="utf-8")))
    return frozenset(names)


def kind(name: str) -> str:
    """A parameter's name with its layer index as ``*`` (``model.layers.*.mlp.gate.weight``)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def gradients(model: torch.nn.Module, run, autocast: bool, device: str, x) -> tuple[float, dict]:
    """Next-byte loss and ``{name: FP32 gradient on the CPU}`` of one forward and backward of ``run`` on ``x``."""
    amp = torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp:
        loss = run(input_ids=x, labels=x).loss  # the model shifts its labels by one itself
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


def arm_label(name: str, env: dict[str, str]) -> str:
    """An arm's column heading: its name and switches as given."""
    return "+".join([name, *(f"{k}={v}" for k, v in env.items())])


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """``|g - ref| / |ref|`` (Frobenius, FP32 sums: ample at the errors read here), 0 / 0 read as 0."""
    return ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.probes.grad_parity",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="mixtral", choices=sorted(hf_models.MODELS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dims", default="real", choices=hf_models.DIMS)
    p.add_argument(
        "--arms",
        default="bf16-grouped,fp8_block",
        help=f"comma list of NAME[+MXFX_VARIABLE=VALUE...], NAME one of {', '.join(hf_models.ARMS)}",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the microbatch, whole sequences")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (at least 2: a next byte to predict)")
    p.add_argument("--seed", type=int, default=0, help="initial weights (seed) and batch (seed + 1234)")
    p.add_argument("--top", type=int, default=12, help="parameters listed, worst first")
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(s.strip()) for s in args.arms.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    labels = [arm_label(name, env) for name, env in arms]
    if not arms or len(set(labels)) < len(labels):
        p.error(f"argument --arms: {args.arms!r}: name at least one arm, each once")
    for flag, value, least in (("--layers", args.layers, 1), ("--seq", args.seq, 2), ("--top", args.top, 1)):
        if value < least:
            p.error(f"argument {flag}: {value} must be >= {least}")
    if args.tokens < args.seq or args.tokens % args.seq:
        p.error(f"argument --tokens: {args.tokens} is not a positive multiple of --seq {args.seq} (whole sequences)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train, _ = data.load_splits()
    gen = torch.Generator().manual_seed(1234 + args.seed)
    x, _ = data.get_batch(train, args.tokens // args.seq, args.seq, gen, device)

    model = hf_models.build_model(args.model, args.layers, args.dims, device, args.seed)
    top_k = model.config.num_experts_per_tok
    ref_loss, ref = gradients(model, model, False, device, x)
    ref_routing = router_logits(model, False, device, x)
    del model
    losses, errors, routing = {"fp32 eager": ref_loss}, {}, {}
    for (name, env), label in zip(arms, labels, strict=True):
        arm = hf_models.ARMS[name]
        saved = {k: os.environ.get(k) for k in [*env, *dict(arm.env)]}
        os.environ.update({**dict(arm.env), **env})
        try:
            gc.collect()
            torch._dynamo.reset()
            model = hf_models.build_model(args.model, args.layers, args.dims, device, args.seed).to(arm.param_dtype)
            try:
                run = arm.prepare(model, "inductor")
            except Exception as e:  # the arm cannot run here (hf_models says why the same way): name it, go on
                print(f"{label}: could not run: {type(e).__name__}: {e}".splitlines()[0][:300], flush=True)
                continue
            losses[label], grads = gradients(model, run, arm.autocast, device, x)
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
    if not labels:
        raise SystemExit("grad_parity: no arm could run here (each one's reason is above)")
    print(
        f"\n{args.model}, {args.layers} layer(s), {args.dims} dims, {args.tokens} tokens in sequences of {args.seq}, "
        f"seed {args.seed}, {device}"
    )
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
