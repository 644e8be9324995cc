"""Scale-rule study (the recipe, "Scale Selection Is a Training Recipe", Figure 56): one floor-trained checkpoint, three
continuations.

    python examples/scale_rule_study.py                      # CPU, toy model, < 3 minutes
    python examples/scale_rule_study.py --device cuda --d-model 1024 --layers 8 --experts 32 --topk 4 \\
        --expert-hidden 512 --seq 1024 --batch 32 --pre-steps 2000 --steps 1000

1. Train the main job's model (``examples/moe_model.py``) with
   ``backend="mxfp8"`` and OCP **floor** scaling for ``--pre-steps`` steps: the
   common checkpoint (model + AdamW state).
2. Continue from it for ``--steps`` steps on the same batches in three branches:
   **bf16** (plain compile), **mxfp8 rceil**, **mxfp8 floor**.
3. Report, for each MX branch vs BF16 over the continuation, the mean loss
   difference and the mean gradient-norm difference (relative, the pre-clip
   global norm), plot the three curves, and say whether the direction of the
   recipe's result reproduces: there rceil was +0.00048 loss / -1.9% grad norm from
   BF16 and floor +0.022 / +51% (a 166.72B-total MoE, 1,178 steps).
4. Per layer, the quantization statistics of the MX branches (``Policy.stats``, sampled every
   ``--stats-every`` optimizer steps; ``docs/numerics.md``): the worst site's clipped and underflow fractions
   and the mean relative RMS error, printed per layer and plotted over the steps, so the two rules' clipping
   (floor cuts block maxima above 448 x scale; rceil never does) shows next to their loss.

FP32 parameters, BF16 autocast, AdamW, clipping at 1.0, as in ``train_moe.py``.
On CPU the compiles use ``aot_eager`` (``--compiler``) to keep the run short;
numerics are the same ops either way.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings

import torch

import mxfx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import VOCAB_SIZE, get_batch, load_splits  # noqa: E402
from moe_model import MoEConfig, MoETransformer  # noqa: E402
from train_moe import SEED_MAX, bounded, check_device  # noqa: E402

SEED_RESULT = {"rceil": (0.00048, -1.9), "floor": (0.022, 51.1)}  # (mean loss diff, mean grad-norm diff %) vs BF16


def parse_args(argv: list[str] | None = None):
    """The study's options and its model's config, checked before anything trains: a bad value ends in ``p.error``
    naming its flag."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    count, positive = bounded(int, at_least=1), bounded(float, above=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=count, default=128)
    p.add_argument("--layers", type=count, default=2)
    p.add_argument("--experts", type=count, default=8)
    p.add_argument("--topk", type=count, default=2)
    p.add_argument("--expert-hidden", type=count, default=128)
    p.add_argument("--shared-hidden", type=count, default=128)
    p.add_argument("--head-dim", type=count, default=32)
    p.add_argument("--seq", type=count, default=128)
    p.add_argument("--batch", type=count, default=16)
    p.add_argument("--pre-steps", type=count, default=80, help="floor-scaled steps to the common checkpoint")
    p.add_argument("--steps", type=count, default=40, help="continuation steps per branch")
    p.add_argument("--lr", type=positive, default=1.5e-3)
    p.add_argument("--warmup", type=bounded(int, at_least=0), default=10)
    p.add_argument("--grad-clip", type=positive, default=1.0)
    p.add_argument("--compiler", default=None, help="inner compiler (default: aot_eager on CPU, inductor on CUDA)")
    p.add_argument(
        "--stats-every",
        type=bounded(int, at_least=0),
        default=5,
        help="quantization statistics of the MX branches every this many steps (0: off)",
    )
    seed = bounded(int, at_least=0, at_most=SEED_MAX)
    p.add_argument("--seed", type=seed, default=1337)
    p.add_argument("--data-seed", type=seed, default=0)
    p.add_argument("--out", default="runs/scale_rule_study")
    a = p.parse_args(argv)
    check_device(p, a.device)
    try:
        model = MoEConfig(
            vocab_size=VOCAB_SIZE,
            d_model=a.d_model,
            n_layers=a.layers,
            head_dim=a.head_dim,
            n_experts=a.experts,
            top_k=a.topk,
            expert_hidden=a.expert_hidden,
            shared_hidden=a.shared_hidden,
            max_seq=a.seq,
        )
    except ValueError as e:
        p.error(str(e))
    a.compiler = a.compiler or ("inductor" if torch.device(a.device).type == "cuda" else "aot_eager")
    return a, model


def compile_branch(model, branch: str, a, stats: bool = False):
    if branch == "bf16":
        return torch.compile(model, backend=a.compiler)
    rule = branch.split()[-1]
    options = {"scale_rule": rule, "inner": a.compiler}
    if stats and a.stats_every:
        options["stats"] = {"every": a.stats_every}
    return torch.compile(model, backend="mxfp8", options=options)


