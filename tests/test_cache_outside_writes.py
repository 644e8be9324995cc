"""Weights written outside the optimizer's own tensors (Megatron-style flat buffers): the next forward after any
optimizer step uses the weights as they are, whoever wrote them and through whichever view."""

import pytest
import torch
import torch.nn as nn

from mxfx.runtime import cache

D, H, OUT = 64, 96, 32
OPTS = {"inner": "aot_eager"}
N_WEIGHTS = 2  # the two MX weights of MLP (biases are not cached)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, OUT, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


pytestmark = pytest.mark.usefixtures("fresh_weight_cache")


def _x():
    return torch.randn(48, D, generator=torch.Generator().manual_seed(1))


def _flat_views(model) -> torch.Tensor:
    """Set every parameter to a view of one flat FP32 buffer (``p.data = flat[a:b].view(...)``); returns it.

    Each parameter keeps its own version counter: writes to ``flat`` never bump it."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def _fresh_output(model, x):
    """Output of a new model holding ``model``'s current weights, its caches built from scratch."""
    torch.manual_seed(0)
    fresh = MLP()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        return torch.compile(fresh, backend="mxfp8", options=OPTS)(x)


class FlatAdd(torch.optim.Optimizer):
    """Holds the model's parameters but writes the flat buffer behind them, with no gradients at all."""

    def __init__(self, params, flat):
        super().__init__(params, {})
        self.flat = flat

    @torch.no_grad()
    def step(self, closure=None):
        self.flat.add_(1.0)


class MainParamsAdamW:
    """Megatron-style: gradients go to FP32 main copies (``p.grad`` is None afterwards), an inner AdamW steps the
    copies, then the result is copied into the flat buffer the model's parameters view, after that step."""

    def __init__(self, model, flat):
        self.params = list(model.parameters())
        self.flat = flat
        self.main = [p.detach().clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.main, lr=0.05)

    def move_grads(self):
        for p, m in zip(self.params, self.main):
            m.grad, p.grad = p.grad.clone(), None

    def step(self):
        self.inner.step()
        with torch.no_grad():
            self.flat.copy_(torch.cat([m.detach().reshape(-1) for m in self.main]))


def _check_next_forward(cm, model, x, before):
    """The next forward equals a freshly compiled model of the current weights, and differs from ``before``; a second
    forward of the same step reuses the caches (no quantize)."""
    with torch.no_grad():
        y = cm(x)
    torch.testing.assert_close(y, _fresh_output(model, x), rtol=0, atol=0)
    assert (y - before).abs().max() > 1e-3  # a stale cache would reproduce ``before``
    q = cache.stats()["quantize"]
    with torch.no_grad():
        cm(x)
    assert cache.stats()["quantize"] == q  # once per step: the second microbatch reads the same caches


@pytest.mark.parametrize("compiled_step", [False, True])
def test_optimizer_writing_the_flat_buffer_without_gradients(compiled_step):
    """(a) the stepping optimizer holds the parameters, but writes them through another view of their storage and
    none of them has a gradient: their version counters never move."""
    torch.manual_seed(0)
    model, x = MLP(), _x()
    flat = _flat_views(model)
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = FlatAdd(model.parameters(), flat)
    step = torch.compile(opt.step, backend="mxfp8", options=OPTS) if compiled_step else opt.step
    versions = [p._version for p in model.parameters()]
    for _ in range(2):
        with torch.no_grad():
            before = cm(x)
        marked = cache.stats()["stale_after_step"]
        step()
        assert [p._version for p in model.parameters()] == versions
        assert cache.stats()["stale_after_step"] == marked + N_WEIGHTS  # the hook could not prove them fresh
        _check_next_forward(cm, model, x, before)


@pytest.mark.parametrize("compiled_step", [False, True])
def test_inner_optimizer_copied_into_the_flat_buffer_after_its_step(compiled_step):
    """(b) the inner optimizer holds FP32 copies; the model's weights are written after its step, by a copy into
    the flat buffer their parameters view."""
    torch.manual_seed(0)
    model, x = MLP(), _x()
    flat = _flat_views(model)
    cm = torch.compile(model, backend="mxfp8", options=OPTS)
    opt = MainParamsAdamW(model, flat)
    step = torch.compile(opt.step, backend="mxfp8", options=OPTS) if compiled_step else opt.step
    for _ in range(2):
        cm(x).float().pow(2).mean().backward()
        opt.move_grads()
        with torch.no_grad():
            before = cm(x)
        step()
        _check_next_forward(cm, model, x, before)
