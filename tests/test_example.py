"""The MoE example (``examples/moe_model.py``, ``examples/data.py``, loaded from their paths): eager training
works, the grouped-GEMM MoE matches a per-expert loop, data splits are disjoint, and the tests' model
(``tests/models.py``) is this model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tests.models
from tests.helpers import load_example

data = load_example("data")
example = load_example("moe_model")
MoE, MoEConfig, MoETransformer = example.MoE, example.MoEConfig, example.MoETransformer
get_batch, load_splits, pydoc_topics, stdlib_code = (
    data.get_batch,
    data.load_splits,
    data.pydoc_topics,
    data.stdlib_code,
)

TINY = MoEConfig(d_model=64, n_layers=1, head_dim=32, n_experts=4, top_k=2, expert_hidden=64, shared_hidden=32)


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """FP32 reference: route every token, then loop over tokens and their k experts."""
    x = x.reshape(-1, x.shape[-1]).float()
    probs = (x @ moe.gate.weight.float().T).softmax(-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = experts[t, j]
            g, u = (moe.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (moe.down_proj[e] @ (F.silu(g) * u))
    shared = moe.shared_down.weight @ (F.silu(moe.shared_gate.weight @ x.T) * (moe.shared_up.weight @ x.T))
    return out + shared.T


def test_moe_example():
    torch.manual_seed(0)

    # 1. The MoE layer equals the per-expert loop. Weights are O(0.1) so outputs are O(1).
    moe = MoE(TINY)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.1)
    x = torch.randn(2, 24, TINY.d_model)
    out, ref = moe(x).reshape(-1, TINY.d_model), naive_moe(moe, x)
    # Tolerance: the routed path rounds its inputs, weights and SwiGLU hidden to BF16 (8-bit
    # significand, relative rounding error <= 2^-9 each) and returns BF16, so a few roundings
    # compound to ~1% of the output scale; a routing or permutation bug is O(100%).
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    experts, _ = moe.route(x.reshape(-1, TINY.d_model))
    assert experts.unique().numel() > 1, "test routes every token to one expert; it would not test the offsets"

    # 2. Two eager training steps on one repeated batch: finite, decreasing loss.
    model = MoETransformer(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xb, yb = torch.randint(0, 256, (2, 2, 32)).unbind(0)
    losses = []
    for _ in range(3):  # 2 updates, 3 loss readings
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(xb, yb)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[2] < losses[1] < losses[0], losses
    assert model.layers[0].moe.gate_up_proj.dtype == torch.float32  # FP32 main weights

    # 3. Data: train and held-out are disjoint, complementary slices; batches shift by one byte.
    code, topics = stdlib_code(200_000), pydoc_topics()
    train, val = load_splits(code_bytes=200_000, val_frac=0.1)
    assert 0 < len(code) <= 200_000 and len(train) + len(val) == len(code) + len(topics)
    n_code_val, n_topic_val = int(len(code) * 0.1), int(len(topics) * 0.1)
    assert bytes(val.tolist()) == code[-n_code_val:] + topics[-n_topic_val:]
    assert bytes(train.tolist()) == code[:-n_code_val] + topics[:-n_topic_val]
    x1, y1 = get_batch(train, 4, 16, torch.Generator().manual_seed(0))
    x2, _ = get_batch(train, 4, 16, torch.Generator().manual_seed(0))
    assert x1.dtype == torch.int64 and torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])


def test_tests_model_is_the_example_model():
    """The passes are tested on ``tests.models``: the example's model itself, one source (no copy to drift)."""
    assert (tests.models.MoETransformer, tests.models.MoEConfig) == (MoETransformer, MoEConfig)
    assert tests.models.tiny_config(n_layers=2).n_layers == 2 and tests.models.tiny_config().d_model == 64