def layer_of(site: str) -> str:
    """``layers.0.attn.qkv/linear/forward_x`` -> ``layers.0``: the block a quantize site belongs to."""
    parts = site.split("/")[0].split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def new_samples(seen: dict, step: int) -> list[dict]:
    """The samples of ``mxfx.stats()`` not seen yet (each site's latest), tagged with the study's ``step``."""
    out = []
    for r in mxfx.stats().rows:
        if seen.get(r.site) != r.last["step"]:
            seen[r.site] = r.last["step"]
            out.append(
                {
                    "step": step,
                    "site": r.site,
                    "layer": layer_of(r.site),
                    "clipped": r.last["clipped"],
                    "underflow": r.last["underflow"],
                    "saturation": r.last["saturation"],
                    "rms_error": r.last["rms_error"],
                    "scale_exp_min": r.last["scale_exp_min"],
                    "scale_exp_max": r.last["scale_exp_max"],
                }
            )
    return out


def per_layer(samples: list[dict]) -> dict:
    """Per layer and sampled step: the worst site's clipped and underflow fractions and the mean RMS error."""
    out: dict = {}
    for s in samples:
        cell = out.setdefault(s["layer"], {}).setdefault(s["step"], {"clipped": 0.0, "underflow": 0.0, "rms": []})
        cell["clipped"] = max(cell["clipped"], s["clipped"])
        cell["underflow"] = max(cell["underflow"], s["underflow"])
        cell["rms"].append(s["rms_error"])
    return {
        layer: {
            step: {"clipped": c["clipped"], "underflow": c["underflow"], "rms_error": sum(c["rms"]) / len(c["rms"])}
            for step, c in sorted(steps.items())
        }
        for layer, steps in sorted(out.items())
    }


def make_opt(model, lr):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lr_at(step: int, total: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, total - 1 - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(branch, mcfg, state, opt_state, data, first_step, total, a, label, stats=False):
    """Run ``branch`` from ``state`` over ``data``; returns (losses, grad norms, final model state, opt state,
    quantization samples: one dict per site and sampled step, with ``stats``)."""
    torch._dynamo.reset()
    mxfx.reset_stats()
    model = MoETransformer(mcfg).to(a.device)
    model.load_state_dict(state)
    opt = make_opt(model, a.lr)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    compiled = compile_branch(model, branch, a, stats)
    dev_type = torch.device(a.device).type
    losses, norms, samples, seen = [], [], [], {}
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = lr_at(first_step + i, total, a)
        with torch.autocast(dev_type, dtype=torch.bfloat16):
            _, loss = compiled(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip).item())
        opt.step()  # reads the step's quantization samples back, if it was sampled
        opt.zero_grad(set_to_none=True)
        if stats:
            samples += new_samples(seen, first_step + i)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            sys.exit(f"error: {label} loss is {losses[-1]} at step {first_step + i}")
    print(
        f"{label:>22}: {len(data)} steps in {time.perf_counter() - t0:.0f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        flush=True,
    )
    return losses, norms, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), samples


