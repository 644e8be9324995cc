"""MX weight all-gather for FSDP2: the all-gather moves MX forms (qdata + scales), not FP32/BF16 weights.

Opt in with one line before ``fully_shard``: ``mxfx.fsdp.mx_all_gather(model)`` (after ``import mxfx.fsdp``). Each eligible linear
weight (``[N, K]``, N a multiple of ``32 x world``, K a multiple of 32) becomes an :class:`MXWeight`
parameter, a tensor subclass around the FP32 main weight that implements FSDP2's public extension
points ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``:

* The local shard ``[N/world, K]`` is quantized once per optimizer step (the refresh; keyed on
  :func:`mxfx.cache.step_count` and the shard's version counter).
* A gather before forward sends the forward form (qdata ``[N/w, K]``, scales ``[N/w, K/32]``, blocked
  along K: dim-0 sharding never cuts a block); a gather inside backward sends the dgrad form (qdata
  ``[N/w, K]``, scales of 32-row groups ``[N/(32 w), K]`` sent as ``[N/w, K/32]``): byte-identical to
  quantizing the full weight on one process because shard boundaries fall on multiples of 32. Both
  forms have the same sizes, so FSDP's buffers are reused. 33/32 bytes per value per gather.
* The direction: a gather issued while the autograd engine runs a backward is the dgrad gather.
  A module that FSDP does not reshard after forward (the root, by default) is gathered once per step
  and sends both forms then.
* ``fsdp_post_all_gather`` hands the graph a plain ``[N, K]`` tensor holding the dequantized forward
  values (any op that reads the weight outside mxfx's GEMMs sees the MX values) and installs the
  gathered forms as that tensor's cache forms (:func:`mxfx.cache.install_forms`), so the rewritten
  GEMMs use them directly; the compiled graphs are unchanged.

Weights that are not eligible stay plain parameters and gather in their storage dtype (listed by
:func:`mx_all_gather`'s return value). The subclass unwraps to its FP32 tensor for every other op, so
``state_dict()`` and ``torch.distributed.checkpoint`` see the FP32 values; caches are never saved.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
import torch.utils._pytree as pytree

from mxfx import cache, kernels
from mxfx.format import BLOCK_SIZE, SCALE_RULES

stats: Counter = Counter()
"""Gathers per form sent: ``gather_forward``, ``gather_dgrad`` (one per parameter per gather)."""
_aten = torch.ops.aten
_KEEP_SUBCLASS = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten._pin_memory.default,
    _aten.split.Tensor, _aten.clone.default, _aten.detach.default,
}


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (the gather is for dgrad).

    FSDP2 issues the pre-backward unshard and the backward prefetch from hooks the engine runs, and every
    forward gather (pre-forward hook, forward prefetch, explicit ``unshard()``) outside it. torch has no
    public query for this; ``_current_graph_task_id`` is -1 outside a running backward (checked on torch 2.13).
    """
    return torch._C._current_graph_task_id() != -1


