"""Ops called on every step's hot path, defined on ``torch.library.Library`` with one kernel for every device.

``torch.library.custom_op`` runs each call through Python layers of its own (an autograd kernel, ADInplaceOrView, an
aliasing check of the outputs) before the body: about 50 us a call more than the body (a weight-cache lookup, 20 us
alone on a 2-core CPU, took 86 us as such an op, 32 us as an op defined here). An op defined here calls its body
from the dispatcher's ``CompositeExplicitAutograd`` kernel, a single Python call, and gives fake tensors through
``torch.library.register_fake``. It has no derivative: call it where autograd does not record (inside an
``autograd.Function``, under ``torch.no_grad()``, in a compiled graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_libraries: dict[str, torch.library.Library] = {}  # namespace -> the fragment holding this module's ops (kept alive)


def define(qualname: str, schema: str, body: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``qualname`` (``"namespace::name"``) with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor w, str rule) -> Tensor[]"``; a mutated argument annotated ``Tensor(a!)``), run by ``body`` on every
    device and by ``fake`` on fake tensors. Returns the op's default overload.

    Raises:
        RuntimeError: ``qualname`` is already defined (torch's message).
    """
    namespace, name = qualname.split("::")
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    library.define(name + schema)
    library.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    return getattr(getattr(torch.ops, namespace), name).default
