"""Train a small OLMoE-style MoE on real text twice, a high-precision reference vs MXFP8, and compare held-out loss.

    python examples/train_moe.py                         # defaults: a few minutes on 2 CPU cores (see README)
    python examples/train_moe.py --arms fp32             # reference arm only
    python examples/train_moe.py --arms bf16,mxfp8       # the BF16 reference (slow where BF16 is emulated)
    python examples/train_moe.py --device cuda --d-model 1024 --layers 8 --experts 32 --topk 4 \\
        --expert-hidden 512 --seq 1024 --batch 32 --steps 2000
    python examples/train_moe.py --backend-options '{"inner": "aot_eager"}'
    python examples/train_moe.py --format fp8_block       # the backend arm in the Hopper-native FP8 block format

Both arms start from the same initial weights (one seed) and see the same batches
(one data seed), with the same model code, AdamW and clipping in FP32 on FP32
main weights. Arm "mxfp8" is ``torch.compile(model, backend="mxfp8")`` with the
forward under BF16 autocast, in the format of ``--format`` (MXFP8 by default); its
output names it by that format (mxfp8, fp8_block, ...). The reference arm is the
first of the others:

* "fp32" (default): the model in eager PyTorch, FP32 throughout, no autocast and
  no compile. Fast on any CPU (BF16 autocast and Inductor's BF16 code are slow on CPUs without
  AVX512-BF16 or AMX), and no compile to wait for.
* "bf16": ``torch.compile(model)`` (Inductor) under BF16 autocast: the arm that
  differs from "mxfp8" in the backend alone (slow on CPUs that emulate BF16).

With ``--check`` (the default) the script exits non-zero unless the backend
arm's held-out loss is within ``--tolerance`` (5%) of the reference and not
bit-identical to it, both arms end below 0.8x the untrained model's held-out
loss, and the backend rewrote ops to its format.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

try:
    import mxfx  # the mxfp8 backend's policy, formats and precision maps; the reference arms run without it
except ImportError:
    mxfx = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import VOCAB_SIZE, get_batch, load_splits  # noqa: E402
from moe_model import MoEConfig, MoETransformer  # noqa: E402


# ----------------------------------------------------------------------------- configuration
def option(default, help: str, at_least=None, at_most=None, above=None):
    """A :class:`TrainConfig` field that is also a command-line option: its ``--help`` line and its bounds (inclusive
    ``at_least`` / ``at_most``, exclusive ``above``; None: unbounded)."""
    return dataclasses.field(
        default=default, metadata={"help": help, "at_least": at_least, "at_most": at_most, "above": above}
    )


SEED_MAX = 2**63 - 2  # torch.Generator.manual_seed takes up to 2**64 - 1; the held-out batches use data_seed + 1


@dataclass
class TrainConfig:
    # model
    d_model: int = option(128, "model width (features of every residual stream)", at_least=1)
    layers: int = option(2, "transformer blocks", at_least=1)
    experts: int = option(8, "routed experts per MoE layer", at_least=1)
    topk: int = option(2, "routed experts per token", at_least=1)
    expert_hidden: int = option(128, "hidden features of each routed expert", at_least=1)
    shared_hidden: int = option(128, "hidden features of the shared expert", at_least=1)
    head_dim: int = option(32, "features per attention head", at_least=1)
    # data
    data: str | None = option(None, "UTF-8 text file to train on; None: the interpreter's .py sources + pydoc topics")
    seq: int = option(128, "tokens (bytes) per sequence", at_least=1)
    batch: int = option(16, "sequences per step", at_least=1)
    # optimisation
    steps: int = option(100, "optimizer steps per arm", at_least=1)
    # 3e-3 was at the edge of stability: run-to-run held-out spread of ~4% even for BF16 alone
    lr: float = option(1.5e-3, "peak learning rate (AdamW)", above=0)
    min_lr_frac: float = option(0.1, "cosine decay ends at lr * min-lr-frac", at_least=0, at_most=1)
    warmup: int = option(20, "linear warmup steps", at_least=0)
    weight_decay: float = option(0.1, "AdamW weight decay, on matrices only", at_least=0)
    grad_clip: float = option(1.0, "max gradient norm", above=0)
    # run
    arms: str = option("fp32,mxfp8", "comma-separated arms: mxfp8 (the backend) and/or one reference, fp32 or bf16")
    backend_options: str | None = option(None, "JSON object passed as options= to the mxfp8 compile")
    format: str = option("mxfp8", 'format of the mxfp8 (backend) arm; a "format" in --backend-options wins')
    device: str = option("cpu", "torch device to train on, e.g. cpu or cuda")
    seed: int = option(1337, "seed of the initial weights (the same in every arm)", at_least=0, at_most=SEED_MAX)
    data_seed: int = option(0, "seed of the batch order (the same in every arm)", at_least=0, at_most=SEED_MAX)
    eval_batches: int = option(8, "held-out batches per evaluation", at_least=1)
    log_every: int = option(25, "print the loss every this many steps", at_least=1)
    out: str = option("runs", "folder for moe_loss.png and moe_results.json")
    check: bool = option(True, "exit non-zero unless the checks above pass")
    # Two mxfp8 runs of this job in two processes ended 3.4% apart (2.4707 vs 2.3897, the reference 2.3981):
    # last-bit differences of multithreaded CPU reductions (not run-to-run deterministic, within one process too;
    # from step 3 on) that 100 steps of training amplify; 3% failed one fresh run
    tolerance: float = option(
        0.05,
        "max relative held-out loss gap, backend arm vs reference arm (a fraction, e.g. 0.05)",
        at_least=0,
        at_most=1,
    )
    trained_frac: float = option(
        0.8, "each arm must end below this fraction of the untrained held-out loss", above=0, at_most=1
    )


MODEL_FIELDS = {  # MoEConfig field: the TrainConfig field (and so the flag) that sets it
    "d_model": "d_model",
    "n_layers": "layers",
    "head_dim": "head_dim",
    "n_experts": "experts",
    "top_k": "topk",
    "expert_hidden": "expert_hidden",
    "shared_hidden": "shared_hidden",
    "max_seq": "seq",
}
BACKEND_WIDTHS = ("d_model", "expert_hidden", "shared_hidden")  # the in/out features of the GEMMs the backend converts


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: the module docstring as written, then every option with its default."""