class MXWeight(torch.Tensor):
    """A linear weight ``[N, K]`` (FP32 main weight) whose FSDP2 all-gather moves its MX forms.

    Every op other than FSDP's gather sees the wrapped tensor (``_tensor``); ops that make a tensor
    of the same kind (views, copies, ``detach``) keep the subclass so FSDP's shard is one too.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, rule: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, rule: str):
        self._tensor = tensor
        self._rule = rule
        self._shard_forms = None  # (step, version, {orientation: (qdata u8, scales u8)})

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        rule = None

        def unwrap(t):
            nonlocal rule
            rule = t._rule
            return t._tensor

        args, kwargs = pytree.tree_map_only(MXWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda x: MXWeight(x, rule), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"rule": self._rule}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MXWeight(inner["_tensor"], meta["rule"])

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, DCP) as the plain FP32 tensor: checkpoints load without mxfx."""
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self):
        return f"MXWeight(rule={self._rule}, {self._tensor!r})"

    # --- FSDP2 extension points ---------------------------------------------------------------

    def _forms(self) -> dict:
        """The shard's forward and dgrad forms, as the gather sends them (uint8, ``[N/w, K]`` and
        ``[N/w, K/32]`` each): quantized once per optimizer step."""
        w = self._tensor
        stamp = (cache.step_count(), w._version)
        if self._shard_forms is None or self._shard_forms[:2] != stamp:
            with torch.no_grad():
                n, k = w.shape
                q, s = kernels.quantize_lastdim(w.detach(), self._rule)
                qt, st = kernels.quantize_lastdim(w.detach().transpose(0, 1), self._rule)
                forms = {
                    "forward": (q.contiguous().view(torch.uint8), s.contiguous()),
                    # dgrad: W^T [K, N/w] blocked along N -> sent in W's layout: qdata [N/w, K], scales [N/(32w), K]
                    "dgrad": (qt.transpose(0, 1).contiguous().view(torch.uint8),
                              st.transpose(0, 1).contiguous().view(n, k // BLOCK_SIZE)),
                }
            self._shard_forms = (*stamp, forms)
        return self._shard_forms[2]

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        forms = self._forms()
        if not _reshards_after_forward(module):
            which = ("forward", "dgrad")  # gathered once per step: both forms
        else:
            which = ("dgrad",) if _in_backward() else ("forward",)
        stats.update(f"gather_{o}" for o in which)
        outs = tuple(t for o in which for t in forms[o])
        return outs, (which, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        which, (n, k) = metadata
        pairs = {}
        for i, o in enumerate(which):
            q, s = all_gather_outputs[2 * i], all_gather_outputs[2 * i + 1]
            q = q.view(torch.float8_e4m3fn).view(n, k)
            if o == "forward":
                pairs[o] = (q, s.view(n, k // BLOCK_SIZE))
            else:
                pairs[o] = (q.transpose(0, 1), s.reshape(n // BLOCK_SIZE, k).transpose(0, 1))
        if out is None:
            out = torch.empty((n, k), dtype=param_dtype or self._tensor.dtype, device=self._tensor.device)
            ret = (out, (out,))
        else:
            ret = None
        with torch.no_grad():
            if "forward" in pairs:
                q, s = pairs["forward"]
                out.copy_(kernels.dequantize_lastdim(q, s, out.dtype))
        cache.install_forms(out, self._rule, pairs)
        return ret


_roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owning module -> weakref to the model converted
_units: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owning module -> its FSDP unit


def _unit(module: torch.nn.Module):
    """The FSDP unit (the innermost ``FSDPModule`` containing ``module``) of a converted weight's module."""
    unit = _units.get(module)
    if unit is None:
        root = _roots.get(module)
        root = root() if root is not None else None
        if root is None:
            raise RuntimeError(f"mxfx.fsdp: {type(module).__name__} was not converted by mx_all_gather")
        units = [m for m in root.modules() if isinstance(m, FSDPModule) and any(c is module for c in m.modules())]
        if not units:
            raise RuntimeError(f"mxfx.fsdp: no fully_shard module holds {type(module).__name__}")
        unit = min(units, key=lambda m: sum(1 for _ in m.modules()))
        _units[module] = unit
    return unit


def _reshards_after_forward(module: torch.nn.Module) -> bool:
    """Whether FSDP frees ``module``'s unsharded weights after forward (so it gathers them again before
    backward). FSDP2 exposes only a setter: read from its parameter group; if that is not there, False
    (the one gather then sends both forms: exact, more bytes)."""
    group = getattr(_unit(module)._get_fsdp_state(), "_fsdp_param_group", None)
    return getattr(group, "post_forward_mesh_info", None) is not None


def eligible(weight: torch.Tensor, world: int) -> bool:
    """Whether ``weight``'s MX forms can be gathered exactly over ``world`` dim-0 shards: ``[N, K]``
    with N a multiple of ``32 x world`` (even shards, boundaries on multiples of 32) and K of 32."""
    return weight.dim() == 2 and weight.shape[0] % (BLOCK_SIZE * world) == 0 and weight.shape[1] % BLOCK_SIZE == 0


def mx_all_gather(model: torch.nn.Module, *, rule: str = "rceil", world_size: int | None = None,
                  modules=(torch.nn.Linear,)) -> dict[str, str]:
    """Make FSDP2's all-gather of ``model``'s linear weights move MX forms. Call before ``fully_shard``.

    Args:
        model: the model (not sharded yet).
        rule: the scale rule of the policy's linears ("rceil" or "floor").
        world_size: the size of the FSDP shard mesh dim (default: the default group's world size).
        modules: module types whose ``weight`` is converted.

    Returns:
        ``{parameter name: "mx" | "high precision (reason)"}`` for every weight considered: the
        gather precision map.

    Raises:
        ValueError: unknown rule; RuntimeError: ``model`` is already sharded.
    """
    if rule not in SCALE_RULES:
        raise ValueError(f"mxfx.fsdp.mx_all_gather: rule={rule!r} is not valid; choose one of {SCALE_RULES}")
    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, modules) or not isinstance(getattr(mod, "weight", None), torch.nn.Parameter):
            continue
        w = mod.weight
        if type(w.data) is not torch.Tensor:
            raise RuntimeError(f"mxfx.fsdp.mx_all_gather: {name}.weight is a {type(w.data).__name__}; call it before fully_shard")
        key = f"{name}.weight" if name else "weight"
        if not eligible(w, world):
            out[key] = (f"high precision (shape {tuple(w.shape)}: N not a multiple of 32 x {world} shards, "
                        f"or K not of 32)")
            continue
        mod.weight = torch.nn.Parameter(MXWeight(w.data, rule), requires_grad=w.requires_grad)
        _roots[mod] = weakref.ref(model)
        out[key] = "mx"
    return out
