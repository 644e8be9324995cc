"""``transformers.Trainer`` with a model compiled in place by ``backend="mxfp8"`` (examples/hf_trainer.py).

Tiny OLMoE on CPU under ``bf16=True`` (FP32 parameters, BF16 autocast), gradient accumulation,
clipping and a cosine LR schedule; the inner compiler is ``aot_eager`` (no C++ builds, same rewrite).
Checked: the experts' grouped GEMMs are in MX; the checkpoint holds exactly the model's own tensors
(no weight caches); after training, after resuming from the checkpoint and after
``save_pretrained``/``from_pretrained`` the compiled model's forward equals a fresh compile of the
same weights bit for bit (a stale weight cache would differ: the weights moved).
"""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import mxfx  # noqa: E402
from tests.helpers import load_example  # noqa: E402

hf_trainer = load_example("hf_trainer")

OPTIONS = {"inner": "aot_eager"}
X = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))


def _logits(model) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        return model(input_ids=X).logits.float()


def _fresh_logits(state: dict) -> torch.Tensor:
    """Logits of a newly built, newly compiled model holding ``state``: its caches are built from scratch."""
    model = hf_trainer.tiny_olmoe()
    model.load_state_dict(state)
    model.compile(backend="mxfp8", options=OPTIONS)
    return _logits(model)


def _trainer(model, out, steps) -> T.Trainer:
    args = hf_trainer.training_args(str(out), steps, per_device_train_batch_size=2, save_steps=2, use_cpu=True)
    return T.Trainer(model=model, args=args, train_dataset=hf_trainer.ByteText(32, 32))


@pytest.mark.slow
def test_trainer_trains_resumes_and_reloads_with_fresh_caches(tmp_path):
    model = hf_trainer.tiny_olmoe()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.compile(backend="mxfp8", options=OPTIONS)
    n_maps = len(mxfx.report.all_reports())
    _trainer(model, tmp_path, 2).train()
    maps = mxfx.report.all_reports()[n_maps:]
    assert maps and max(pm.count("grouped_mm", True) for pm in maps) == 2  # both expert GEMMs in MX
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it did train
    torch.testing.assert_close(_logits(model), _fresh_logits(model.state_dict()), rtol=0, atol=0)

    ckpt = tmp_path / "checkpoint-2"
    saved = load_file(ckpt / "model.safetensors")
    hf_trainer.tiny_olmoe().save_pretrained(tmp_path / "uncompiled")  # transformers' own checkpoint layout
    expected = load_file(tmp_path / "uncompiled" / "model.safetensors")
    assert set(saved) == set(expected), set(saved) ^ set(expected)  # no cache tensors, nothing renamed
    assert all(v.dtype == torch.float32 for v in saved.values())

    resumed = hf_trainer.tiny_olmoe()
    resumed.compile(backend="mxfp8", options=OPTIONS)
    _logits(resumed)  # caches built from the initial weights, then the checkpoint is loaded over them
    _trainer(resumed, tmp_path / "resumed", 3).train(resume_from_checkpoint=str(ckpt))
    torch.testing.assert_close(_logits(resumed), _fresh_logits(resumed.state_dict()), rtol=0, atol=0)

    resumed.save_pretrained(tmp_path / "pretrained")
    reloaded = T.OlmoeForCausalLM.from_pretrained(tmp_path / "pretrained")
    reloaded.compile(backend="mxfp8", options=OPTIONS)
    torch.testing.assert_close(_logits(reloaded), _logits(resumed), rtol=0, atol=0)


def test_module_names_under_accelerates_wrapped_forward():
    """Accelerate's mixed precision wraps ``model.forward`` and passes the model as its first argument, so Dynamo
    names modules ``L['args'][0].model...``; the precision map (and rules) still see ``named_modules()``'s names."""
    accelerate = pytest.importorskip("accelerate")
    model = hf_trainer.tiny_olmoe()
    model.compile(backend="mxfp8", options=OPTIONS)
    model = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    model(input_ids=X, labels=X).loss.backward()
    names = {r.module for r in mxfx.last_report().records}
    assert "model.layers.0.mlp.experts" in names and "lm_head" in names, names
    assert names <= {n for n, _ in model.named_modules()}, names