def flag(name: str) -> str:
    """The command-line flag of a :class:`TrainConfig` field."""
    return "--" + name.replace("_", "-")


def bounded(kind: type, at_least=None, at_most=None, above=None):
    """An argparse ``type``: ``kind(text)``, refused outside its bounds (None: unbounded) and, for a float, unless
    finite."""

    def parse(text: str):
        value = kind(text)
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be >= {at_least}, got {value}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be <= {at_most}, got {value}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be > {above}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """One option per :class:`TrainConfig` field, with its help line and default; ``--format`` lists mxfx's formats
    (any value where mxfx is not importable: the backend arm then fails as missing)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        if f.type == "bool":
            p.add_argument(
                flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
            )
            continue
        bounds = {k: f.metadata[k] for k in ("at_least", "at_most", "above")}
        kind = bounded({"int": int, "float": float}.get(f.type, str), **bounds)
        choices = mxfx.formats.CHOICES if f.name == "format" and mxfx is not None else None
        p.add_argument(flag(f.name), type=kind, default=f.default, choices=choices, help=f.metadata["help"])
    return p


def arm_names(cfg: TrainConfig) -> list[str]:
    """The arms of ``--arms``, in order."""
    return [a.strip() for a in cfg.arms.split(",") if a.strip()]


def model_config(cfg: TrainConfig) -> MoEConfig:
    """The model of this run. Raises MoEConfig's ValueError ("<field>=<value> must be ...") on widths it refuses."""
    return MoEConfig(vocab_size=VOCAB_SIZE, **{k: getattr(cfg, v) for k, v in MODEL_FIELDS.items()})


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    """``p.error`` unless ``device`` names a cpu or cuda device that works here (``--device``)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        p.error(f"argument --device: {device!r}: this job trains on cpu or cuda (e.g. cuda:0); use --device cpu")
    try:
        torch.empty(0, device=device)
    except Exception as e:  # noqa: BLE001  (CUDA not built, no GPU, no such index: torch says which)
        p.error(f"argument --device: {device!r} is not usable here ({str(e).splitlines()[0]}); use --device cpu")


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> TrainConfig:
    """The run's config from ``argv`` (default ``sys.argv[1:]``), checked before anything trains: a bad value ends
    in ``p.error``, naming its flag and what to do (exit status 2, no traceback)."""
    cfg = TrainConfig(**vars(p.parse_args(argv)))
    arms = arm_names(cfg)
    if not arms or set(arms) - set(ARMS) or sum(a != "mxfp8" for a in arms) > 1 or len(set(arms)) < len(arms):
        p.error(
            f"argument --arms: {cfg.arms!r}: expected mxfp8 and/or one reference arm (fp32 or bf16), comma-separated"
        )
    try:
        model_config(cfg)
    except ValueError as e:
        field = MODEL_FIELDS.get(str(e).partition("=")[0])
        p.error(f"argument {flag(field)}: {e}" if field else str(e))
    if cfg.data is not None and not os.path.isfile(cfg.data):
        p.error(
            f"argument --data: {cfg.data!r} is not a file; name a UTF-8 text file, or leave --data out to train on "
            "the interpreter's own .py sources and pydoc topics"
        )
    check_device(p, cfg.device)
    if "mxfp8" in arms:
        check_backend(p, cfg)
    return cfg


# ----------------------------------------------------------------------------- helpers
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``lr * min_lr_frac``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


ARMS = {
    "fp32": "FP32 eager PyTorch, no autocast, no compile",
    "bf16": "torch.compile (Inductor) under BF16 autocast",
    "mxfp8": 'torch.compile(backend="mxfp8") under BF16 autocast',
}


def evaluate(model, batches, device: str, autocast: bool) -> float:
    """Mean held-out loss over a fixed list of batches.

    Grad stays enabled (nothing is backpropagated): a compiled model then runs the graph it
    trained with, where ``torch.no_grad()`` would compile a second, forward-only graph.
    """
    losses = []
    for x, y in batches:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        losses.append(loss.detach().float().item())
    return sum(losses) / len(losses)


def compile_arm(model, arm: str, cfg: TrainConfig):
    """How each arm runs the same model: eager FP32, Inductor, or the mxfp8 backend."""
    if arm == "fp32":
        return model
    if arm == "bf16":
        return torch.compile(model)
    return torch.compile(model, backend="mxfp8", options=backend_options(cfg))


def backend_options(cfg: TrainConfig) -> dict:
    """The mxfp8 arm's ``options=``: ``--backend-options`` with ``--format`` as its default format."""
    options = json.loads(cfg.backend_options) if cfg.backend_options else {}
    return {"format": cfg.format, **options} if isinstance(options, dict) else options


