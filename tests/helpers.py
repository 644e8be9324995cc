"""Test helpers: capture the final forward/backward graphs an inner compiler receives."""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


class GraphCapture:
    """An ``inner`` compiler (aot_autograd) that records the forward and backward ATen graphs it runs."""

    def __init__(self):
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

        def fw(gm, example_inputs):
            self.forward.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, example_inputs):
            self.backward.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)


def count_calls(graphs, target) -> int:
    """How many call_function nodes with ``target`` the graphs hold."""
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target == target)
