"""How mxfx launches its Triton kernels: directly when run, through ``wrap_triton`` when traced.

Eager calls (and the bodies of the ``mxfx::*`` custom ops) launch a kernel as
``kernel[grid](...)``. While AOTAutograd traces a compiled graph on CUDA, the MX
ops are not kept as opaque custom ops: their Python bodies are traced, and every
kernel goes into the graph as a ``torch.library.wrap_triton`` call. Inductor
then launches those kernels straight from its generated code, with none of the
per-call cost of a custom op (the Python dispatcher, argument checks, the
launcher's specialization lookup: often more than the kernel itself). Inductor keeps each
user kernel as written: it is neither fused with nor rewritten into generated
code, so the dynamic-shape slow paths described in ``mxfx.kernels.mx.custom_ops`` do not
arise.

The policy's ``kernels="opaque"`` (``mxfx.Policy``; the backend sets it around its inner compile, see
:func:`kernels_launched`) or, where the policy leaves it out, ``MXFX_OPAQUE_KERNELS=1`` (read at every trace)
keeps the custom ops in graphs instead: a shorter first compile (Inductor analyses and compiles each inlined
kernel per call site), more host time per call; also to compare the two or to find the ops in Inductor's output
code (``TORCH_LOGS=output_code``). By default the backend picks one per graph (``kernels="auto"``,
:mod:`mxfx.policy.launch_cost`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from mxfx.device import triton_available
from mxfx.kernels.common import kernel_keys


def traced(t: torch.Tensor) -> bool:
    """True while ``t`` is a tracing stand-in (a fake or functional tensor of AOTAutograd), not data."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


def readable_on_host(t: torch.Tensor) -> bool:
    """True where ``t``'s values can be read now without a device sync or a trace-time guard: a CPU tensor of
    data, neither a tracing stand-in (:func:`traced`) nor a tensor Dynamo is tracing (code calling an mxfx op
    compiled with ``torch.compile``)."""
    return t.device.type == "cpu" and not traced(t) and not torch.compiler.is_compiling()


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in _ON
"""Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, CPU tests); read at import, as Triton reads it."""


OPAQUE_ENV = "MXFX_OPAQUE_KERNELS"
"""The environment switch that keeps the kernels opaque (1) or launched by Inductor (0) where a policy leaves
``kernels`` out."""

_CHOSEN: contextvars.ContextVar[bool | None] = contextvars.ContextVar("mxfx_opaque_kernels", default=None)
"""The compile's choice (:func:`kernels_launched`): True opaque, False inlined, None the environment's."""


@contextlib.contextmanager
def kernels_launched(mode: str | None):
    """Within: MX ops traced into a graph keep their kernels as ``mode`` says, "opaque" (custom ops) or "inductor"
    (``wrap_triton``, launched by Inductor's code); None leaves it to ``MXFX_OPAQUE_KERNELS``. The backend wraps
    its inner compile in it with the policy's ``kernels``."""
    token = _CHOSEN.set(None if mode is None else mode == "opaque")
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def opaque_kernels() -> bool:
    """Whether traced MX ops stay opaque custom ops: the compile's choice (:func:`kernels_launched`), else the
    ``MXFX_OPAQUE_KERNELS`` switch, True for 1/true/yes/on, False when unset or 0/false/no/off.

    Raises:
        ValueError: any other value of the switch (a typo should not silently pick a mode).
    """
    chosen = _CHOSEN.get()
    if chosen is not None:
        return chosen
    return env_switch(OPAQUE_ENV, False)


def env_switch(name: str, default: bool | None) -> bool | None:
    """The environment switch ``name``: True for 1/true/yes/on, False for 0/false/no/off, ``default`` when unset.

    Raises:
        ValueError: any other value (a typo should not silently pick a mode).
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}={value!r} is not a switch; set it to 1/true/yes/on or 0/false/no/off (or unset it)")


COMPILE_THREADS_ENV = "MXFX_COMPILE_THREADS"
"""Threads that compile a CUDA graph's kernels ahead (``mxfx.kernels.common.compile_ahead``; 0 turns it off)."""