def plot(curves, pre, path, layers=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = layers or {}
    rows = 4 if layers else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.5 * rows), sharex=True)
    ax1, ax2 = axes[0], axes[1]
    x = list(range(pre, pre + len(next(iter(curves.values()))["loss"])))
    for name, c in curves.items():
        ax1.plot(x, c["loss"], lw=1, label=name)
        ax2.plot(x, c["grad_norm"], lw=1, label=name)
    ax1.set_ylabel("train loss")
    ax2.set_ylabel("grad norm (pre-clip)")
    ax1.legend()
    if layers:
        colours = {name: f"C{i}" for i, name in enumerate(curves)}
        styles = ["-", "--", ":", "-."]
        for branch, per in layers.items():
            for j, (layer, steps) in enumerate(per.items()):
                xs = list(steps)
                kw = dict(
                    color=colours.get(branch), ls=styles[j % len(styles)], marker=".", lw=1, label=f"{branch} {layer}"
                )
                axes[2].plot(xs, [100 * v["clipped"] for v in steps.values()], **kw)
                axes[3].plot(xs, [100 * v["underflow"] for v in steps.values()], **kw)
        axes[2].set_ylabel("clipped % (worst site)")
        axes[3].set_ylabel("underflow % (worst site)")
        axes[2].legend(fontsize=7, ncol=2)
    axes[-1].set_xlabel("step (continuation from the floor-trained checkpoint)")
    ax1.set_title(
        "One floor-trained checkpoint, three continuations "
        "(an analogue of the recipe's Fig. 56, 'Scale Selection Is a Training Recipe')"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    a, mcfg = parse_args()
    # floor clips block maxima at many sites: the per-layer table below reports them, one warning each is noise here
    warnings.filterwarnings("ignore", message="mxfx: quantize site")
    t_start = time.perf_counter()
    train_data, _ = load_splits()
    gen = torch.Generator().manual_seed(a.data_seed)
    pre_data = [get_batch(train_data, a.batch, a.seq, gen, a.device) for _ in range(a.pre_steps)]
    cont_data = [get_batch(train_data, a.batch, a.seq, gen, a.device) for _ in range(a.steps)]  # same for every branch
    total = a.pre_steps + a.steps
    torch.manual_seed(a.seed)
    init = MoETransformer(mcfg).state_dict()
    print(
        f"model: {mcfg}\n{a.pre_steps} floor steps to the checkpoint, then {a.steps} steps per branch, "
        f"batch {a.batch}x{a.seq}, device {a.device}, compiler {a.compiler}"
    )

    _, _, ckpt, ckpt_opt, _ = train("mxfp8 floor", mcfg, init, None, pre_data, 0, total, a, "checkpoint (mxfp8 floor)")
    curves, samples = {}, {}
    for branch in ("bf16", "mxfp8 rceil", "mxfp8 floor"):
        losses, norms, _, _, found = train(
            branch, mcfg, ckpt, ckpt_opt, cont_data, a.pre_steps, total, a, branch, stats=branch != "bf16"
        )
        curves[branch] = {"loss": losses, "grad_norm": norms}
        if found:
            samples[branch] = found
    layers = {branch: per_layer(found) for branch, found in samples.items()}

    ref = curves["bf16"]
    summary = {}
    lines = [
        "",
        f"continuation of {a.steps} steps from the floor-trained checkpoint at step {a.pre_steps}, vs BF16:",
        "| branch | mean loss diff | mean grad-norm diff | OLMo MXFP8 recipe (166.72B MoE) |",
        "|---|---|---|---|",
    ]
    for rule in ("rceil", "floor"):
        c = curves[f"mxfp8 {rule}"]
        dl = sum(u - v for u, v in zip(c["loss"], ref["loss"])) / len(ref["loss"])
        dn = (sum(c["grad_norm"]) / sum(ref["grad_norm"]) - 1) * 100
        summary[rule] = {"mean_loss_diff": dl, "mean_grad_norm_diff_pct": dn}
        sl, sn = SEED_RESULT[rule]
        lines.append(f"| mxfp8 {rule} | {dl:+.5f} | {dn:+.1f}% | {sl:+.5f} / {sn:+.1f}% |")
    r, f = summary["rceil"], summary["floor"]
    direction = {
        "floor loss above BF16": f["mean_loss_diff"] > 0,
        "floor further from BF16 in loss than rceil": abs(f["mean_loss_diff"]) > abs(r["mean_loss_diff"]),
        "floor grad norm above BF16": f["mean_grad_norm_diff_pct"] > 0,
        "floor further from BF16 in grad norm than rceil": abs(f["mean_grad_norm_diff_pct"])
        > abs(r["mean_grad_norm_diff_pct"]),
    }
    lines.append("")
    for k, v in direction.items():
        lines.append(f"  {k}: {'yes' if v else 'no'}")
    verdict = (
        "reproduces"
        if all(direction.values())
        else ("partly reproduces" if any(direction.values()) else "does not reproduce")
    )
    lines.append(
        f"direction of the recipe's result (rceil tracks BF16, floor degrades loss and inflates grad norm): {verdict} "
        f"at this scale ({a.steps} steps; toy runs are noisy: treat as a smoke test of the experiment, not evidence)"
    )
    if layers:
        lines += [
            "",
            f"quantization statistics per layer, sampled every {a.stats_every} steps (mean over the samples of "
            f"the worst site's fraction; rms error: mean over sites; docs/numerics.md):",
            "| branch | layer | clipped | underflow | rms error | samples |",
            "|---|---|---|---|---|---|",
        ]
        for branch, per in layers.items():
            for layer, steps in per.items():
                n = len(steps)
                mean = lambda k: sum(v[k] for v in steps.values()) / n  # noqa: E731
                lines.append(
                    f"| {branch} | {layer} | {mean('clipped'):.3%} | {mean('underflow'):.3%} | "
                    f"{mean('rms_error'):.3e} | {n} |"
                )
    text = "\n".join(lines)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    plot(curves, a.pre_steps, os.path.join(a.out, "scale_rule_study.png"), layers)
    with open(os.path.join(a.out, "scale_rule_study.json"), "w") as fh:
        json.dump(
            dict(
                args=vars(a),
                curves=curves,
                summary=summary,
                direction=direction,
                verdict=verdict,
                stats=samples,
                stats_per_layer=layers,
            ),
            fh,
            indent=1,
        )
    print(f"wrote {a.out}/scale_rule_study.png and .json; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
