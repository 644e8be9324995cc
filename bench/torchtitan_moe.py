"""torchtitan's trainer on MoE models (its debug models, or real per-layer shapes): ``--compile.backend inductor``
against ``mxfp8``.

One process per run (``torchrun --standalone --nproc-per-node 1 -m torchtitan.train``), each
block compiled as torchtitan does. Arms: ``inductor`` (BF16), ``mxfp8`` (mxfx's default policy)
and ``fp8_block`` (the mxfp8 backend with ``MXFX_POLICY`` naming a TOML file
``format = "fp8_block"``: torchtitan passes the backend name only, no options).

Works with torchtitan 0.2.2 (torch 2.11; ``--model.name/--model.flavor`` flags; its debug models
use SDPA; it compiles each submodule of a MoE block and the experts' grouped GEMM function on
their own) and 0.3.0 (torch 2.13; ``--module/--config``; plus ``--override.imports
mxfx_overrides.mxfx_model``: SDPA for its default FlexAttention, which torchtitan refuses under a
non-Inductor backend, and full module names; and ``--training.disable_cuda_graphs``, since mxfx
refuses a whole-step CUDA graph capture).

No network needed: a byte-level BPE tokenizer and a small text dataset are generated into a
temporary folder. Prints one table row per run: tokens/s (mean over the logged steps after
the first ``--skip`` ones) and the loss at the last step.

    python bench/torchtitan_moe.py                      # qwen3 (3 arms) + deepseek_v3 (2 arms), 50 steps
    python bench/torchtitan_moe.py --models llama4 --arms inductor,mxfp8 --steps 20   # torchtitan 0.2.2 only

Real per-layer shapes (torchtitan 0.2 only): ``qwen3_30b_a3b`` (Qwen3-30B-A3B: dim 2048, 128 experts top-8
of hidden 768) and ``deepseek_v3_16b`` (torchtitan's DeepSeek-V3 ``16B`` flavor: MLA, a dense first block, 64
experts top-6 of hidden 1408, 2 shared experts), ``--layers`` blocks each, loaded through
``--experimental.custom_import real_shapes`` (``examples/torchtitan/real_shapes.py``). They run at
``--seq-len`` x ``--batch`` tokens a step with ``--ac`` activation checkpointing, and with the generated
tokenizer's vocabulary (``--vocab real``: the models' own, 151936 / 102400, whose output layer then outweighs a
few blocks). Each row also gives the peak reserved memory torchtitan logs and, for the mxfp8 arms, how many
grouped GEMMs (the routed experts') mxfx left in high precision, read from its dump (``MXFX_DUMP_DIR``).

    python bench/torchtitan_moe.py --runs qwen3_30b_a3b:inductor,qwen3_30b_a3b:mxfp8 --steps 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ROOT / "examples" / "torchtitan"
MODELS = {  # torchtitan 0.3: --module, --config; 0.2: --model.name, --model.flavor
    "0.3": {"qwen3": ("qwen3", "qwen3_moe_debug"), "deepseek_v3": ("deepseek_v3", "deepseek_v3_debugmodel")},
    "0.2": {
        "qwen3": ("qwen3", "debugmodel_moe"),
        "deepseek_v3": ("deepseek_v3", "debugmodel"),
        "llama4": ("llama4", "debugmodel"),
    },
}
REAL_SHAPES = ("qwen3_30b_a3b", "deepseek_v3_16b")  # torchtitan 0.2 specs of examples/torchtitan/real_shapes.py
DEFAULT_RUNS = "qwen3:inductor,qwen3:mxfp8,qwen3:fp8_block,deepseek_v3:inductor,deepseek_v3:mxfp8"
ARMS = ("inductor", "mxfp8", "fp8_block")
VOCAB = 2048  # the debug models' vocabulary size
_LINE = re.compile(r"step:\s*(\d+).*?loss:\s*([0-9.naNinf]+).*?tps:\s*([0-9,]+)")
_MEMORY = re.compile(r"step:\s*\d+.*?memory:\s*([0-9.]+)\s*GiB")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def write_assets(folder: Path, docs: int = 2000, seed: int = 0) -> tuple[Path, Path]:
    """A BPE tokenizer (``tokenizer.json``, ``VOCAB`` tokens) and a JSON-lines text dataset, both synthetic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "var", "dex", "pi", "qua", "zo", "ne", "tal", "bru", "ix", "ome"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]  # Zipf-like, so there is something to learn
    texts = [" ".join(rng.choices(words, weights, k=rng.randint(200, 800))) + "." for _ in range(docs)]

    tok_dir, data_dir = folder / "tokenizer", folder / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(
        texts[:500],
        trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": special[0], "eos_token": special[1], "add_bos_token": True, "add_eos_token": True})
    )
    with open(data_dir / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return tok_dir, data_dir


def torchtitan_series() -> str:
    """ "0.2" or "0.3": the installed torchtitan's command-line layout."""
    from importlib.metadata import version

    major, minor = version("torchtitan").split(".")[:2]
    return "0.2" if (int(major), int(minor)) < (0, 3) else "0.3"


def command(
    series: str,
    model: str,
    arm: str,
    steps: int,
    tok_dir: Path,
    data_dir: Path,
    dump: Path,
    extra: list[str],
    real: dict | None = None,
) -> list[str]:
    """The torchrun command line of one run. ``real``: for a ``REAL_SHAPES`` model, its ``layers``, ``vocab``
    (``"real"`` or a size), ``seq_len``, ``batch`` and ``ac`` (activation-checkpoint mode)."""
    backend = "inductor" if arm == "inductor" else "mxfp8"
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "torchtitan.train",
    ]
    common = [
        "--compile.enable",
        "--compile.backend",
        backend,
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
    ]
    if model in REAL_SHAPES:
        if series != "0.2":
            raise SystemExit(f"bench/torchtitan_moe.py: {model} needs torchtitan 0.2 (--experimental.custom_import)")
        vocab = "" if real["vocab"] == "real" else f"_vocab{real['vocab']}"
        return [
            *launch,
            "--experimental.custom_import",
            "real_shapes",
            "--model.name",
            model,
            "--model.flavor",
            f"{real['layers']}layers{vocab}",
            *common,
            "--training.seq_len",
            str(real["seq_len"]),
            "--training.local_batch_size",
            str(real["batch"]),
            "--activation_checkpoint.mode",
            real["ac"],
            "--model.hf_assets_path",
            str(tok_dir),
            "--training.dataset",
            "c4_test",
            "--training.dataset_path",
            str(data_dir),
            "--job.dump_folder",
            str(dump),
            *extra,
        ]
    first, second = MODELS[series][model]
    if series == "0.2":
        return [
            *launch,
            "--model.name",
            first,
            "--model.flavor",
            second,
            *common,
            "--model.hf_assets_path",
            str(tok_dir),
            "--training.dataset",
            "c4_test",
            "--training.dataset_path",
            str(data_dir),
            "--job.dump_folder",
            str(dump),
            *extra,
        ]
    return [
        *launch,
        "--module",
        first,
        "--config",
        second,
        *common,
        "--override.imports",
        "mxfx_overrides.mxfx_model",
        "--training.disable_cuda_graphs",
        "--hf_assets_path",
        str(tok_dir),
        "--dataloader.dataset_path",
        str(data_dir),
        "--dump_folder",
        str(dump),
        *extra,
    ]


