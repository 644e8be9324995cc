"""torchtitan config overrides for training its MoE debug models under ``--compile.backend mxfp8``.

Activate with ``--override.imports mxfx_overrides.sdpa_attention`` (this directory on
``PYTHONPATH``); torchtitan's override mechanism swaps configs before anything is built.

- :func:`sdpa_attention`: torchtitan's language models default to FlexAttention, and torchtitan
  refuses any compile backend other than ``inductor`` / ``aot_eager`` for a model with
  FlexAttention (it has only an Inductor lowering). This swaps it for causal SDPA, which
  torchtitan's trainer supports as its maskless attention (no per-document masks: packed
  documents attend to each other, the same in every compile backend).
- :func:`small_experts`: a smaller expert hidden size (``hidden_dim`` kwarg) for quick CPU runs.
"""

from __future__ import annotations

import dataclasses

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts


@override(target=FlexAttention.Config, description="causal SDPA in place of FlexAttention (non-Inductor compile backends)")
def sdpa_attention(config: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return ScaledDotProductAttention.Config()


@override(target=GroupedExperts.Config, description="smaller routed experts (quick runs)")
def small_experts(config: GroupedExperts.Config, hidden_dim: int = 64) -> GroupedExperts.Config:
    return dataclasses.replace(config, hidden_dim=hidden_dim)
