"""BF16 grouped expert GEMMs from FP32 main weights in HF transformers: an experts implementation for benchmarks.

transformers calls ``torch._grouped_mm`` under ``torch.compile`` only for BF16 expert weights; with FP32 main
weights it calls its FP32 fallback op, and autocast does not cover grouped GEMMs. :func:`bf16_grouped_experts`
is transformers' own ``grouped_mm`` experts forward reading BF16 casts of the expert weights (what autocast
does for a linear), to register with ``transformers.integrations.moe.ExpertsInterface``. Its own module, so
that the graph guards on :class:`BF16ExpertWeights` find the class by an importable name.
"""

from __future__ import annotations

import torch


class BF16ExpertWeights:
    """An experts module as transformers' experts code reads it, with its 3-D expert weights cast to BF16."""

    def __init__(self, experts: torch.nn.Module):
        self._experts = experts

    def __getattr__(self, name):
        value = getattr(self._experts, name)
        if isinstance(value, torch.nn.Parameter) and value.dim() == 3:
            return value.to(torch.bfloat16)
        return value


def bf16_grouped_experts(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm`` experts forward on BF16 casts of the expert weights: under compile it then calls
    BF16 ``torch._grouped_mm`` (as for a BF16-weight model), the gradient flowing back to the FP32 weights."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(BF16ExpertWeights(experts), hidden_states, top_k_index, top_k_weights)