def backend_format(cfg: TrainConfig) -> mxfx.formats.Format:
    """The format the mxfp8 arm's policy runs: the "format" of :func:`backend_options`, resolved as the backend
    resolves it ("auto": the format native on the current device)."""
    return mxfx.formats.get(mxfx.Policy.from_options(backend_options(cfg)).format)


def arm_label(arm: str, cfg: TrainConfig) -> str:
    """The name an arm's lines, table row, plot and results go by: the reference arm's own; the backend arm's
    format (mxfp8, fp8_block, ...)."""
    return backend_format(cfg).name if arm == "mxfp8" else arm


def check_backend(p: argparse.ArgumentParser, cfg: TrainConfig):
    """Fail before any training (``p.error``) if the mxfp8 backend cannot be found, its options do not parse, or
    the model's widths do not fit its format."""
    try:
        torch._dynamo.lookup_backend("mxfp8")
    except Exception as e:
        p.error(
            f"torch.compile backend 'mxfp8' is not available ({type(e).__name__}: {e}).\n"
            "Install mxfx so its entry point registers the backend (pip install -e .), "
            "or run the reference arm alone with --arms fp32."
        )
    try:
        options = backend_options(cfg)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        p.error(f"argument --backend-options: must be a JSON object, got {cfg.backend_options!r}")
    try:  # unknown keys and values fail here, not after the reference arm has trained
        fmt = backend_format(cfg)
    except (TypeError, ValueError) as e:
        p.error(f"argument {'--backend-options' if cfg.backend_options else '--format'}: {e}")
    m = fmt.feature_multiple
    for name in BACKEND_WIDTHS:
        width = getattr(cfg, name)
        if width % m:
            p.error(
                f"argument {flag(name)}: {width} is not a multiple of {m} ({fmt.feature_multiple_source}), so "
                f"format {fmt.name} would keep every GEMM of that width as written; use a multiple of {m} such as "
                f"{m * max(1, round(width / m))}, or another --format"
            )


