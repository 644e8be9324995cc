"""Policy rules match full module names when each block is compiled on its own (torchtitan style).

``torch.compile(block)`` gives the backend names relative to the block (``attn.qkv``); after
``mxfx.name_modules(model)`` a rule written against the whole model's name (``layers.1.attn.qkv``)
must apply to that layer's graph only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mxfx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from moe_model import MoEConfig, MoETransformer  # noqa: E402


def _per_block_maps(register: bool):
    model = MoETransformer(MoEConfig(n_layers=2, d_model=64, head_dim=32, expert_hidden=64, shared_hidden=64, n_experts=4))
    if register:
        mxfx.name_modules(model)
    options = {"inner": "aot_eager", "rules": [{"module": "layers.0.attn.qkv", "precision": "bf16"}]}
    for layer in model.layers:
        layer.compile(backend="mxfp8", options=options)
    n = len(mxfx.all_reports())
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randint(0, 256, (2, 32)))[0].float().sum().backward()
    return mxfx.all_reports()[n:]


def _qkv(pm):
    return next(r for r in pm.records if r.kind == "linear" and r.module.endswith("attn.qkv"))


def test_rule_targets_one_layer_under_per_block_compile():
    # Dynamo reuses layer 0's graph for the identical layer 1 (parameters are graph inputs), so one
    # graph is compiled, named after layer 0. Open: a rule naming layer 1 only cannot apply there.
    maps = _per_block_maps(register=True)
    assert len(maps) == 1
    assert _qkv(maps[0]).module == "layers.0.attn.qkv" and _qkv(maps[0]).forward == "bf16"
    assert all(r.module.startswith("layers.0.") for r in maps[0].records if r.module)


def test_unregistered_model_keeps_block_relative_names():
    maps = _per_block_maps(register=False)
    assert len(maps) == 1 and _qkv(maps[0]).module == "attn.qkv"
    assert _qkv(maps[0]).forward == "mxfp8"  # the full-name rule matches nothing
