"""Operand dtypes under mxfx: what eager rejects fails the same way compiled; float16's top of range."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import mxfx
from mxfx import backend, report
from mxfx.passes import grouped_mm

SAME_DTYPE = "same dtype"  # eager: "mat1 and mat2 must have the same dtype"; _grouped_mm: "... to have the same dtype"


def _eager_error(fn, *args) -> str:
    with pytest.raises(RuntimeError, match=SAME_DTYPE) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("model_dtype,input_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.float32)])
def test_linear_mixed_dtypes_fail_as_in_eager(model_dtype, input_dtype):
    model = nn.Linear(64, 64).to(model_dtype)
    x = torch.randn(4, 64, dtype=input_dtype)
    eager = _eager_error(model, x)
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})
    with pytest.raises(Exception) as info:  # raised while compiling, as plain torch.compile does
        compiled(x)
    assert eager.splitlines()[0] in str(info.value)
    record = mxfx.last_report().records[0]
    assert not record.rewritten and "outside autocast" in record.reason, record


def test_linear_mixed_dtypes_under_autocast_still_rewritten():
    """Autocast casts both operands in eager, so the op runs there and is rewritten here (bf16 out, as eager)."""
    model = nn.Linear(64, 64)
    x = torch.randn(4, 64, dtype=torch.float16)
    with torch.autocast("cpu", torch.bfloat16):
        ref = model(x)
        y = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    assert mxfx.last_report().count("linear", rewritten=True) == 1


def _experts(x, w, offs):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs)


def test_grouped_mm_mixed_dtypes_fail_as_in_eager():
    """Eager rejects the mixed grouped GEMM; compiled, Dynamo's own fake kernel rejects it before mxfx sees it."""
    x, w = torch.randn(32, 32, dtype=torch.bfloat16), torch.randn(2, 64, 32)  # FP32 expert weights, no cast
    offs = torch.tensor([16, 32], dtype=torch.int32)
    _eager_error(_experts, x, w, offs)
    with pytest.raises(Exception) as plain:
        torch.compile(_experts, backend="eager")(x, w, offs)
    torch._dynamo.reset()
    with pytest.raises(Exception) as mx:
        torch.compile(_experts, backend="mxfp8", options={"inner": "aot_eager"})(x, w, offs)
    assert type(mx.value) is type(plain.value) and "dtype" in str(mx.value)


def test_grouped_mm_pass_leaves_mixed_dtypes_as_written():
    """A graph that reaches the pass with mixed operand dtypes (any tracer whose fake kernel accepts them)
    keeps the op as written, so it fails where eager does rather than run in MXFP8."""
    gm = torch.fx.symbolic_trace(_experts)
    values = {
        "x": torch.randn(32, 32, dtype=torch.float16),
        "w": torch.randn(2, 64, 32),
        "offs": torch.tensor([16, 32], dtype=torch.int32),
    }
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = values[node.target]
        elif node.target == "transpose":
            node.meta["example_value"] = values["w"].transpose(-2, -1)
    pm = report.PrecisionMap()
    assert grouped_mm.run(gm, mxfx.Policy(), pm) == 0
    (record,) = pm.records
    assert not record.rewritten and "x float16, weight float32" in record.reason, record


def test_float16_top_of_range_overflows_and_warns_once(monkeypatch):
    """65504 (float16's max) rounds to 2^8 x 256 = 65536 under rceil: inf in float16; eager gives 65504."""
    monkeypatch.setattr(backend, "_warned_float16", False, raising=False)
    model = nn.Linear(32, 32, bias=False).half()
    with torch.no_grad():
        model.weight.zero_()
        model.weight[:, 0] = 1.0
    x = torch.zeros(1, 32, dtype=torch.float16)
    x[0, 0] = 65504.0
    assert model(x)[0, 0].item() == 65504.0
    compiled = torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})
    with pytest.warns(UserWarning, match="float16.*bf16 autocast") as record:
        y = compiled(x)
    assert torch.isinf(y[0, 0]), y[0, 0]
    assert sum("float16" in str(w.message) for w in record) == 1
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second float16 graph compiles silently
        torch.compile(model, backend="mxfp8", options={"inner": "aot_eager"})(x)