def train_arm(arm: str, tag: str, init_state, model_cfg, train_data, eval_set, cfg: TrainConfig) -> dict:
    """Train one arm from ``init_state`` on the seeded batch stream; return its curves and numbers.

    ``tag``: the arm's label (:func:`arm_label`), padded so that the arms' lines align; the results name the arm by
    its label."""
    torch._dynamo.reset()  # each arm compiles from scratch, so compile times are comparable
    device, dev_type = cfg.device, torch.device(cfg.device).type
    model = MoETransformer(model_cfg).to(device)
    model.load_state_dict(init_state)
    compiled = compile_arm(model, arm, cfg)

    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(cfg.data_seed)  # same batches in every arm
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    autocast = arm != "fp32"
    losses, step_times = [], []

    def train_step(step: int) -> None:
        x, y = get_batch(train_data, cfg.batch, cfg.seq, gen, device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # also synchronises, so the step time is honest
        step_times.append(time.perf_counter() - t0)
        if not math.isfinite(losses[-1]):
            sys.exit(f"error: arm {tag.strip()} loss is {losses[-1]} at step {step}")
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            tqdm.write(
                f"{tag} step {step:4d}  loss {losses[-1]:.4f}  lr {lr_at(step, cfg):.2e}  "
                f"{step_times[-1] * 1e3:7.0f} ms"
            )

    # Step 0 compiles (not for the eager arm): on its own line, so the bar's rate and ETA are of steady steps.
    print(f"{tag}: {ARMS[arm]}; step 0{'' if arm == 'fp32' else ', compiling...'}", flush=True)
    train_step(0)
    bar = tqdm(range(1, cfg.steps), desc=tag, dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        train_step(step)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()

    t0 = time.perf_counter()
    eval_loss = evaluate(compiled, eval_set, device, autocast)
    eval_s = time.perf_counter() - t0

    timed = step_times[1:]  # step 0 includes compilation
    tokens_per_s = cfg.batch * cfg.seq * len(timed) / sum(timed) if timed else None  # one step: compile only
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if dev_type == "cuda" else f"n/a ({dev_type.upper()})"
    return dict(
        arm=tag.strip(),
        losses=losses,
        final_train=sum(losses[-10:]) / len(losses[-10:]),
        eval_loss=eval_loss,
        tokens_per_s=tokens_per_s,
        peak_mem=peak,
        compile_s=step_times[0],
        eval_s=eval_s,
    )


def plot(results, untrained, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        (line,) = ax.plot(r["losses"], lw=0.8, alpha=0.8, label=f"{r['arm']} train")
        ax.axhline(
            r["eval_loss"], color=line.get_color(), ls="--", lw=1, label=f"{r['arm']} held-out {r['eval_loss']:.3f}"
        )
    ax.axhline(untrained, color="gray", ls=":", lw=1, label=f"untrained held-out {untrained:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"MoE byte-level LM: {' vs '.join(r['arm'].upper() for r in results)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_data(p: argparse.ArgumentParser, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tokens of ``--data``; ``p.error`` where the file is not UTF-8 or a split is not
    longer than one sequence and its target (``--seq`` + 1 bytes)."""
    try:
        train_data, val_data = load_splits(cfg.data)
    except UnicodeDecodeError as e:
        p.error(f"argument --data: {cfg.data!r} is not UTF-8 text ({e}); convert it to UTF-8")
    if min(len(train_data), len(val_data)) <= cfg.seq + 1:
        p.error(
            f"argument --seq: {cfg.seq} needs more than {cfg.seq + 1} bytes in each split, but "
            f"{cfg.data or 'the default text'} splits into {len(train_data)} train / {len(val_data)} held-out bytes; "
            "use a smaller --seq or a longer --data file"
        )
    return train_data, val_data


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None):
    p = build_parser()
    cfg = parse_args(p, argv)
    arms = arm_names(cfg)
    labels = {arm: arm_label(arm, cfg) for arm in arms}
    width = max(map(len, labels.values()))
    try:
        os.makedirs(cfg.out, exist_ok=True)
    except OSError as e:
        p.error(f"argument --out: cannot make the folder {cfg.out!r} ({e}); name a folder")
    t_start = time.perf_counter()

    train_data, val_data = load_data(p, cfg)
    print(
        f"data: {cfg.data or 'stdlib .py sources + pydoc topics'}: "
        f"{len(train_data) / 1e6:.2f} MB train, {len(val_data) / 1e6:.2f} MB held-out (byte tokens)"
    )
    eval_gen = torch.Generator().manual_seed(cfg.data_seed + 1)
    eval_set = [get_batch(val_data, cfg.batch, cfg.seq, eval_gen, cfg.device) for _ in range(cfg.eval_batches)]

    model_cfg = model_config(cfg)
    torch.manual_seed(cfg.seed)
    model = MoETransformer(model_cfg).to(cfg.device)
    init_state = copy.deepcopy(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in (b.moe for b in model.layers))
    n_active = n_params - n_expert + n_expert * cfg.topk // cfg.experts
    print(f"model: {model_cfg}")
    print(
        f"params: {n_params / 1e6:.2f}M total, {n_active / 1e6:.2f}M active per token; "
        f"{cfg.steps} steps x {cfg.batch}x{cfg.seq} tokens on {cfg.device} ({torch.get_num_threads()} threads)"
    )
    with torch.no_grad():
        untrained = evaluate(model, eval_set, cfg.device, autocast=False)  # eager FP32, once: both arms start here
    print(f"untrained held-out loss: {untrained:.4f} (uniform over 256 bytes: {math.log(VOCAB_SIZE):.4f})")
    del model

    tags = {arm: label.rjust(width) for arm, label in labels.items()}
    results = [train_arm(arm, tags[arm], init_state, model_cfg, train_data, eval_set, cfg) for arm in arms]

    reference = next((a for a in arms if a != "mxfp8"), None)
    if reference:
        print(f"\nreference arm: {reference} ({ARMS[reference]})")
    print(
        "tokens/s excludes step 0 (compilation); 'compile s' is the wall time of step 0; "
        "held-out loss is through each arm's trained model (its training graph, grad enabled, no backward)"
    )
    header = f"{'arm':<{width}} {'train loss':>10} {'held-out':>9} {'tokens/s':>9} {'peak mem':>12} {'compile s':>9}"
    print(header + "\n" + "-" * len(header))
    for r in results:
        print(
            f"{r['arm']:<{width}} {r['final_train']:>10.4f} {r['eval_loss']:>9.4f} "
            f"{'-' if r['tokens_per_s'] is None else format(r['tokens_per_s'], '.0f'):>9} "
            f"{r['peak_mem']:>12} {r['compile_s']:>9.1f}"
        )
    print(f"(train loss: mean of the last 10 steps; untrained held-out {untrained:.4f})")

    failures = []
    by_arm = dict(zip(arms, results))
    backend = labels.get("mxfp8")  # the backend arm's format
    if reference and backend:
        ref, mx = by_arm[reference], by_arm["mxfp8"]
        gap = (mx["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        print(f"{backend} vs {reference} (reference) held-out loss: {gap:+.2%} (tolerance {cfg.tolerance:.2%})")
        if abs(gap) > cfg.tolerance:
            failures.append(f"{backend} held-out loss is {gap:+.2%} from {reference}, beyond {cfg.tolerance:.2%}")
        if mx["losses"] == ref["losses"] and mx["eval_loss"] == ref["eval_loss"]:
            failures.append(f"{backend} and {reference} losses are bit-identical: the mxfp8 backend changed nothing")
    if backend:
        reports = mxfx.all_reports()  # the backend's precision maps: which GEMMs it rewrote, per compiled graph
        for pm in reports:
            print(f"mxfx {pm.summary()}")
        if not any(pm.count(rewritten=True) for pm in reports):
            failures.append(f"the mxfp8 backend rewrote no op to {backend} (see the precision maps above)")
        # the formats the maps show (a rule may give ops another format than the policy's)
        seen = {f for pm in reports for k in ("linear", "grouped_mm") for f in pm.formats(k).split("+")} - {"rewritten"}
        converted_to = "+".join(sorted(seen)) or backend
    limit = cfg.trained_frac * untrained
    below = all(r["eval_loss"] < limit for r in results)
    print(
        f"{'both arms' if len(results) > 1 else 'the arm'} clearly below the untrained loss "
        f"(< {cfg.trained_frac} x {untrained:.3f} = {limit:.3f}): {'yes' if below else 'NO'}"
    )
    if not below:
        failures.append(
            f"held-out loss not below {limit:.3f}: " + ", ".join(f"{r['arm']} {r['eval_loss']:.3f}" for r in results)
        )

    plot(results, untrained, os.path.join(cfg.out, "moe_loss.png"))
    with open(os.path.join(cfg.out, "moe_results.json"), "w") as f:
        json.dump(dict(config=dataclasses.asdict(cfg), untrained_eval_loss=untrained, results=results), f, indent=1)
    load = (
        " (load average %.1f / %.1f / %.1f over 1 / 5 / 15 min)" % os.getloadavg() if hasattr(os, "getloadavg") else ""
    )
    print(
        f"wrote {cfg.out}/moe_loss.png and {cfg.out}/moe_results.json; "
        f"total wall time {time.perf_counter() - t_start:.0f} s{load}"
    )

    if cfg.check and failures:
        sys.exit("check failed:\n  " + "\n  ".join(failures))
    if cfg.check:
        passed = []
        if reference and backend:
            passed.append(f"{backend} within tolerance of the {reference} arm and not identical")
        passed.append(f"{'both arms' if len(results) > 1 else 'the arm'} below {cfg.trained_frac}x untrained")
        if backend:
            passed.append(f"ops rewritten to {converted_to}")
        print("checks passed: " + ", ".join(passed))


if __name__ == "__main__":
    main()