def peak_memory(log: str) -> float | None:
    """The largest per-step peak reserved memory (GiB) in torchtitan's metrics lines, None without any."""
    found = [float(x) for x in _MEMORY.findall(_ANSI.sub("", log))]
    return max(found) if found else None


def routed_gemms(dump_dir: Path) -> tuple[int, int] | None:
    """(grouped GEMM records, those whose forward runs in no low-precision format) over every graph mxfx dumped
    into ``dump_dir`` (``graph_NNN/precision.json``); None when mxfx dumped nothing there. The routed experts'
    GEMMs are the models' only grouped GEMMs."""
    from mxfx.report import LOW_PRECISIONS

    files = sorted(dump_dir.glob("graph_*/precision.json"))
    if not files:
        return None
    rows = [r for f in files for r in json.loads(f.read_text())["records"] if r["kind"] == "grouped_mm"]
    kept = [r for r in rows if not any(p in LOW_PRECISIONS for p in r["forward"].split("+"))]
    return len(rows), len(kept)


def parse(log: str, skip: int) -> tuple[float | None, float | None, int]:
    """(mean tokens/s over steps > ``skip``, last loss, last step) from torchtitan's metrics lines."""
    rows = [(int(s), float(loss), float(t.replace(",", ""))) for s, loss, t in _LINE.findall(_ANSI.sub("", log))]
    if not rows:
        return None, None, 0
    tps = [t for s, _, t in rows if s > skip] or [rows[-1][2]]
    return sum(tps) / len(tps), rows[-1][1], rows[-1][0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="model:arm pairs; arms: " + ", ".join(ARMS))
    ap.add_argument("--models", default=None, help="instead of --runs: these models, each with every --arms")
    ap.add_argument("--arms", default=",".join(ARMS), help="with --models: the arms each model runs")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the tokens/s mean (compile, warm-up)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--budget", type=int, default=225, help="seconds for all runs: later runs are skipped past it")
    ap.add_argument("--extra", default="", help="more torchtitan flags for every run, e.g. '--training.seq_len 1024'")
    ap.add_argument("--keep-logs", default=None, help="folder for the runs' logs")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    real = ap.add_argument_group("real-shape models (" + ", ".join(REAL_SHAPES) + "; torchtitan 0.2)")
    real.add_argument("--layers", type=int, default=4, help="transformer blocks")
    real.add_argument("--seq-len", type=int, default=4096)
    real.add_argument("--batch", type=int, default=4, help="sequences per step (--training.local_batch_size)")
    real.add_argument(
        "--ac",
        default="selective",
        choices=("selective", "full", "none"),
        help="--activation_checkpoint.mode (selective: torchtitan's default, every 2nd block)",
    )
    real.add_argument(
        "--vocab", default=str(VOCAB), help=f"'real' (the model's own) or a size >= {VOCAB}, the tokenizer's"
    )
    args = ap.parse_args()
    if args.vocab != "real" and not (args.vocab.isdigit() and int(args.vocab) >= VOCAB):
        ap.error(f"--vocab: 'real' or a size >= {VOCAB} (the generated tokenizer's ids index the embedding)")
    real_cfg = {"layers": args.layers, "vocab": args.vocab, "seq_len": args.seq_len, "batch": args.batch, "ac": args.ac}

    from importlib.metadata import entry_points

    if not any(ep.name == "mxfp8" for ep in entry_points(group="torch_dynamo_backends")):
        sys.exit(
            "bench/torchtitan_moe.py: no 'mxfp8' torch_dynamo_backends entry point (torchtitan looks the backend "
            "up by name); install mxfx first: python -m pip install --no-deps --no-build-isolation -e ."
        )
    work = Path(tempfile.mkdtemp(prefix="mxfx_titan_"))
    tok_dir, data_dir = write_assets(work)
    policy = work / "fp8_block.toml"
    policy.write_text('format = "fp8_block"\n')
    logs = Path(args.keep_logs) if args.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    series = torchtitan_series()
    runs = (
        [(m, a) for m in args.models.split(",") for a in args.arms.split(",")]
        if args.models
        else [tuple(r.split(":")) for r in args.runs.split(",")]
    )
    rows = []
    start = time.time()
    for model, arm in runs:
        row = {
            "model": model,
            "arm": arm,
            "tokens_per_s": None,
            "loss": None,
            "peak_gib": None,
            "routed_gemms": None,
            "routed_gemms_unconverted": None,
            "wall_s": 0.0,
            "status": "skipped (--budget)",
        }
        rows.append(row)
        left = args.budget - (time.time() - start)
        if left < 30:
            continue
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(OVERRIDES), str(ROOT), os.environ.get("PYTHONPATH", "")])
        )
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env.pop("MXFX_POLICY", None)
        env.pop("MXFX_DUMP_DIR", None)
        if arm == "fp8_block":
            env["MXFX_POLICY"] = str(policy)
        dump = work / f"dump_{model}_{arm}"
        if arm != "inductor":  # mxfx's precision maps, read back below
            env["MXFX_DUMP_DIR"] = str(dump / "mxfx")
        cmd = command(series, model, arm, args.steps, tok_dir, data_dir, dump, args.extra.split(), real_cfg)
        t0 = time.time()
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=min(args.timeout, left))
            log, rc = out.stdout + out.stderr, out.returncode
        except subprocess.TimeoutExpired as e:
            log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            rc = "timeout"
        wall = time.time() - t0
        (logs / f"{model}_{arm}.log").write_text(" ".join(cmd) + "\n\n" + log)
        tps, loss, last = parse(log, args.skip)
        status = "ok" if rc == 0 and last == args.steps else f"rc={rc} step={last}"
        if status != "ok":
            tail = [ln for ln in _ANSI.sub("", log).splitlines() if ln.strip()][-3:]
            print(f"[{model} {arm}] {status}:", *tail, sep="\n  ", flush=True)
        gemms = routed_gemms(dump / "mxfx") if arm != "inductor" else None
        row.update(
            tokens_per_s=tps,
            loss=loss,
            peak_gib=peak_memory(log),
            wall_s=wall,
            status=status,
            routed_gemms=gemms[0] if gemms else None,
            routed_gemms_unconverted=gemms[1] if gemms else None,
        )
        print(f"[{model} {arm}] done in {wall:.0f}s", flush=True)

    base = {r["model"]: r["tokens_per_s"] for r in rows if r["arm"] == "inductor" and r["tokens_per_s"]}
    for r in rows:
        r["vs_inductor"] = r["tokens_per_s"] / base[r["model"]] if r["tokens_per_s"] and base.get(r["model"]) else None
    shapes = any(m in REAL_SHAPES for m, _ in runs)
    print(
        f"\ntorchtitan {series} MoE models, {args.steps} steps, one GPU (logs: {logs})"
        + (
            f"; real shapes: {args.layers} layers, {args.batch}x{args.seq_len} tokens a step, AC {args.ac}, "
            f"vocab {args.vocab}"
            if shapes
            else ""
        )
    )
    print(
        f"{'model':<16} {'arm':<10} {'tokens/s':>10} {'vs inductor':>11} {'loss':>8} {'peak GiB':>8} "
        f"{'routed kept':>11} {'wall s':>7}  status"
    )
    for r in rows:
        kept = "-" if r["routed_gemms"] is None else f"{r['routed_gemms_unconverted']}/{r['routed_gemms']}"
        tps, loss, peak, ratio = r["tokens_per_s"], r["loss"], r["peak_gib"], r["vs_inductor"]
        print(
            f"{r['model']:<16} {r['arm']:<10} {(f'{tps:,.0f}' if tps else '-'):>10} "
            f"{(f'{ratio:.2f}x' if ratio else '-'):>11} {(f'{loss:.4f}' if loss is not None else '-'):>8} "
            f"{(f'{peak:.2f}' if peak is not None else '-'):>8} {kept:>11} {r['wall_s']:>7.0f}  {r['status']}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"series": series, "steps": args.steps, "real_shapes": real_cfg, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
