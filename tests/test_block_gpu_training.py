"""fp8_block training end to end on the GPU (skips without an sm90+ CUDA GPU): a transformers OLMoE with
FP32 main weights under BF16 autocast, compiled with ``format="fp8_block"``, against the same model in BF16.

Three checks, each one that a wrong kernel, layout or cache would fail:

* after a few AdamW steps, the compiled model's loss on a held-out batch equals that of a fresh compile of
  the same weights (the caches the step refreshed against caches built from scratch; the same kernels run,
  so only autotuning choices differ: 1e-3 relative);
* after the held-out forward every cached weight form still equals a fresh 128x128 quantize of its weight.
  Batches of 512 tokens make an RMSNorm buffer (512 fp32) the size of the down_proj scale grid
  (16 x 8 x 4): Inductor reused such a buffer for the cached scales before buffer reuse was turned off
  for mxfx graphs (tests/test_cache_buffers.py);
* the training losses track the BF16 arm's within 3% per step (FP8 block rounding moves a loss of this
  size by well under 1% over a few steps; a scale or layout error moves it by tens of percent).
"""

import copy

import pytest
import torch

from mxfx.runtime import cache
from mxfx.kernels.fp8_block import device_path as block_device_path

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90+ CUDA GPU"
)

T = pytest.importorskip("transformers")

STEPS = 8


def _model():
    cfg = T.OlmoeConfig(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        return T.OlmoeForCausalLM(cfg)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (1, 512), generator=g).cuda() for _ in range(n)]


def _stale_forms(model) -> list[str]:
    """Names of cached fp8_block forms that differ from a fresh quantize of their weight."""
    bad = []
    for name, p in model.named_parameters():
        for (rule, form), (q, s) in cache.entry_forms(p).items():
            fq, fs = block_device_path.quantize_128x128(p.detach(), rule)
            if form == "block_dgrad":
                fq, fs = fq.transpose(-2, -1), fs.transpose(-2, -1)
            if not (torch.equal(q.view(torch.uint8), fq.contiguous().view(torch.uint8)) and torch.equal(s, fs)):
                bad.append(f"{name} {form}")
    return bad


def _loss(fn, x):
    with torch.autocast("cuda", torch.bfloat16):
        return fn(input_ids=x, labels=x).loss


def _train(model, fn, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for x in batches:
        loss = _loss(fn, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_fp8_block_trains_like_bf16_and_refreshed_caches_equal_fresh_ones():
    batches = _batches(STEPS + 1)
    held_out = batches.pop()
    options = {"format": "fp8_block"}

    model = _model()
    fn = torch.compile(model, backend="mxfp8", options=options)
    losses = _train(model, fn, batches)
    trained = _loss(fn, held_out).item()  # grad enabled, as a training loop's eval through the same graph
    assert _stale_forms(model) == []
    torch._dynamo.reset()
    fresh = copy.deepcopy(model)
    again = _loss(torch.compile(fresh, backend="mxfp8", options=options), held_out).item()
    assert abs(trained - again) <= 1e-3 * abs(again), (trained, again)

    torch._dynamo.reset()
    ref_model = _model()
    ref = _train(ref_model, torch.compile(ref_model), batches)
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 0.03 * abs(b), f"step {step}: fp8_block {a:.4f} vs bf16 {b:.4f}\n{losses}\n{ref}"
