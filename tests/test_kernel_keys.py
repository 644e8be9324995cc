"""Triton cache keys of mxfx's kernels (``mxfx.kernels.common.kernel_keys``): a kernel's key is the same whichever
kernel a process keyed first, so that a second process finds the kernels the first one compiled (Triton 3.6 leaves
a callee's globals out of its caller's key when the caller is keyed first). Each order runs in a fresh process:
Triton computes a key once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

import mxfx.kernels.fp8_block.quantize  # noqa: E402  (needs Triton; the dotted chain a kernel below calls through)
from mxfx.kernels.common import kernel_keys  # noqa: E402
from mxfx.kernels.fp8_block import quantize  # noqa: E402

ORDER_SENSITIVE = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9)
"""Whether this Triton keys a caller before its callees when asked (3.9 computes a callee's key first itself)."""


class _Boom:
    """A global whose attributes raise."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")


BOOM = _Boom()


@triton.jit
def _through_a_chain(x):
    return mxfx.kernels.fp8_block.quantize._scales(x, x, True)


@triton.jit
def _through_a_raising_global(x):
    return BOOM.anything(x)


_KEYS = textwrap.dedent(
    """
    import json, sys
    from mxfx.kernels.common import kernel_keys, launch
    from mxfx.kernels.fp8_block import quantize
    first = sys.argv[1]
    if first != "-":  # the launch path of a register-capped kernel (its wrapper is kept in a dict), recorded
        with launch.recording():
            launch.launch(getattr(quantize, first), (1,), maxnreg=128, num_warps=4)
    kernels = ("_dual_kernel", "_quantize_kernel", "_route_grad_kernel", "_swiglu_save_kernel")
    for name in kernels:
        kernel_keys.fix(getattr(quantize, name))
    print(json.dumps({name: getattr(quantize, name).cache_key for name in kernels}))
    """
)


def _keys(first: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _KEYS, first], cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not ORDER_SENSITIVE, reason="this Triton keys a callee before its caller itself (3.9+)")
def test_a_kernels_key_does_not_depend_on_which_kernel_was_keyed_first():
    # _dual_kernel and _quantize_kernel share their E4M3 helpers (and through them two constexpr globals)
    orders = [_keys(first) for first in ("-", "_dual_kernel", "_quantize_kernel", "_swiglu_save_kernel")]
    assert all(keys == orders[0] for keys in orders[1:]), orders


def test_callees_are_found_by_name_and_through_modules():
    names = {f.fn.__name__ for f in kernel_keys._callees(quantize._dual_kernel)}
    assert {"_row_tiles", "_col_tiles", "slot_rows"} <= names, names  # direct callees (slot_rows: another module)
    assert "_encode" not in names  # called through _row_tiles only
    assert kernel_keys.jit_function(quantize._dual_kernel) is quantize._dual_kernel
    assert kernel_keys.jit_function(object()) is None


def test_a_kernel_is_keyed_after_its_callees():
    kernel_keys.fix(quantize._route_grad_kernel)
    for callee in kernel_keys._callees(quantize._route_grad_kernel):
        assert id(callee) in kernel_keys._FIXED
    # the constexpr globals its callees read are part of its key, as when each is keyed alone
    names = {name for name, _ in quantize._route_grad_kernel.used_global_vals}
    assert "HW_E4M3_CONVERSION" in names, names


def test_callees_through_dotted_chains_and_a_global_that_raises_leaves_the_launch_alone():
    assert quantize._scales in kernel_keys._callees(_through_a_chain)
    kernel_keys.fix(_through_a_raising_global)  # no error: Triton keys it as it would have
    assert id(_through_a_raising_global) not in kernel_keys._FIXED
    plain = object()
    kernel_keys.fix(plain)  # not a kernel: nothing noted
    assert id(plain) not in kernel_keys._FIXED
