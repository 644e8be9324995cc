"""mxfx.library.define: an op whose body runs on every device, whose fake gives the shapes a compile traces, and
that compiled graphs keep opaque."""

from __future__ import annotations

import pytest
import torch

from mxfx import library

CALLS = []


def _body(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    CALLS.append(k)
    return [x * k, x[:1].clone()]


def _fake(x, k):
    return [torch.empty_like(x), x.new_empty((1, *x.shape[1:]))]


OP = library.define("mxfxtest::scaled_and_first", "(Tensor x, int k) -> Tensor[]", _body, _fake)


def test_the_body_runs_eagerly_and_in_a_compiled_graph():
    x = torch.randn(4, 3)
    doubled, first = OP(x, 2)
    torch.testing.assert_close(doubled, 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(first, x[:1], rtol=0, atol=0)
    CALLS.clear()
    out = torch.compile(lambda t: OP(t, 3)[0] + 1, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, 3 * x + 1, rtol=0, atol=0)
    assert CALLS == [3]  # the body ran once at run time; tracing used the fake


def test_fake_tensors_take_the_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        doubled, first = OP(torch.empty(5, 7), 2)
    assert tuple(doubled.shape) == (5, 7) and tuple(first.shape) == (1, 7)


def test_a_second_definition_of_a_name_raises():
    with pytest.raises(RuntimeError):
        library.define("mxfxtest::scaled_and_first", "(Tensor x, int k) -> Tensor[]", _body, _fake)


@library.custom_op("mxfxtest::add_scaled_into", mutates_args=("out",))
def _add_scaled_into(x: torch.Tensor, out: torch.Tensor, k: float) -> torch.Tensor:
    """Adds ``k * x`` into ``out``; returns ``x * 2``."""
    out.add_(x, alpha=k)
    return x * 2


@library.register_fake(_add_scaled_into)
def _(x, out, k):
    return torch.empty_like(x)


def test_a_decorated_op_takes_its_schema_from_the_annotations():
    schema = str(_add_scaled_into._schema)
    assert "Tensor(a1!) out" in schema and "float k" in schema and schema.endswith("-> Tensor"), schema
    assert _add_scaled_into.__doc__.startswith("Adds ``k * x``")


@pytest.mark.parametrize("compiled", [False, True])
def test_a_decorated_op_mutates_its_argument_eagerly_and_compiled(compiled):
    x, out = torch.randn(6), torch.ones(6)
    fn = lambda x, out: _add_scaled_into(x, out, 0.5) + 1  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    doubled_plus_one = fn(x, out)
    torch.testing.assert_close(doubled_plus_one, 2 * x + 1, rtol=0, atol=0)
    torch.testing.assert_close(out, 1 + 0.5 * x, rtol=0, atol=0)  # the mutation reached the caller's tensor


@pytest.mark.parametrize("compiled", [False, True])
def test_a_call_autograd_would_record_raises_naming_the_op(compiled):
    x = torch.randn(4, 3, requires_grad=True)
    fn = (lambda t: OP(t, 2)[0]) if not compiled else torch.compile(lambda t: OP(t, 2)[0], backend="aot_eager")
    with pytest.raises(Exception, match=r"mxfxtest::scaled_and_first: has no derivative.*\(4, 3\).*no_grad"):
        fn(x)
    with torch.no_grad():
        torch.testing.assert_close(OP(x, 2)[0], 2 * x.detach(), rtol=0, atol=0)
    torch.testing.assert_close(OP(x.detach(), 2)[0], 2 * x.detach(), rtol=0, atol=0)
