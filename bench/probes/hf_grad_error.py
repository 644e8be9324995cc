"""Probe: how far each ``bench/hf_models.py`` arm's first gradient is from FP32, per parameter group.

One forward and backward of a one-layer OLMoE or Qwen3-MoE at the checkpoints' per-layer shapes (``--dims``;
fewer experts with ``--experts``, so a CPU runs it) on one batch of real text. The reference is the same model in
FP32 without autocast; for each arm it prints the loss difference and ``||g - g_fp32|| / ||g_fp32||`` over
the attention projections, the experts' gate/up and down weights, the router, the embedding and the head.
Same errors in both models mean mxfx treats them alike; an arm far from ``bf16-grouped`` in one model only
points at that model's graph.

    python bench/probes/hf_grad_error.py --model qwen3,olmoe --experts 16 --compiler aot_eager_fp32_gemms  # CPU
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import hf_models  # noqa: E402  (bench/hf_models.py; puts examples/ on the path)
import data  # noqa: E402  (examples/data.py)

GROUPS = {
    "attn": lambda n: "self_attn" in n and "norm" not in n,
    "experts.gate_up": lambda n: "experts.gate_up_proj" in n,
    "experts.down": lambda n: "experts.down_proj" in n,
    "router": lambda n: "mlp.gate." in n,
    "embed": lambda n: "embed_tokens" in n,
    "lm_head": lambda n: "lm_head" in n,
}


def loss_and_grads(model, fn, x, y, autocast: bool, device: str):
    with torch.autocast(device, torch.bfloat16, enabled=autocast):
        loss = fn(input_ids=x, labels=y).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3,olmoe")
    p.add_argument("--arms", default="bf16-users,bf16-grouped,mxfp8,fp8_block")
    p.add_argument("--experts", type=int, default=16, help="routed experts (the checkpoints': 64 / 128)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--compiler", default="inductor", choices=hf_models.COMPILERS)
    p.add_argument("--dims", default="real", choices=hf_models.DIMS)
    args = p.parse_args()
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in hf_models.ARMS or hf_models.ARMS[a].param_dtype != torch.float32]
    if bad:
        raise SystemExit(f"hf_grad_error: arm(s) {bad} are not FP32-parameter arms of bench/hf_models.py")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train, _ = data.load_splits(code_bytes=400_000)
    x, y = data.get_batch(train, max(1, args.tokens // args.seq), args.seq, torch.Generator().manual_seed(0), device)
    for name in args.model.split(","):
        import transformers as T

        cfg = hf_models.model_config(name, 1, args.dims)
        cfg.num_experts = args.experts
        torch.manual_seed(0)
        with torch.device(device):
            model = {"olmoe": T.OlmoeForCausalLM, "qwen3": T.Qwen3MoeForCausalLM}[name](cfg)
        ref_loss, ref = loss_and_grads(model, model, x, y, False, device)
        print(f"{name}, {args.experts} experts: FP32 loss {ref_loss:.5f}", flush=True)
        for arm in arms:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            fn = hf_models.ARMS[arm].prepare(model, args.compiler)
            loss, grads = loss_and_grads(model, fn, x, y, hf_models.ARMS[arm].autocast, device)
            model.set_experts_implementation("grouped_mm")  # bf16-grouped registers its own
            errs = []
            for group, member in GROUPS.items():
                names = [n for n in ref if member(n)]
                diff = sum((grads[n] - ref[n]).square().sum() for n in names).sqrt()
                errs.append(f"{group} {diff / sum(ref[n].square().sum() for n in names).sqrt():.4f}")
            print(f"{name} {arm:13s} loss {loss - ref_loss:+.5f}  grad error: {', '.join(errs)}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
