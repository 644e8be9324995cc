"""Policy rules match full module names when a graph is traced from a block, and each block runs its own decisions.

``torch.compile(block)`` (torchtitan style), and a graph break inside a layer of a whole-model compile, give the
backend graphs whose names are relative to the block (``attn.qkv``). Named from the model around them (the one
being called, or one registered with ``mxfx.name_modules``), a rule written against the whole model's name
(``layers.1.attn.qkv``) applies to that layer only. Dynamo runs every block of a kind through one graph, so a rule
that decides differently for one block gets a compiled variant per decision: each block runs its own.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import mxfx
from mxfx.diagnostics import rule_check
from mxfx.runtime import cache

from tests.models import Block, MoETransformer, tiny_config


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
    idx = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", torch.bfloat16):
        model(idx)[0].float().sum().backward()
        cache.clear()
        model(idx)  # a forward alone: the weights its MX GEMMs read keep their forward forms (_ran_mx)
    return mxfx.all_reports()[n:], model


def _qkv(pm):
    return next(r for r in pm.records if r.kind == "linear" and r.module.endswith("attn.qkv"))


def _ran_mx(weight) -> bool:
    """Whether the last forward ran a low-precision GEMM on ``weight`` (its forward forms are cached; the backward
    side's are built in the backward)."""
    return bool(cache.entry_forms(weight))


def _qkv_weight(model, i):
    return model.get_submodule(f"layers.{i}").get_submodule("attn.qkv").weight


@pytest.mark.parametrize("register", [True, False], ids=["registered", "running_model"])
def test_rule_targets_one_layer_under_per_block_compile(recwarn, register):
    # Dynamo runs the identical layer 1 through layer 0's graph (parameters are graph inputs): the rule decides
    # differently for them, so the graph is compiled once per decision, and each layer runs its own.
    maps, model = _per_block_maps(register=register)
    assert [(_qkv(pm).module, _qkv(pm).forward) for pm in maps] == [
        ("layers.0.attn.qkv", "bf16"),
        ("layers.1.attn.qkv", "mxfp8"),
    ]
    assert all(r.module.startswith("layers.1.") for r in maps[1].records if r.module)
    assert not _ran_mx(_qkv_weight(model, 0)) and _ran_mx(_qkv_weight(model, 1))
    assert not [w for w in recwarn if "mxfx" in str(w.message)]


def test_block_called_outside_its_model_keeps_block_relative_names():
    # no model holding the block is being called or registered: the names are the block's own, and the
    # full-name rule matching nothing says how to get the model's names
    block = MoETransformer(tiny_config(n_layers=1)).layers[0]
    block.compile(
        backend="mxfp8",
        options={"inner": "aot_eager", "rules": [{"module": "layers.0.attn.o_proj", "precision": "bf16"}]},
    )
    n = len(mxfx.all_reports())
    with pytest.warns(UserWarning, match=r"matches no module.*mxfx.name_modules\(model\)"):
        with torch.autocast("cpu", torch.bfloat16):
            block(torch.randn(2, 32, 64)).float().sum().backward()
        rule_check.judge_pending()
    maps = mxfx.all_reports()[n:]
    assert len(maps) == 1 and _qkv(maps[0]).module == "attn.qkv" and _qkv(maps[0]).forward == "mxfp8"


def test_checkpoint_wrapper_left_out_of_names():
    # torchtitan wraps each block for activation checkpointing and compiles the wrapper; names (and the
    # place found from the parameters) are those of state_dict(), without "_checkpoint_wrapped_module".
    maps, model = _per_block_maps(register=True, rule="layers.0.attn.*", wrap=True)
    assert [(_qkv(pm).module, _qkv(pm).forward) for pm in maps] == [
        ("layers.0.attn.qkv", "bf16"),
        ("layers.1.attn.qkv", "mxfp8"),
    ]
    assert not _ran_mx(_qkv_weight(model, 0)) and _ran_mx(_qkv_weight(model, 1))


def test_rule_for_every_layer_compiles_one_graph():
    maps, model = _per_block_maps(register=True, rule="layers.*.attn.qkv")
    assert len(maps) == 1 and _qkv(maps[0]).forward == "bf16"
    assert not _ran_mx(_qkv_weight(model, 0)) and not _ran_mx(_qkv_weight(model, 1))


def test_rule_for_a_later_layer_applies_there_without_warnings():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        maps, model = _per_block_maps(register=True, rule="layers.1.attn.qkv")
        rule_check.judge_pending()
    assert [_qkv(pm).forward for pm in maps] == ["mxfp8", "bf16"]
    assert _ran_mx(_qkv_weight(model, 0)) and not _ran_mx(_qkv_weight(model, 1))
    assert not [str(w.message) for w in record if "layers.1.attn.qkv" in str(w.message)]


class _BreakingBlock(Block):
    """A layer whose forward Dynamo cuts in two (a graph break between attention and experts)."""

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        torch._dynamo.graph_break()
        return x + self.moe(self.ffn_norm(x))


def _break(x):
    torch._dynamo.graph_break()
    return x


class _StackBlock(Block):
    """A layer whose experts module is on the stack of the frame resumed after a graph break: that graph's names
    are relative to the experts module (``gate.weight``), not to the layer."""

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(_break(self.ffn_norm(x)))


@pytest.mark.parametrize("block", [_BreakingBlock, _StackBlock], ids=["self", "stack"])
def test_graph_break_inside_layers_keeps_module_paths_and_each_layers_decision(recwarn, block):
    # torch.compile(model) with a graph break inside each layer: the layers' graphs are traced from the layer
    # (names relative to it, or to its experts module on the resumed frame's stack) and Dynamo runs layer 1 through
    # layer 0's graphs. Named from the model being called, without mxfx.name_modules, the rule applies to layer 0,
    # and layer 1 runs its own (default) decisions.
    model = MoETransformer(tiny_config(n_layers=2))
    for layer in model.layers:
        layer.__class__ = block
    compiled = torch.compile(
        model, backend="mxfp8", options={"inner": "aot_eager", "rules": [{"module": "layers.0.*", "precision": "bf16"}]}
    )
    n = len(mxfx.all_reports())
    idx = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", torch.bfloat16):
        compiled(idx)[0].float().sum().backward()
        cache.clear()
        compiled(idx)
    rule_check.judge_pending()
    records = [r for pm in mxfx.all_reports()[n:] for r in pm.records if r.kind in ("linear", "grouped_mm")]
    modules = dict(model.named_modules())
    assert records and all(r.module in modules for r in records), sorted({r.module for r in records})
    for i, precision in ((0, "bf16"), (1, "mxfp8")):
        mine = {r.module: r.forward for r in records if r.module.startswith(f"layers.{i}.")}
        assert "layers.0.attn.qkv".replace("0", str(i)) in mine and set(mine.values()) == {precision}, mine
    for name in ("attn.qkv", "moe.shared_up"):
        weights = [model.get_submodule(f"layers.{i}.{name}").weight for i in (0, 1)]
        assert [_ran_mx(w) for w in weights] == [False, True], name
    assert _ran_mx(model.layers[1].moe.gate_up_proj) and not _ran_mx(model.layers[0].moe.gate_up_proj)
    assert not [str(w.message) for w in recwarn if "mxfx" in str(w.message)]