def compile_threads() -> int:
    """``MXFX_COMPILE_THREADS`` (read at every compile, on every device, so that a typo shows on a CPU rehearsal
    too), else half the CPUs (at most 8, at least 1).

    Raises:
        ValueError: the variable is not a non-negative integer of ASCII digits.
    """
    value = os.environ.get(COMPILE_THREADS_ENV, "").strip()
    if not value:
        return max(1, min(8, (os.cpu_count() or 2) // 2))
    if not (value.isascii() and value.isdigit()):
        raise ValueError(
            f"{COMPILE_THREADS_ENV}={value!r}: give a number of threads such as 4 (0 turns compiling ahead off), or "
            "unset it"
        )
    return int(value)


def inline_in_graph(t: torch.Tensor) -> bool:
    """True when an MX op on ``t`` should be traced into the graph rather than kept as a custom op.

    That is: ``t`` is a CUDA tensor being traced, Triton imports, and the kernels are not to stay opaque
    (:func:`opaque_kernels`). CPU graphs always keep the custom ops
    (their reference bodies are plain torch code meant to run as written).
    """
    return traced(t) and triton_available(t) and not opaque_kernels()


def op_or_body(op, body, doc: str):
    """The function MX autograd code calls for one op: ``body(*args)`` (the op's Python body, whose
    kernels then enter the graph) when :func:`inline_in_graph` holds for the first tensor argument,
    else the custom op ``op(*args)``. ``doc`` becomes its docstring."""

    def call(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return body(*args, **kwargs) if inline_in_graph(first) else op(*args, **kwargs)

    call.__doc__ = doc
    call.op_or_body = op
    return call


def name_op_functions(namespace: dict) -> None:
    """Give each :func:`op_or_body` function bound in a module's ``namespace`` (its ``globals()``) the
    importable name it is bound to (``module.attr``). Graphs call these functions by reference, and
    Inductor's and AOTAutograd's caches pickle a graph's targets by that name: a function named
    ``op_or_body.<locals>.call`` cannot be found again, and would keep those caches from ever hitting."""
    for attr, fn in list(namespace.items()):
        if callable(fn) and getattr(fn, "op_or_body", None) is not None and fn.__name__ == "call":
            fn.__module__, fn.__name__, fn.__qualname__ = namespace["__name__"], attr, attr


_CAPPED: dict = {}


def _with_register_cap(kernel, num_warps: int, maxnreg: int):
    """``kernel`` as a one-config ``triton.autotune`` whose config caps registers per thread: the form of
    ``maxnreg`` that both a direct launch and Inductor's ``wrap_triton`` path honour (``wrap_triton`` takes no
    ``maxnreg`` launch option in torch 2.11 / 2.13). One config, so nothing is benchmarked."""
    key = (kernel, num_warps, maxnreg)
    if key not in _CAPPED:
        import triton

        _CAPPED[key] = triton.autotune([triton.Config({}, num_warps=num_warps, maxnreg=maxnreg)], key=[])(kernel)
    return _CAPPED[key]


def key_kernels_as_inductor(device: torch.device) -> None:
    """Point Triton at the ptxas torch ships (``torch/bin/ptxas``) and at Inductor's Triton cache folder for
    ``device`` (``TRITON_CACHE_DIR``), as Inductor does before it compiles or loads a kernel in this process,
    unless the user set either (a user's choice stands).

    Both are part of where Triton finds a compiled kernel. Without them, the kernels mxfx compiles itself (ahead, or
    at their first launch) are keyed with Triton's own ptxas and kept in Triton's own folder in a process whose
    Inductor compiled in its workers (a cold cache), and with torch's ptxas in Inductor's folder in one where
    Inductor loaded its cached graphs (a warm cache): a warm process finds none of them and compiles them again."""
    if not os.environ.get("TRITON_PTXAS_PATH"):
        ptxas = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
        if os.path.isfile(ptxas) and os.access(ptxas, os.X_OK):
            os.environ["TRITON_PTXAS_PATH"] = ptxas
    if os.environ.get("TRITON_CACHE_DIR") is None:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        index = device.index if device.index is not None else torch.cuda.current_device()
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(index)


def launch(kernel, grid: tuple, *args, maxnreg: int | None = None, **kwargs) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, through ``wrap_triton`` when a tensor argument is traced; while
    :func:`recording`, note the launch instead.

    Args:
        kernel: a ``triton.jit`` function.
        grid: launch grid (ints, or SymInts while tracing with dynamic shapes).
        args, kwargs: the kernel's arguments (constexprs and ``num_warps`` by keyword).
        maxnreg: cap on registers per thread (None: ptxas chooses; ignored under Triton's interpreter), for
            kernels whose occupancy is register-bound and measured faster capped.
    """
    kernel_keys.fix(kernel)  # before anything hashes the kernel (a dict key hashes its Triton cache key)
    if maxnreg is not None and not INTERPRETED:  # the interpreter has no registers to cap
        kernel = _with_register_cap(kernel, kwargs.pop("num_warps", 4), maxnreg)
    if _note(kernel, grid, args, kwargs):
        return
    if any(isinstance(a, torch.Tensor) and traced(a) for a in args):
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        _check_device(kernel, args)
        kernel[grid](*args, **kwargs)


def launch_direct(kernel, grid: tuple, *args, **kwargs) -> None:
    """Run ``kernel[grid](*args, **kwargs)`` as written, for kernels only custom-op bodies launch (Gluon kernels,
    whose launch options such as ``maxnreg`` Triton takes directly); while :func:`recording`, note it instead."""
    kernel_keys.fix(kernel)
    if not _note(kernel, grid, args, kwargs):
        _check_device(kernel, args)
        kernel[grid](*args, **kwargs)


def _check_device(kernel, args) -> None:
    """Refuse, naming the kernel, tensors Triton cannot launch on: a compiled kernel takes CUDA tensors (Triton's
    interpreter, ``TRITON_INTERPRET=1``, takes CPU ones)."""
    if INTERPRETED or kernel_keys.jit_function(kernel) is None:  # not a Triton kernel: its own rules
        return
    t = next((a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cuda"), None)
    if t is not None:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        raise ValueError(
            f"mxfx: Triton kernel {name} got a {t.device.type} tensor {tuple(t.shape)}: mxfx's Triton kernels run "
            "on CUDA tensors; on the CPU call the format's device_path functions (mxfx.kernels.*.device_path), "
            "which run the reference, or set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter"
        )


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One launch noted while :func:`recording`: ``kernel[grid](*args, **kwargs)``, its tensors fake."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


_RECORDING: contextvars.ContextVar[list[Recorded] | None] = contextvars.ContextVar("mxfx_recording", default=None)
_BEFORE_LAUNCH: list = []  # callables to run once before the next launch (:func:`before_next_launch`)


@contextlib.contextmanager
def recording():
    """Within: :func:`launch` and :func:`launch_direct` append a :class:`Recorded` to the yielded list instead of
    launching, and :func:`descriptor` builds host TMA descriptors of stand-ins (:class:`StandIn`): for running an
    op's body on fake tensors to learn which kernels, specialized how, it will launch."""
    seen: list[Recorded] = []
    token = _RECORDING.set(seen)
    try:
        yield seen
    finally:
        _RECORDING.reset(token)


def before_next_launch(fn) -> None:
    """Call ``fn()`` once, before the next kernel :func:`launch` or :func:`launch_direct` runs (in this process)."""
    _BEFORE_LAUNCH.append(fn)


def _note(kernel, grid, args, kwargs) -> bool:
    """Record the launch and return True while :func:`recording`; else run what waits for a launch, False."""
    seen = _RECORDING.get()
    if seen is not None:
        seen.append(Recorded(kernel, grid, args, kwargs))
        return True
    while _BEFORE_LAUNCH:
        _BEFORE_LAUNCH.pop(0)()
    return False


def aligned16(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element sits on a 16-byte boundary (TMA's and Triton's alignment); for a fake tensor,
    whether its storage offset keeps an aligned allocation's alignment (allocations are 16-byte aligned)."""
    return (t.storage_offset() * t.element_size() if traced(t) else t.data_ptr()) % 16 == 0


class StandIn:
    """What Triton's launcher and its host TMA descriptors read of a tensor (dtype, shape, strides, and the address
    modulo 16 it specializes on), without data: a fake tensor's stand-in for ``kernel.warmup``. The address assumes
    a 16-byte aligned allocation (the CUDA caching allocator's are 512-byte)."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape, self._strides = t.dtype, tuple(t.shape), tuple(t.stride())
        self._address = t.storage_offset() * t.element_size() % 16

    def data_ptr(self) -> int:
        return self._address

    def stride(self) -> tuple[int, ...]:
        return self._strides


def descriptor(make, t: torch.Tensor, *args, **kwargs):
    """``make(t, *args, **kwargs)``: a host TMA descriptor (``TensorDescriptor.from_tensor``) of ``t``, of its
    :class:`StandIn` while :func:`recording` (a fake tensor has no address to check)."""
    return make(StandIn(t) if _RECORDING.get() is not None else t, *args, **kwargs)
