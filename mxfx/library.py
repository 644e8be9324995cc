"""mxfx's torch ops, defined on ``torch.library.Library`` with one kernel for every device.

``torch.library.custom_op`` runs each call through Python layers of its own (an autograd kernel, ADInplaceOrView, an
aliasing check of the outputs) before the body: about 50 us a call more than the body (a weight-cache lookup, 20 us
alone on a 2-core CPU, took 86 us as such an op, 32 us as an op defined here). An op defined here calls its body
from the dispatcher's ``CompositeExplicitAutograd`` kernel, a single Python call, and gives fake tensors through
``torch.library.register_fake``. It has no derivative: call it where autograd does not record (inside an
``autograd.Function``, under ``torch.no_grad()``, in a compiled graph); a call autograd would record raises (the
body's and the fake's check, a few microseconds). Its body must return fresh tensors (no input, no view of one):
the schema declares no aliasing, and nothing checks it at run time.

Two ways to define one: :func:`define` with a schema, a body and a fake; or :func:`custom_op` as a decorator over a
type-annotated body (the schema inferred as ``torch.library.custom_op`` infers it), its fake given by
:func:`register_fake`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable

import torch

_libraries: dict[str, torch.library.Library] = {}  # namespace -> the fragment holding this module's ops (kept alive)
_bodies: dict[torch._ops.OpOverload, Callable] = {}  # op -> its body
_fake_observer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("mxfx_fake_observer", default=None)


def _library(qualname: str) -> tuple[torch.library.Library, str, str]:
    namespace, name = qualname.split("::")
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return library, namespace, name


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of a call, those inside list arguments included."""
    return [
        t
        for a in (*args, *kwargs.values())
        for t in (a if isinstance(a, (list, tuple)) else (a,))
        if isinstance(t, torch.Tensor)
    ]


def _refuse_autograd(qualname: str, args: tuple, kwargs: dict) -> None:
    """Raise where autograd would record a call of ``qualname``: grad mode on and a tensor argument (or one in a
    list) requiring grad. Torch's fallback for an op without a derivative would let the backward run and give a
    wrong or no gradient."""
    if not torch.is_grad_enabled():
        return
    for t in _tensors(args, kwargs):
        if t.requires_grad:
            raise RuntimeError(
                f"{qualname}: has no derivative, and an argument of shape {tuple(t.shape)} requires grad; call "
                f"it under torch.no_grad() (or on detached tensors), or use mxfx's autograd ops (mxfx.ops) "
                f"where a gradient must flow through it"
            )


def _one_device(qualname: str, args: tuple, kwargs: dict) -> None:
    """Raise unless every tensor argument (or one in a list) is on one device: the fake also answers a call with a
    meta tensor among real ones, and would give the first argument's device uninitialized memory."""
    tensors = _tensors(args, kwargs)
    if len({t.device for t in tensors}) > 1:
        shown = ", ".join(f"{tuple(t.shape)} on {t.device}" for t in tensors)
        raise ValueError(f"{qualname}: tensors on different devices ({shown}); move them to one device")


def _define(qualname: str, schema: str, body: Callable) -> torch._ops.OpOverload:
    library, namespace, name = _library(qualname)
    library.define(name + schema)

    def kernel(*args, **kwargs):
        _refuse_autograd(qualname, args, kwargs)
        return body(*args, **kwargs)

    library.impl(name, kernel, "CompositeExplicitAutograd")
    op = getattr(getattr(torch.ops, namespace), name).default
    _bodies[op] = body
    return op


def define(qualname: str, schema: str, body: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``qualname`` (``"namespace::name"``) with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor w, str rule) -> Tensor[]"``; a mutated argument annotated ``Tensor(a!)``), run by ``body`` on every
    device and by ``fake`` on fake tensors. Returns the op's default overload.

    Raises:
        RuntimeError: ``qualname`` is already defined (torch's message).
    """
    op = _define(qualname, schema, body)
    register_fake(op)(fake)
    return op


def custom_op(qualname: str, *, mutates_args: Iterable[str] = (), schema: str | None = None):
    """Decorator: the type-annotated function becomes the body of op ``qualname`` (``"namespace::name"``), its
    schema inferred by ``torch.library.infer_schema`` with ``mutates_args`` (or given as ``schema``); returns the
    op's default overload. Give it a fake with :func:`register_fake` before a compile traces it.

    Raises:
        RuntimeError: ``qualname`` is already defined (torch's message).
        ValueError: an annotation ``torch.library.infer_schema`` cannot map (torch's message).
    """

    def wrap(body: Callable) -> torch._ops.OpOverload:
        s = schema or torch.library.infer_schema(body, mutates_args=tuple(mutates_args))
        op = _define(qualname, s, body)
        op.__doc__ = body.__doc__
        return op

    return wrap


def register_fake(op: torch._ops.OpOverload):
    """Decorator: the function gives ``op``'s outputs on fake tensors (shapes, dtypes, strides; no data)."""
    library, _, _ = _library(op.name())

    def wrap(fake: Callable) -> Callable:
        def checked(*args, **kwargs):
            _refuse_autograd(op.name(), args, kwargs)
            _one_device(op.name(), args, kwargs)
            out = fake(*args, **kwargs)
            observer = _fake_observer.get()
            if observer is not None:
                observer(op, _bodies[op], args, kwargs)
            return out

        torch.library.register_fake(op, checked, lib=library)
        return fake

    return wrap


@contextlib.contextmanager
def observing_fakes(observer: Callable):
    """Within (this thread): every fake call of an op defined here then calls ``observer(op, body, args, kwargs)``
    with the op's body and the fake's arguments (fake tensors), after the fake; the body itself is not run."""
    token = _fake_observer.set(observer)
    try:
        yield
    finally:
        _fake_observer.reset(token)
