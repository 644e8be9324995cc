"""The FP32 backward of the SwiGLU ``h = silu(gate) * up``, the same for every format (each keeps gate and up its own
way for backward and hands their values here)."""

from __future__ import annotations

import torch


def backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 gradients of ``silu(g) * u`` from ``dh`` and the values of gate and up (any float dtype):
    ``dg = dh * u * s * (1 + g (1 - s))``, ``du = dh * g * s``, s = sigmoid(g)."""
    g, u = gate.float(), up.float()
    s = torch.sigmoid(g)
    dh = dh.float()
    return dh * u * s * (1 + g * (1 - s)), dh * g * s
