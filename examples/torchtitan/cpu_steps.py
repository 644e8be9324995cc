"""A few training steps of a torchtitan MoE debug model on CPU, built as torchtitan's trainer builds it.

torchtitan's ``Trainer`` needs an accelerator (it picks ``cuda`` when none is found), so this
script assembles the same pieces on CPU: the model from torchtitan's config registry with the
``mxfx_overrides.mxfx_model`` override (SDPA for FlexAttention, names registered, small
experts), its selective activation checkpointing, its per-block ``apply_compile`` with
``--compile.backend``'s value, FSDP2 with BF16 parameters on a one-rank CPU mesh
(``apply_fsdp_to_decoder``), and its ``OptimizersContainer`` (AdamW). Data: one fixed batch of
tokens, repeated, so the loss falls within a few steps.

Prints one JSON line: ``{"losses": [...], "records": [[kind, module, forward, dgrad], ...]}``
(the records of the precision maps mxfx made; empty for other backends).

    python examples/torchtitan/cpu_steps.py --backend mxfp8 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchtitan.config import CompileConfig  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402
from torchtitan.distributed.compile import apply_compile  # noqa: E402
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

import mxfx  # noqa: E402

CONFIGS = {
    "qwen3": "torchtitan.models.qwen3.config_registry:qwen3_moe_debug",
    "deepseek_v3": "torchtitan.models.deepseek_v3.config_registry:deepseek_v3_debugmodel",
}


def trainer_config(model: str, layers: int, expert_hidden_dim: int):
    """``(Trainer.Config, model config)`` of ``model`` after the mxfx override, the model cut to ``layers`` blocks.

    The model config is taken before the overrides are applied, as torchtitan's trainer takes it.
    """
    module, name = CONFIGS[model].split(":")
    cfg = getattr(__import__(module, fromlist=[name]), name)()
    model_config = cfg.model_spec.model
    cfg.override.imports = [("mxfx_overrides.mxfx_model", {"expert_hidden_dim": expert_hidden_dim})]
    apply_overrides(cfg.override, cfg)
    model_config.layers = model_config.layers[:layers]
    return cfg, model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3", choices=sorted(CONFIGS))
    ap.add_argument("--backend", default="mxfp8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--expert-hidden-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    cfg, model_config = trainer_config(args.model, args.layers, args.expert_hidden_dim)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    with tempfile.TemporaryDirectory() as dump:
        cfg.activation_checkpoint.build(dump_folder=dump).apply(model)
    one_rank = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=args.backend), parallel_dims=one_rank)
    apply_fsdp_to_decoder(
        model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False
    )
    optimizers = cfg.optimizer.build(model_parts=[model])

    vocab = model_config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    n_reports = len(mxfx.all_reports())
    losses = []
    for _ in range(args.steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
    records = [[r.kind, r.module, r.forward, r.dgrad] for pm in mxfx.all_reports()[n_reports:] for r in pm.records]
    print(json.dumps({"losses": losses, "records": records}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
