"""The streamed MX kernels compile, for sm90 and without a GPU, to 128-bit global loads.

Those kernels run near the copy bandwidth only while every global load moves 16 bytes; a lost
divisibility hint or a changed index expression silently turns them into 2-byte loads (16 instead
of 2 per thread and row of 16 values, and an issue-bound kernel). ``tests/sass.py`` captures
the launch the library makes on CPU tensors, specializes it as Triton's launcher does, and compiles it
with the ptxas that Triton's wheel carries; these tests read the resulting SASS.
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")
sass = pytest.importorskip("tests.sass")

pytestmark = pytest.mark.skipif(bool(sass.missing()), reason=sass.missing())


def _compiled(name):
    case = next(c for c in sass.cases() if c[0] == name)
    _, modules, fn, args, kwargs = case
    launches = sass.captured_launches(modules, fn, *args, **kwargs)
    assert len(launches) == 1, f"{name}: expected one kernel launch, got {len(launches)}"
    return sass.compile_sm90(launches[0])


@pytest.mark.parametrize(
    "name", ["quantize rowwise", "swiglu+quantize (gate_up halves)", "quantize dual, source layout"]
)
def test_streamed_kernels_load_16_bytes_at_a_time(name):
    c = _compiled(name)
    loads = {op: n for op, n in c.memory.items() if op.startswith("LDG")}
    assert loads and set(loads) == {"LDG.E.128"}, (name, dict(c.memory))
    stores = {op: n for op, n in c.memory.items() if op.startswith("STG")}
    assert stores.get("STG.E.128", 0) >= 1, (name, stores)  # the qdata goes out 16 bytes at a time too


@pytest.mark.parametrize("name", ["swiglu+quantize (gate, up)", "swiglu + values + saved pairs (halves)"])
def test_swiglu_divides_without_range_check(name):
    """mxfx's SiLU (``mxfx.kernels.common.silu``) divides with a reciprocal and Newton steps: no ``div.rn`` range
    check (FCHK) and no branch to its slow path or call to it (BSSY, CALL); MUFU (the reciprocal and expf) present."""
    c = _compiled(name)
    assert c.counts.get("FCHK", 0) == 0 and c.counts.get("MUFU", 0) > 0, (name, dict(c.counts))
    assert c.counts.get("BSSY", 0) == 0 and c.counts.get("CALL", 0) == 0, (name, dict(c.counts))


def test_specialization_follows_the_launcher():
    """Integers equal to 1 become constants, others and aligned pointers get divisibility 16, and
    ``do_not_specialize`` arguments (token counts) stay plain."""
    from mxfx.kernels.mx import quantize

    x = torch.randn(64, 96, dtype=torch.bfloat16)
    (launch,) = sass.captured_launches([quantize], quantize.quantize_lastdim, x, "rceil")
    signature, constexprs, attrs = sass.specialize(launch.kernel, launch.args, launch.kwargs)
    names = list(launch.kernel.arg_names)
    assert signature["x_ptr"] == "*bf16" and attrs[(names.index("x_ptr"),)] == [["tt.divisibility", 16]]
    assert signature["RPR"] == "i32" and (names.index("RPR"),) not in attrs  # RPR = 96 / 32 = 3
    assert signature["sxc"] == "constexpr" and constexprs[(names.index("sxc"),)] == 1  # unit stride
    assert signature["R"] == "i32" and (names.index("R"),) not in attrs  # do_not_specialize, though 64 % 16 == 0
