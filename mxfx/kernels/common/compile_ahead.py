"""Compile ahead: the Triton kernels a CUDA graph's mxfx custom ops will launch, compiled on a thread pool while
the graph itself is compiled, rather than one after another at their first launches.

An op kept opaque in a graph launches its kernels from its body at run time, and Triton compiles each kernel
specialization there, in the step, on one thread. Within :func:`during` (the backend's inner compile), every fake
call of a kernel op (:data:`KERNEL_OPS`; ``mxfx.library.observing_fakes``: AOTAutograd's trace of the forward and
backward, Inductor's lowering) also runs the op's body on fake tensors of the same shapes, strides and storage
offsets, its launches recorded (``mxfx.kernels.common.launch.recording``). Each recorded launch goes to Triton's
``warmup`` under an async-compile mode (``triton.AsyncCompileMode``) whose compiles run on in the pool: Triton
specializes and keys the kernel as for the launch itself (dtypes, 16-byte alignment, integers equal to 1 or
divisible by 16), so a specialization is compiled once however many ops launch it. Before the next launch of any
mxfx kernel, the compiles are awaited and their kernels enter Triton's in-process cache
(``launch.before_next_launch``), so that none is compiled twice.

Best effort, with no effect on results: an op whose body cannot run on fake tensors (sizes not static, a value read
on the host) is left to compile at its launch; a compile that fails here is dropped, and its launch compiles it
again and raises as it would have. ``MXFX_COMPILE_THREADS`` sets the pool's threads
(:func:`mxfx.kernels.common.launch.compile_threads`; 0: off).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging

import torch
import triton

from mxfx import library
from mxfx.kernels.common import launch

log = logging.getLogger(__name__)

KERNEL_OPS = "mxfx.kernels."
"""Where the ops whose bodies run on fake tensors are defined: kernel ops, whose bodies compute fresh outputs (or
write a given one) and keep no state. Others (the weight-cache lookup, the fused gradient write) keep state that a
body run on fake tensors would corrupt, and are never run here."""

THREAD_PREFIX = "mxfx-compile"
"""The name prefix of the pool's threads (Triton's compile listener can tell their compiles apart by it)."""


@functools.cache
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=THREAD_PREFIX)


@contextlib.contextmanager
def during(device: torch.device, workers: int):
    """Within (the inner compile of a graph on CUDA ``device``): compile ahead, on a pool of ``workers`` threads
    (:func:`mxfx.kernels.common.launch.compile_threads`), the kernels of the mxfx ops traced, where Triton compiles
    (not its interpreter) and ``workers`` is not 0."""
    workers = 0 if launch.INTERPRETED else workers
    if not workers:
        yield
        return
    batch = _Batch(device, _pool(workers))
    with library.observing_fakes(batch.observe):
        yield


def _static(value) -> bool:
    """No symbolic size in ``value`` (a tensor's shape and strides, an int, or a list of them)."""
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in (*value.shape, *value.stride(), value.storage_offset()))
    if isinstance(value, (list, tuple)):
        return all(_static(v) for v in value)
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _signature(value):
    """A hashable form of an argument as a kernel specialization could see it (tensors by metadata)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


def _fresh(value):
    """A new fake tensor with ``value``'s shape, strides, storage offset, dtype and device (under the fake mode of the
    fake call), so that running a body touches none of the trace's tensors."""
    if isinstance(value, torch.Tensor):  # its storage offset kept: the alignment a kernel specializes on
        offset = value.storage_offset()
        extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride())) if value.numel() else 0
        storage = torch.empty(offset + extent, dtype=value.dtype, device=value.device)
        return storage.as_strided(value.shape, value.stride(), offset)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    return value


def _stand_in(value):
    return launch.StandIn(value) if isinstance(value, torch.Tensor) else value


class _Batch:
    """The ops seen and kernels submitted in one inner compile."""

    def __init__(self, device: torch.device, pool: concurrent.futures.Executor):
        self.device = device
        self.mode = _Submitted(pool)
        self.seen: set = set()
        self.nested = False

    def observe(self, op, body, args, kwargs) -> None:
        """The fake-call observer (``mxfx.library.observing_fakes``)."""
        if not body.__module__.startswith(KERNEL_OPS):
            return
        if self.nested:  # an op called by a body being run: its fake stands for it; its own body runs below
            self._run(body, args, kwargs)
            return
        if not (_static(args) and _static(list(kwargs.values()))):
            return
        key = (op, _signature(args), _signature(tuple(sorted(kwargs.items()))))
        if key in self.seen:
            return
        self.seen.add(key)
        with launch.recording() as launches:
            self.nested = True
            try:
                self._run(body, args, kwargs)
            except Exception as e:  # noqa: BLE001 - best effort: the launch compiles it instead
                log.debug("mxfx: %s not compiled ahead: %s", op, e)
                return
            finally:
                self.nested = False
        self._submit(launches)

    def _run(self, body, args, kwargs) -> None:
        with torch.no_grad():
            body(*_fresh(args), **{k: _fresh(v) for k, v in kwargs.items()})

    def _submit(self, launches: list[launch.Recorded]) -> None:
        if not launches:
            return
        before = len(self.mode.pending)
        try:
            with torch.cuda.device(self.device), self.mode:
                for r in launches:
                    args = [_stand_in(a) for a in r.args]
                    r.kernel.warmup(*args, grid=r.grid, **{k: _stand_in(v) for k, v in r.kwargs.items()})
        except Exception as e:  # noqa: BLE001 - another async-compile mode active, a launcher Triton changed
            log.debug("mxfx: kernels not compiled ahead: %s", e)
        if len(self.mode.pending) > before and not self.mode.awaited:
            self.mode.awaited = True
            launch.before_next_launch(self.mode.finish)


class _Submitted(triton.AsyncCompileMode):
    """Triton's async-compile mode whose compiles outlive the ``with`` block that submitted them: each Triton cache
    key is submitted to the pool once (``pending``), and :meth:`finish` awaits them all and lets Triton put their
    kernels in its cache."""

    def __init__(self, pool: concurrent.futures.Executor):
        super().__init__(pool)
        self.pending: dict = {}  # Triton cache key -> triton.FutureKernel
        self.awaited = False  # finish is due before the next launch

    def submit(self, key, compile_fn, finalize_fn, *cleanup_fn):  # Triton >= 3.7 passes a cleanup function too
        kernel = self.pending.get(key)
        if kernel is None:
            kernel = self.pending[key] = triton.FutureKernel(finalize_fn, *cleanup_fn, self.executor.submit(compile_fn))
        return kernel  # kept out of raw_futures: leaving the block awaits none of them

    def finish(self) -> None:
        """Await every compile; one that failed is dropped (its launch compiles it again and raises)."""
        self.awaited = False
        for kernel in self.pending.values():
            kernel.result(ignore_errors=True)
