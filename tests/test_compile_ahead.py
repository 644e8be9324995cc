"""Compiling ahead (``mxfx.kernels.common.compile_ahead``): the kernels an op's fake call records, and their
compiles on the pool.

CPU: a fake call of an opaque op on CUDA fake tensors records the launches its body makes on real tensors of the
same shapes (kernel, grid, Triton's specialization: dtypes, 16-byte alignment, integers equal to 1 or divisible by
16), once per op and shapes; the sm90 grouped GEMM's launch, host TMA descriptors included, compiles for sm90 from
the record; a body that fails on fake tensors is skipped. GPU: a compiled fp8_block model's first step in a fresh
process compiles mxfx's kernels on the pool's threads and none of them again on the main thread, a warm process
compiles none, and both have the loss of a run that compiles nothing ahead.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mxfx import library
from mxfx.kernels.common import launch

triton = pytest.importorskip("triton")
sass = pytest.importorskip("tests.sass")
compile_ahead = pytest.importorskip("mxfx.kernels.common.compile_ahead")

from mxfx.kernels.fp8_block import custom_ops, gemm as block_gemm, quantize  # noqa: E402  (needs Triton)
from mxfx.kernels.mx import custom_ops as mx_custom_ops, quantize as mx_quantize  # noqa: E402


class _Seen(compile_ahead._Batch):
    """A batch that keeps the launches it would submit."""

    def __init__(self):
        super().__init__(torch.device("cuda", 0), pool=None)
        self.submitted: list[list[launch.Recorded]] = []

    def _submit(self, launches):
        self.submitted.append(launches)


def _fake_calls(fn, *shapes_and_dtypes):
    """Run ``fn`` on CUDA fake tensors of these (shape, dtype[, storage offset]) with the ops opaque; the batch."""
    batch = _Seen()
    with launch.kernels_launched("opaque"), library.observing_fakes(batch.observe), FakeTensorMode():
        args = []
        for shape, dtype, *offset in shapes_and_dtypes:
            n = torch.Size(shape).numel()
            base = torch.empty(n + (offset[0] if offset else 0), dtype=dtype, device="cuda")
            args.append(base.narrow(0, offset[0] if offset else 0, n).view(shape))
        fn(*args)
    return batch


def _specialized(r) -> tuple:
    return r.kernel, r.grid, sass.specialize(r.kernel, [compile_ahead._stand_in(a) for a in r.args], r.kwargs)


_QUANTIZES = {  # an op as the graph calls it, and the Triton-path function its body reaches on CUDA
    "fp8_block": (custom_ops.block_quantize, quantize, quantize.quantize_1x128),
    "mxfp8": (mx_custom_ops.quantize, mx_quantize, mx_quantize.quantize_lastdim),
}


@pytest.mark.skipif(launch.INTERPRETED, reason="records compiled-mode launches")
@pytest.mark.parametrize("fmt", sorted(_QUANTIZES))
@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "offset-8-bytes"])
def test_a_fake_call_records_the_launches_of_a_real_call(fmt, offset):
    op, module, entry = _QUANTIZES[fmt]
    m, k = 384, 640
    batch = _fake_calls(lambda x: op(x, "rceil"), ((m, k), torch.bfloat16, offset))
    assert len(batch.submitted) == 1
    base = torch.randn(m * k + offset, dtype=torch.bfloat16)
    real = sass.captured_launches([module], entry, base[offset:].view(m, k), "rceil")
    assert real and [_specialized(r) for r in batch.submitted[0]] == [
        (r.kernel, r.grid, sass.specialize(r.kernel, r.args, r.kwargs)) for r in real
    ]
    # the alignment Triton specializes on is read from the fake's storage offset: x is 16-byte aligned or not
    _, _, (_, _, attrs) = _specialized(batch.submitted[0][0])
    assert ((0,) in attrs) == (offset == 0)


@pytest.mark.skipif(launch.INTERPRETED, reason="records compiled-mode launches")
def test_an_op_is_observed_once_per_shapes():
    def twice(x, y):
        for t in (x, x, y):
            custom_ops.block_quantize(t, "rceil")

    batch = _fake_calls(twice, ((256, 512), torch.bfloat16), ((128, 512), torch.bfloat16))
    assert [r[0].grid for r in batch.submitted] == [(8, 4, 1), (4, 4, 1)]


@pytest.mark.skipif(launch.INTERPRETED, reason="records compiled-mode launches")
def test_a_body_that_fails_on_fakes_submits_nothing(monkeypatch):
    op = torch.ops.mxfx.block_quantize.default

    def reads_values(x, rule):
        raise RuntimeError("a value read on the host")

    monkeypatch.setitem(library._bodies, op, reads_values)
    batch = _fake_calls(lambda x: custom_ops.block_quantize(x, "rceil"), ((256, 512), torch.bfloat16))
    assert batch.submitted == []


def test_only_kernel_ops_run_their_bodies(monkeypatch):
    """The weight-cache lookup and the fused gradient write keep state: a body run on fake tensors would corrupt it."""
    ran = []
    for op in (torch.ops.mxfx.cached_weight.default, torch.ops.mxfx.wgrad_into_grad.default):
        body = functools.wraps(library._bodies[op])(lambda *a, **k: ran.append(op))  # its module, a record of a run
        _Seen().observe(op, body, (), {})
    assert ran == []
    _Seen().observe(op, functools.wraps(library._bodies[torch.ops.mxfx.block_quantize.default])(body), (), {})
    assert ran == [op]  # a kernel op's body runs (on no arguments here)


@pytest.mark.skipif(bool(sass.missing()), reason=sass.missing())
def test_the_sm90_grouped_gemm_compiles_from_its_record(monkeypatch):
    """The Gluon kernel's host TMA descriptors are built from stand-ins of the fake operands."""
    if block_gemm._sm90_kernel() is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    monkeypatch.setattr("mxfx.device.capability", lambda device: (9, 0))
    monkeypatch.setattr("mxfx.device.num_sms", lambda device: 132)
    s, g, n, k = 1024, 4, 512, 1024

    def gemm(a, sa, b, sb, offs):
        custom_ops.block_grouped_mm(a, sa.view(k // 128, s).t(), b, sb, offs, torch.bfloat16)

    batch = _fake_calls(
        gemm,
        ((s, k), torch.float8_e4m3fn),
        ((k // 128 * s,), torch.float32),
        ((g, n, k), torch.float8_e4m3fn),
        ((g, n // 128, k // 128), torch.float32),
        ((g,), torch.int32),
    )
    (launches,) = batch.submitted
    assert [r.kernel.__name__ for r in launches] == ["_schedule_kernel", "_grouped_kernel"]
    r = launches[1]
    compiled = sass.compile_sm90(sass.Launch(r.kernel, r.grid, [compile_ahead._stand_in(a) for a in r.args], r.kwargs))
    assert compiled.counts.get("QGMMA", 0) > 0


def test_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv(launch.COMPILE_THREADS_ENV, "3")
    assert launch.compile_threads() == 3
    monkeypatch.setenv(launch.COMPILE_THREADS_ENV, "0")
    assert launch.compile_threads() == 0
    monkeypatch.delenv(launch.COMPILE_THREADS_ENV)
    assert 1 <= launch.compile_threads() <= 8
    for junk in ("many", "-1", "2.5", "\u00b2", "\u0663"):  # a superscript and an Arabic-Indic digit are not ASCII
        monkeypatch.setenv(launch.COMPILE_THREADS_ENV, junk)
        with pytest.raises(ValueError, match=f"MXFX_COMPILE_THREADS={junk!r}: give a number of threads"):
            launch.compile_threads()


def test_a_typo_in_the_threads_fails_a_cpu_compile_too(monkeypatch):
    monkeypatch.setenv(launch.COMPILE_THREADS_ENV, "x")
    torch._dynamo.reset()
    f = torch.compile(torch.nn.Linear(64, 64), backend="mxfp8")
    with pytest.raises(Exception, match="MXFX_COMPILE_THREADS='x'"):
        f(torch.randn(32, 64))


_STEP = textwrap.dedent(
    """
    import json, os, threading, torch
    from triton import knobs
    from tests.test_block_gpu_step import LinearThenExperts, _step

    compiles = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        if not cache_hit and str(getattr(fn, "module", "")).startswith("mxfx"):
            name = f"{fn.fn.__module__}.{fn.__name__}"
            key = [name, str(src.signature), str(src.attrs), str(getattr(src, "constants", ""))]
            # where it was kept (the folder names the cache key), the kernel's Triton key and the globals in it
            kept = sorted({os.path.dirname(p) for p in (metadata_group or {}).values()})
            fn_globals = [n for (n, _) in dict(getattr(fn, "used_global_vals", {}))]
            where = [kept, fn.cache_key, fn_globals]
            compiles.append([threading.current_thread().name, key, where])

    knobs.compilation.listener = listener
    torch.manual_seed(0)
    model = LinearThenExperts().cuda()
    x = torch.randn(1000, 1024, device="cuda", requires_grad=True)
    offs = torch.tensor([300, 300, 700, 1000], dtype=torch.int32, device="cuda")
    fn = torch.compile(model, backend="mxfp8", options={"format": "fp8_block", "kernels": "opaque"})
    loss = _step(fn, x, offs)
    print(json.dumps({"loss": loss.item(), "compiles": compiles}))
    """
)


def _first_step(cache, threads: int) -> dict:
    """The first step of a compiled fp8_block model in a fresh process whose Inductor (and so Triton) caches live in
    folder ``cache``: Triton's folder is left for Inductor and mxfx to choose, as in a user's run."""
    env = dict(os.environ, MXFX_COMPILE_THREADS=str(threads), TORCHINDUCTOR_CACHE_DIR=str(cache))
    env.pop("TRITON_CACHE_DIR", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _STEP], cwd=root, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs an sm90+ CUDA GPU"
)
def test_a_first_step_compiles_mxfx_kernels_on_the_pool_and_none_twice(tmp_path):
    ahead = _first_step(tmp_path / "ahead", threads=4)
    on_pool = [key for thread, key, _ in ahead["compiles"] if thread.startswith(compile_ahead.THREAD_PREFIX)]
    on_main = [key for thread, key, _ in ahead["compiles"] if not thread.startswith(compile_ahead.THREAD_PREFIX)]
    names = {key[0].rsplit(".", 1)[1] for key in on_pool}
    assert {"_quantize_kernel", "_grouped_kernel"} <= names, ahead["compiles"]
    assert not [key for key in on_main if key in on_pool], "compiled ahead and again at the launch"
    # a warm process (its graphs from Inductor's cache, nothing traced) finds every kernel in Triton's cache
    warm = _first_step(tmp_path / "ahead", threads=4)
    assert warm["compiles"] == [], json.dumps({"warm": warm["compiles"], "cold": ahead["compiles"]}, indent=1)
    alone = _first_step(tmp_path / "alone", threads=0)
    assert not [t for t, _, _ in alone["compiles"] if t.startswith(compile_ahead.THREAD_PREFIX)]
    # the same kernels either way; the Triton GEMM's autotuning may pick another tile per process: FP32 sums in
    # another order, well inside 1e-4 of a mean of squares
    assert ahead["loss"] == pytest.approx(alone["loss"], rel=1e-4)
    assert warm["loss"] == pytest.approx(alone["loss"], rel=1e-4)
