"""mxfx's post-grad hook (``mxfx.post_grad``): its passes in order, after a pass the user set there, each turned off
by its own switch, the set of passes in Inductor's cache key."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

from mxfx import post_grad
from mxfx.post_grad import lookup_batching, route_grad_gather
from mxfx.runtime.cache.operands import cached_weights
from tests.test_lookup_batching import _graph


class _Earlier(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.seen = 0

    def __call__(self, graph):
        self.seen += 1

    def uuid(self):
        return "earlier"


def _installed():
    return post_grad.config_patch()["post_grad_custom_post_pass"]


def test_the_hook_runs_a_pass_set_there_before_and_each_switch_turns_its_pass_off(monkeypatch):
    """The passes go after one a user set on the hook, their uuid beside theirs (none where theirs has none: no
    caching, as Inductor does for such a pass); a switch at 0 leaves its pass out, and out of the uuid; both at 0
    install nothing. Inductor's own ``config.patch`` sets the hook here (a monkeypatched config entry is deleted on
    undo: hidden from later tests)."""
    for env in post_grad.PASSES:
        monkeypatch.delenv(env, raising=False)
    earlier = _Earlier()
    with inductor_config.patch(post_grad_custom_post_pass=earlier):
        installed = _installed()
    assert installed.after is earlier and installed.passes == (lookup_batching.ENV, route_grad_gather.ENV)
    assert installed.uuid()[1] == "earlier"
    g, _ = _graph((0, "rceil", "block_forward"), (1, "rceil", "block_forward"))
    installed(g)
    assert earlier.seen == 1 and any(n.target is cached_weights for n in g.nodes)
    with inductor_config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert _installed().uuid() is None
    both = _installed()
    assert both.after is None
    monkeypatch.setenv(lookup_batching.ENV, "0")
    one = _installed()
    assert one.passes == (route_grad_gather.ENV,) and one.uuid() != both.uuid()
    g, _ = _graph((0, "rceil", "block_forward"), (1, "rceil", "block_forward"))
    one(g)
    assert not any(n.target is cached_weights for n in g.nodes)
    monkeypatch.setenv(route_grad_gather.ENV, "0")
    assert post_grad.config_patch() == {}
