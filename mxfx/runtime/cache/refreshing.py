"""Refresh at the step boundary: :func:`refresh` (explicit), the global optimizer step post-hook, install.

An eager ``optimizer.step()`` triggers the post-hook (:func:`install`), which rebuilds the caches on the
storages of that optimizer's parameters and advances the step count; :func:`refresh` rebuilds the caches of
given tensors now, for writes outside any optimizer step.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxfx.runtime.cache.compiled_step import _register_inductor_lowerings
from mxfx.runtime.cache.store import _Entry, _entries_on, _key, _rebuild, _region, state


def _refresh_entry(entry: _Entry, t: torch.Tensor, force: bool) -> bool:
    """Rebuild ``entry`` (a weight stored in ``t``'s storage) now; False when it was fresh or unreadable."""
    if not (entry.forms or entry.dropped):
        return False
    w = entry.weight()
    if w is None or _key(w) != (entry.storage.cdata, entry.offset, entry.shape, entry.stride, entry.dtype):
        w = _region(entry, t, t)
    if w is None:
        entry.version = None  # cannot read it from here: the next lookup rebuilds it
        return False
    if not force and entry.version == w._version:
        return False
    _rebuild(entry, w)
    entry.version, entry.step = w._version, state.step
    return True


def refresh(tensors, *, force: bool = True) -> int:
    """Rebuild, now, the caches of every weight stored in ``tensors`` (parameters or flat buffers).

    Use after writes outside any optimizer step that the version counter does not see
    (``p.data.copy_(...)``, a buffer assigned with ``p.data = ...``), and after any write
    outside an optimizer step to a parameter sharded by FSDP2; the optimizer hook and
    compiled steps call the same machinery.

    Args:
        tensors: a module (its parameters), a tensor or an iterable of tensors; the caches of every weight
            whose storage is one of theirs are rebuilt (a weight must lie inside
            the tensor's span, or be that tensor). A tensor subclass holding no weight's
            storage (an FSDP2 sharded DTensor parameter) advances the step count instead:
            every weight no step hook tracks (FSDP2's unsharded parameters) is rebuilt at
            its next lookup.
        force: rebuild even when the version counter says the cache is fresh.

    Returns:
        How many weights were rebuilt.

    Raises:
        TypeError: ``tensors`` neither a module, a tensor nor an iterable of tensors (naming the first other item).
    """
    if isinstance(tensors, torch.nn.Module):
        tensors = list(tensors.parameters())
    elif isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    else:
        try:
            tensors = list(tensors)
        except TypeError:
            tensors = [tensors]
    other = next((t for t in tensors if not isinstance(t, torch.Tensor)), None)
    if other is not None:
        raise TypeError(
            f"mxfx.refresh: takes a module, a tensor or an iterable of tensors (parameters or flat buffers); got "
            f"a {type(other).__name__} among them"
        )
    done, sharded = 0, False
    with state.lock, torch.no_grad():
        for t in tensors:
            entries = _entries_on(t)
            sharded |= not entries and type(t) not in (torch.Tensor, torch.nn.Parameter)  # a DTensor shard
            done += sum(_refresh_entry(e, t, force) for e in entries)
        state.step += sharded
    state.stats["refresh"] += done
    return done


def _step_post_hook(optimizer, args, kwargs) -> None:
    """Global optimizer step post-hook: rebuild the caches of the weights this optimizer holds.

    Parameters with a gradient were stepped: rebuilt unconditionally (this also
    covers optimizers that write through ``.data``). Weights a compiled step already
    rebuilt in-graph are rebuilt only if their version changed since. Parameters
    without a gradient cannot be proven fresh: the step may have written them where
    their version counter does not see it (through another view of their storage, a
    flat buffer their ``.data`` was set to, or ``.data`` itself), so their caches are
    marked stale and rebuilt at their next lookup (not at all if no forward reads
    them again). Advances the step count, so weights that are not found here
    (FSDP2's unsharded parameters, weights copied in by a wrapper after an inner
    optimizer's step) are rebuilt at their next lookup.
    """
    done = unproven = 0
    with state.lock, torch.no_grad():
        state.step += 1
        found: dict[int, list] = {}  # id(entry) -> [entry, a tensor holding it, stepped]: each entry once
        for group in optimizer.param_groups if state.entries else ():
            for p in group["params"]:
                for entry in _entries_on(p):
                    seen = found.setdefault(id(entry), [entry, p, False])
                    seen[2] |= p.grad is not None
        for entry, p, stepped in found.values():
            entry.owned = True
            in_graph, entry.graph_refreshed = entry.graph_refreshed, False
            if in_graph or stepped:
                done += _refresh_entry(entry, p, force=not in_graph)
            elif entry.forms or entry.dropped:
                entry.version = None  # the next lookup rebuilds it from the weight as it is then
                unproven += 1
    state.stats["refresh_eager"] += done
    state.stats["stale_after_step"] += unproven


_step_post_hook = torch.compiler.disable(_step_post_hook, recursive=True)


def install() -> None:
    """Install the global optimizer step post-hook and the Inductor lowering (idempotent).

    Called by the mxfp8 backend when it first compiles a graph with MX weights.
    """
    with state.lock:
        if state.hook_handle is None:
            state.hook_handle = register_optimizer_step_post_hook(_step_post_hook)
            _register_inductor_lowerings()


def uninstall() -> None:
    """Remove the global optimizer step post-hook (the version check still keeps forwards correct)."""
    with state.lock:
        if state.hook_handle is not None:
            state.hook_handle.remove()
            state.hook_handle = None


def hook_installed() -> bool:
    return state.hook_handle is not None
