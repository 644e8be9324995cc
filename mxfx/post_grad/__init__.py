"""mxfx's rewrites of Inductor's post-grad graphs: the ones that need a backward graph or a whole compiled graph.

The passes of :mod:`mxfx.passes` rewrite the traced forward before AOTAutograd; these run later, on each graph
Inductor lowers (forward and backward, after the partition), through Inductor's own hook
``torch._inductor.config.post_grad_custom_post_pass``, in this order:

* :mod:`mxfx.post_grad.lookup_batching`: a graph's weight-cache lookups of its inputs in one call
  (``MXFX_BATCH_LOOKUPS=0`` off);
* :mod:`mxfx.post_grad.route_grad_gather`: a routed GEMM's output gradient read from its tokens, not written out
  per row (``MXFX_GATHER_ROUTE_GRAD=0`` off).

A pass the user set on the hook runs first. :meth:`PostGradPasses.uuid` (a hash of these files and of which passes
are on) enters Inductor's cache key, so a cached graph is only reused under the same rewrites.
"""

from __future__ import annotations

import torch._inductor.config as inductor_config
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from mxfx.post_grad import lookup_batching, route_grad_gather
from mxfx.kernels.common.launch import env_switch

PASSES = {lookup_batching.ENV: lookup_batching, route_grad_gather.ENV: route_grad_gather}
"""Each pass's module (``run(graph)``, its file hashed), by the environment switch that turns it off."""


class PostGradPasses(CustomGraphPass):
    """Inductor's post-grad custom pass running ``passes`` (names of :data:`PASSES`, in order) after ``after`` (the
    pass that held the hook before, if any)."""

    def __init__(self, passes: tuple[str, ...], after=None):
        self.passes = tuple(passes)
        self.after = after

    def __call__(self, graph: fx.Graph) -> None:
        if self.after is not None:
            self.after(graph)
        for name in self.passes:
            PASSES[name].run(graph)

    def uuid(self):
        """A hash of the passes' files with which are on, and the earlier pass's uuid; None (no caching, as Inductor
        does for it) where the earlier pass has none."""
        mine = (get_hash_for_files((__file__, *(PASSES[name].__file__ for name in self.passes))), self.passes)
        if self.after is None:
            return mine
        theirs = self.after.uuid() if hasattr(self.after, "uuid") else None
        return None if theirs is None else (mine, theirs)


def config_patch() -> dict:
    """The Inductor config patch that installs :class:`PostGradPasses` with the passes their switches leave on
    (after a pass the user set there), or none where every one is off."""
    on = tuple(name for name in PASSES if env_switch(name, True) is not False)
    earlier = inductor_config.post_grad_custom_post_pass
    if not on or isinstance(earlier, PostGradPasses):
        return {}
    return {"post_grad_custom_post_pass": PostGradPasses(on, earlier)}
