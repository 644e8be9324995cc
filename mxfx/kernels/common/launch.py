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
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from mxfx.device import triton_available


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


def compile_with_torch_ptxas() -> None:
    """Point Triton at the ptxas torch ships (``torch/bin/ptxas``), as Inductor does before it compiles or loads a
    kernel in this process, unless ``TRITON_PTXAS_PATH`` is set already (a user's choice stands).

    The ptxas is part of a kernel's key in Triton's cache. Without this, the kernels the ``mxfx::`` ops launch
    themselves are compiled with Triton's own ptxas in a process whose Inductor compiled in its workers (a cold
    cache) and with torch's in one where Inductor loaded its cached graphs (a warm cache): a warm process finds none
    of them and compiles them again."""
    if os.environ.get("TRITON_PTXAS_PATH"):
        return
    ptxas = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    if os.path.isfile(ptxas) and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = ptxas


def launch(kernel, grid: tuple, *args, maxnreg: int | None = None, **kwargs) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, through ``wrap_triton`` when a tensor argument is traced.

    Args:
        kernel: a ``triton.jit`` function.
        grid: launch grid (ints, or SymInts while tracing with dynamic shapes).
        args, kwargs: the kernel's arguments (constexprs and ``num_warps`` by keyword).
        maxnreg: cap on registers per thread (None: ptxas chooses; ignored under Triton's interpreter), for
            kernels whose occupancy is register-bound and measured faster capped.
    """
    if maxnreg is not None and not INTERPRETED:  # the interpreter has no registers to cap
        kernel = _with_register_cap(kernel, kwargs.pop("num_warps", 4), maxnreg)
    if any(isinstance(a, torch.Tensor) and traced(a) for a in args):
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
