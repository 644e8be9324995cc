"""The tests' small MoE language model: the model the main job trains, ``examples/moe_model.py``, loaded from its
path (:func:`tests.helpers.load_example`), so that tests of the passes hold for the example's model itself.

:func:`tiny_config` is the size most tests compile.
"""

from __future__ import annotations

from tests.helpers import load_example

_example = load_example("moe_model")
MoEConfig, MoE, Block, MoETransformer = _example.MoEConfig, _example.MoE, _example.Block, _example.MoETransformer


def tiny_config(**overrides) -> MoEConfig:
    """One layer of width 64 (two 32-wide heads), 4 experts top-2 of hidden 64, shared expert 64: the smallest
    model whose every GEMM has MX-blockable (multiple of 32) features."""
    return MoEConfig(
        **{
            "d_model": 64,
            "n_layers": 1,
            "head_dim": 32,
            "n_experts": 4,
            "top_k": 2,
            "expert_hidden": 64,
            "shared_hidden": 64,
            **overrides,
        }
    )
