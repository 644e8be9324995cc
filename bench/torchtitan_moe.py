"""torchtitan's trainer on its MoE debug models: ``--compile.backend inductor`` against ``mxfp8``.

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
    "0.2": {"qwen3": ("qwen3", "debugmodel_moe"), "deepseek_v3": ("deepseek_v3", "debugmodel"),
            "llama4": ("llama4", "debugmodel")},
}
DEFAULT_RUNS = "qwen3:inductor,qwen3:mxfp8,qwen3:fp8_block,deepseek_v3:inductor,deepseek_v3:mxfp8"
ARMS = ("inductor", "mxfp8", "fp8_block")
VOCAB = 2048  # the debug models' vocabulary size
_LINE = re.compile(r"step:\s*(\d+).*?loss:\s*([0-9.naNinf]+).*?tps:\s*([0-9,]+)")
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
    tok.train_from_iterator(texts[:500], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": special[0], "eos_token": special[1], "add_bos_token": True, "add_eos_token": True}))
    with open(data_dir / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return tok_dir, data_dir


def torchtitan_series() -> str:
    """"0.2" or "0.3": the installed torchtitan's command-line layout."""
    from importlib.metadata import version

    major, minor = version("torchtitan").split(".")[:2]
    return "0.2" if (int(major), int(minor)) < (0, 3) else "0.3"


def command(series: str, model: str, arm: str, steps: int, tok_dir: Path, data_dir: Path, dump: Path,
            extra: list[str]) -> list[str]:
    backend = "inductor" if arm == "inductor" else "mxfp8"
    first, second = MODELS[series][model]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "torchtitan.train"]
    common = ["--compile.enable", "--compile.backend", backend, "--training.steps", str(steps), "--metrics.log_freq", "1"]
    if series == "0.2":
        return [*launch, "--model.name", first, "--model.flavor", second, *common,
                "--model.hf_assets_path", str(tok_dir), "--training.dataset", "c4_test",
                "--training.dataset_path", str(data_dir), "--job.dump_folder", str(dump), *extra]
    return [*launch, "--module", first, "--config", second, *common,
            "--override.imports", "mxfx_overrides.mxfx_model", "--training.disable_cuda_graphs",
            "--hf_assets_path", str(tok_dir), "--dataloader.dataset_path", str(data_dir),
            "--dump_folder", str(dump), *extra]


def parse(log: str, skip: int) -> tuple[float | None, float | None, int]:
    """(mean tokens/s over steps > ``skip``, last loss, last step) from torchtitan's metrics lines."""
    rows = [(int(s), float(l), float(t.replace(",", ""))) for s, l, t in _LINE.findall(_ANSI.sub("", log))]
    if not rows:
        return None, None, 0
    tps = [t for s, _, t in rows if s > skip] or [rows[-1][2]]
    return sum(tps) / len(tps), rows[-1][1], rows[-1][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="model:arm pairs; arms: " + ", ".join(ARMS))
    ap.add_argument("--models", default=None, help="instead of --runs: these models, each with every --arms")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the tokens/s mean (compile, warm-up)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--budget", type=int, default=225, help="seconds for all runs: later runs are skipped past it")
    ap.add_argument("--extra", default="", help="more torchtitan flags for every run, e.g. '--training.seq_len 1024'")
    ap.add_argument("--keep-logs", default=None, help="folder for the runs' logs")
    args = ap.parse_args()

    from importlib.metadata import entry_points

    if not any(ep.name == "mxfp8" for ep in entry_points(group="torch_dynamo_backends")):
        sys.exit("bench/torchtitan_moe.py: no 'mxfp8' torch_dynamo_backends entry point (torchtitan looks the backend "
                 "up by name); install mxfx first: python -m pip install --no-deps --no-build-isolation -e .")
    work = Path(tempfile.mkdtemp(prefix="mxfx_titan_"))
    tok_dir, data_dir = write_assets(work)
    policy = work / "fp8_block.toml"
    policy.write_text('format = "fp8_block"\n')
    logs = Path(args.keep_logs) if args.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    series = torchtitan_series()
    runs = ([(m, a) for m in args.models.split(",") for a in args.arms.split(",")] if args.models
            else [tuple(r.split(":")) for r in args.runs.split(",")])
    rows = []
    start = time.time()
    for model, arm in runs:
        left = args.budget - (time.time() - start)
        if left < 30:
            rows.append((model, arm, None, None, 0.0, "skipped (--budget)"))
            continue
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OVERRIDES), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env.pop("MXFX_POLICY", None)
        if arm == "fp8_block":
            env["MXFX_POLICY"] = str(policy)
        cmd = command(series, model, arm, args.steps, tok_dir, data_dir, work / f"dump_{model}_{arm}", args.extra.split())
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
        rows.append((model, arm, tps, loss, wall, status))
        print(f"[{model} {arm}] done in {wall:.0f}s", flush=True)

    print(f"\ntorchtitan {series} MoE debug models, {args.steps} steps, one GPU (logs: {logs})")
    print(f"{'model':<12} {'arm':<10} {'tokens/s':>10} {'vs inductor':>11} {'loss':>8} {'wall s':>7}  status")
    base = {m: t for m, a, t, *_ in rows if a == "inductor" and t}
    for model, arm, tps, loss, wall, status in rows:
        ratio = f"{tps / base[model]:.2f}x" if tps and base.get(model) else "-"
        print(f"{model:<12} {arm:<10} {(f'{tps:,.0f}' if tps else '-'):>10} {ratio:>11} "
              f"{(f'{loss:.4f}' if loss is not None else '-'):>8} {wall:>7.0f}  {status}")


if __name__ == "__main__":
    main()
