"""Train a Hugging Face MoE model with ``transformers.Trainer`` and experts in MXFP8.

The recipe: compile the model in place with ``model.compile(backend="mxfp8")`` and hand it to
``Trainer`` as usual. In place, the module keeps its ``forward`` signature, so Trainer's column
filtering and Accelerate's wrappers see the model they expect. ``bf16=True`` keeps FP32 parameters
and runs the forward under BF16 autocast; mxfx rewrites the experts' grouped GEMMs, their SwiGLU and
the attention / dense linears into MX, and rebuilds its weight caches after every optimizer step
(Accelerate's optimizer wrapper calls the torch optimizer's ``step``, which fires mxfx's hook) and
whenever a weight changes otherwise (a checkpoint load). Gradient accumulation, clipping and LR
schedules are Trainer's own.

(``TrainingArguments(torch_compile_backend="mxfp8")`` is refused by Accelerate, whose list of backend
names is closed; passing ``torch.compile(model, ...)`` (a wrapper) to Trainer drops every dataset
column unless ``remove_unused_columns=False``.)

    python examples/hf_trainer.py                  # tiny OLMoE on CPU, a few steps
    python examples/hf_trainer.py --steps 200 --hidden 1024 --layers 4   # GPU
"""

from __future__ import annotations

import argparse

import torch
import transformers as T

import mxfx


def tiny_olmoe(layers: int = 1, hidden: int = 64, experts: int = 4) -> T.OlmoeForCausalLM:
    """A randomly initialized OLMoE with a 256-token (byte) vocabulary; FP32 parameters."""
    cfg = T.OlmoeConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return T.OlmoeForCausalLM(cfg)


class ByteText(torch.utils.data.Dataset):
    """Fixed random byte sequences as ``{"input_ids", "labels"}`` rows (the model shifts labels itself)."""

    def __init__(self, rows: int, seq: int, seed: int = 0):
        self.ids = torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out: str, steps: int, **overrides) -> T.TrainingArguments:
    """Trainer settings of the example: BF16 autocast over FP32 weights, accumulation, clipping, cosine LR."""
    kw = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        save_strategy="steps",
        save_steps=steps,
        logging_steps=1,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kw.update(overrides)
    return T.TrainingArguments(**kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", default="hf_trainer_out")
    args = p.parse_args(argv)
    model = tiny_olmoe(args.layers, args.hidden)
    model.compile(backend="mxfp8")  # in place: experts, SwiGLU and linears in MX
    trainer = T.Trainer(model=model, args=training_args(args.out, args.steps), train_dataset=ByteText(64, args.seq))
    trainer.train()
    pm = mxfx.report.all_reports()[-1]
    print(pm.summary())


if __name__ == "__main__":
    main()
