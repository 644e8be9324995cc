"""A gloo process group that counts the bytes each collective hands to the transport (for the distributed tests).

:func:`register` adds the ``"mxfxcount"`` backend: a Python :class:`torch.distributed.ProcessGroup`
that forwards every call to a gloo group and appends ``(collective, dtype, bytes)`` to ``log``
(bytes of the local input: what this rank sends into the collective). Counting at the process
group is the public extension point: nothing of torch is patched. Methods are listed under
both spellings torch has used (``_allgather_base`` up to 2.11, ``all_gather_single`` after).
"""

from __future__ import annotations

import torch.distributed as dist

BACKEND = "mxfxcount"

# method -> (collective, which positional argument holds the local input; a list (of lists) is flattened)
_COUNTED = {
    "_allgather_base": ("all_gather", 1),
    "all_gather_single": ("all_gather", 1),
    "allgather": ("all_gather", 1),
    "allgather_into_tensor_coalesced": ("all_gather", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "alltoall": ("all_to_all", 1),
}
_INNER = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
}  # the gloo backend's names for torch 2.13's process-group methods
_PAIRWISE = {
    "allgather_into_tensor_coalesced": "_allgather_base",
    "reduce_scatter_tensor_coalesced": "_reduce_scatter_base",
}
_FORWARDED = ("broadcast", "gather", "scatter", "barrier", "reduce", "send", "recv")


def _flatten(x):
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flatten(item)]
    return [x]


_target: list = []  # [the log the groups append to]: register() points it at its caller's list


def register(log: list) -> None:
    """Register the counting backend (once per process); from now on every rank's counting groups append
    ``(collective, dtype, bytes sent)`` to ``log``, those created before this call included."""
    _target[:] = [log]
    if BACKEND in dist.Backend.backend_list:
        return

    def counted(name, collective, index):
        def method(self, *args, **kwargs):
            for t in _flatten(args[index]):
                _target[0].append((collective, t.dtype, t.numel() * t.element_size()))
            inner = getattr(self.inner, name, None)
            if inner is not None:
                return inner(*args, **kwargs)
            if name in _PAIRWISE:  # gloo has no tensor-coalesced form: one collective per pair, in order
                works = [getattr(self.inner, _PAIRWISE[name])(o, i, *args[2:]) for o, i in zip(args[0], args[1])]
                for w in works[:-1]:
                    w.wait()
                return works[-1]
            return getattr(self.inner, _INNER[name])(*args, **kwargs)

        return method

    def forwarded(name):
        return lambda self, *args, **kwargs: getattr(self.inner, name)(*args, **kwargs)

    body = {name: counted(name, c, i) for name, (c, i) in _COUNTED.items()}
    body.update({name: forwarded(name) for name in _FORWARDED})

    def __init__(self, inner):
        dist.ProcessGroup.__init__(self, inner.rank(), inner.size())
        self.inner = inner

    body.update(
        __init__=__init__,
        getBackendName=lambda self: BACKEND,
        group_name=property(lambda self: dist.distributed_c10d._world.pg_names[self]),
    )
    counting_pg = type("CountingPG", (dist.ProcessGroup,), body)

    def create(store, rank, world, timeout):
        return counting_pg(dist.ProcessGroupGloo(store, rank, world, timeout))

    dist.Backend.register_backend(BACKEND, create, devices=["cpu"])


def total(log: list, collective: str, dtype=None) -> int:
    """Bytes recorded for ``collective`` (of ``dtype`` only, when given)."""
    return sum(b for c, d, b in log if c == collective and (dtype is None or d == dtype))
