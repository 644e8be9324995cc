"""Policy rules match full module names when each block is compiled on its own (torchtitan style).

``torch.compile(block)`` gives the backend names relative to the block (``attn.qkv``); after
``mxfx.name_modules(model)`` a rule written against the whole model's name (``layers.1.attn.qkv``)
must apply to that layer's graph only.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import mxfx
from mxfx import rule_check

from tests.models import MoETransformer, tiny_config


def _per_block_maps(register: bool, rule: str = "layers.0.attn.qkv", wrap: bool = False):
    model = MoETransformer(tiny_config(n_layers=2))
    if wrap:  # activation checkpointing as torchtitan applies it: each block inside a CheckpointWrapper
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if register:
        mxfx.name_modules(model)
    options = {"inner": "aot_eager", "rules": [{"module": rule, "precision": "bf16"}]}
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
    # graph is compiled, named after layer 0, and layer 1 runs layer 0's decisions: mxfx says so.
    with pytest.warns(UserWarning, match="decides differently for layers.0 than for layers.1"):
        maps = _per_block_maps(register=True)
    assert len(maps) == 1
    assert _qkv(maps[0]).module == "layers.0.attn.qkv" and _qkv(maps[0]).forward == "bf16"
    assert all(r.module.startswith("layers.0.") for r in maps[0].records if r.module)


def test_unregistered_model_keeps_block_relative_names():
    maps = _per_block_maps(register=False)
    assert len(maps) == 1 and _qkv(maps[0]).module == "attn.qkv"
    assert _qkv(maps[0]).forward == "mxfp8"  # the full-name rule matches nothing


def test_checkpoint_wrapper_left_out_of_names():
    # torchtitan wraps each block for activation checkpointing and compiles the wrapper; names (and the
    # place found from the parameters) are those of state_dict(), without "_checkpoint_wrapped_module".
    with pytest.warns(UserWarning, match="decides differently for layers.0 than for layers.1"):
        maps = _per_block_maps(register=True, rule="layers.0.attn.*", wrap=True)
    assert _qkv(maps[0]).module == "layers.0.attn.qkv" and _qkv(maps[0]).forward == "bf16"


def test_rule_for_every_layer_gives_no_shared_graph_warning(recwarn):
    maps = _per_block_maps(register=True, rule="layers.*.attn.qkv")
    assert _qkv(maps[0]).forward == "bf16"
    assert not [w for w in recwarn if "decides differently" in str(w.message)]


def test_rule_for_a_later_layer_gets_one_warning_not_two():
    """A rule naming layer 1 when layer 0's graph serves both: the shared-graph warning says why it cannot apply;
    the unmatched-rule judgment (graph names are layer 0's) must not add a second warning saying it matches nothing."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _per_block_maps(register=True, rule="layers.1.attn.qkv")
        rule_check.judge_pending()
    messages = [str(w.message) for w in record if "layers.1.attn.qkv" in str(w.message)]
    assert len(messages) == 1 and "decides differently for layers.0 than for layers.1" in messages[0], messages
