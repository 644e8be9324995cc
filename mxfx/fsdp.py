"""Low-precision weight all-gather for FSDP2: the all-gather moves MX or fp8_block forms, not FP32/BF16 weights.

Opt in with one line before ``fully_shard``: ``mxfx.fsdp.mx_all_gather(model, options)`` (after
``import mxfx.fsdp``; ``options`` as given to ``torch.compile(..., backend="mxfp8")``). Each eligible
weight, a linear weight ``[N, K]`` or a routed expert weight ``[E, N, K]`` of a grouped GEMM, becomes
an :class:`MXWeight` parameter, a tensor subclass around the FP32 main weight that implements FSDP2's
public extension points ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``. The form follows the
policy's format for the weight's op:

* ``mxfp8``: the local shard is quantized once per optimizer step (the refresh; keyed on
  :func:`mxfx.runtime.cache.step_count` and the shard's version counter). A gather before forward sends the
  forward form (qdata ``[..., N, K]``, scales ``[..., N, K/32]`` of the shard, blocked along K); a
  gather inside backward the dgrad form (W^T blocked along N in 32-row groups: qdata in W's layout,
  scales ``[..., N/32, K]`` sent as ``[..., N, K/32]`` so both forms have the same sizes and
  FSDP reuses its buffers). 33/32 bytes per value per gather. A unit that FSDP does not reshard after
  forward (the root, by default) is gathered once per step and sends both forms then.
* ``fp8_block``: one 128x128 grid (qdata ``[..., N, K]``, float32 scales ``[..., N/128, ceil(K/128)]``)
  serves forward and dgrad, so every gather sends it (1 + 4/128^2 bytes per value).

Sharding is FSDP2's dim 0 (rows N of a linear weight, experts E of an expert weight). The gathered forms
are byte-identical to quantizing the full weight on one process: no block crosses an expert, and the
row shards of a linear weight start on multiples of 32 (mxfp8) or 128 (fp8_block). A weight for which
that does not hold (uneven shards, row shards off those multiples, a ``shard_placement_fn`` that picks
another dim: FSDP2 then chunk-concatenates every gathered tensor along that dim, which only tensors of
the parameter's own shape survive), or whose op the policy keeps in BF16, stays a plain parameter and
gathers in its storage dtype; :func:`mx_all_gather` returns the map saying which and why. On a mesh of
one (nothing to gather) a converted weight is sent as is and quantized by the cache as without this module.

``fsdp_post_all_gather`` hands the graph a plain ``[..., N, K]`` tensor holding the dequantized values
of the gathered form (an op that reads the weight outside mxfx's GEMMs sees low-precision values) and
installs the gathered forms as that tensor's cache forms (:func:`mxfx.runtime.cache.install_forms`), so the
rewritten GEMMs use them directly; the compiled graphs are unchanged. The subclass unwraps to its FP32
tensor for every other op, so ``state_dict()`` and ``torch.distributed.checkpoint`` see the FP32 values;
caches are never saved.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard
import torch.utils._pytree as pytree

from mxfx import formats
from mxfx.diagnostics import rule_check
from mxfx.formats import Format
from mxfx.policy import Policy
from mxfx.runtime import cache

stats: Counter = Counter()
"""Gathers per form sent (:meth:`mxfx.formats.Format.gather_forms`): ``gather_forward``, ``gather_dgrad`` (mxfp8),
``gather_block`` (fp8_block); one per parameter per gather."""
_aten = torch.ops.aten
_KEEP_SUBCLASS = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
    _aten.detach.default,
}


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (the gather is for dgrad).

    FSDP2 issues the pre-backward unshard and the backward prefetch from hooks the engine runs, and every
    forward gather (pre-forward hook, forward prefetch, explicit ``unshard()``) outside it. torch has no
    public query for this; ``_current_graph_task_id`` is -1 outside a running backward (checked on torch 2.13).
    """
    return torch._C._current_graph_task_id() != -1


class MXWeight(torch.Tensor):
    """A weight ``[N, K]`` or ``[E, N, K]`` (FP32 main weight) whose FSDP2 all-gather moves the forms of format
    ``fmt`` (:meth:`mxfx.formats.Format.gather_forms`) of scale rule ``rule``.

    Every op other than FSDP's gather sees the wrapped tensor (``_tensor``); ops that make a tensor
    of the same kind (views, copies, ``detach``) keep the subclass so FSDP's shard is one too.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, rule: str, fmt: Format | str = formats.DEFAULT):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, rule: str, fmt: Format | str = formats.DEFAULT):
        self._tensor = tensor
        self._format = formats.get(fmt)
        self._rule = self._format.rule(rule, "mxfx.fsdp.MXWeight")
        self._shard_forms = None  # (step, version, {form: (qdata u8, scales)})

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        meta = None

        def unwrap(t):
            nonlocal meta
            meta = (t._rule, t._format)
            return t._tensor

        args, kwargs = pytree.tree_map_only(MXWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda x: MXWeight(x, *meta), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"rule": self._rule.value, "fmt": self._format.name}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MXWeight(inner["_tensor"], meta["rule"], meta["fmt"])

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, DCP) as the plain FP32 tensor: checkpoints load without mxfx."""
        return self._tensor.__reduce_ex__(protocol)

    def __repr__(self):
        return f"MXWeight(format={self._format.name}, rule={self._rule.value}, {self._tensor!r})"

    # --- FSDP2 extension points ---------------------------------------------------------------

    def _forms(self) -> dict:
        """The shard's forms, as the gather sends them (:meth:`mxfx.formats.Format.gather_forms`), quantized once
        per optimizer step."""
        w = self._tensor
        stamp = (cache.step_count(), w._version)
        if self._shard_forms is None or self._shard_forms[:2] != stamp:
            with torch.no_grad():
                forms = self._format.gather_forms(w.detach(), self._rule)
            self._shard_forms = (*stamp, forms)
        return self._shard_forms[2]

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if tuple(self.shape[1:]) != tuple(outer_size[1:]):
            raise RuntimeError(
                f"mxfx.fsdp: a weight {tuple(outer_size)} is sharded to {tuple(self.shape)}, not on dim 0; "
                f"mx_all_gather decided its form for dim-0 shards: pass fully_shard's shard_placement_fn to "
                f"mx_all_gather too (it gathers such weights in high precision)"
            )
        rows = self._format.gather_row_multiple
        if self.dim() == 2 and self.shape[0] % rows:
            raise RuntimeError(
                f"mxfx.fsdp: a weight {tuple(outer_size)} is sharded to {tuple(self.shape)}: {self.shape[0]} rows "
                f"would cut a {rows}-row {self._format.name} block; mx_all_gather was told a smaller mesh: pass this "
                f"mesh's size as world_size"
            )
        if tuple(self.shape) == tuple(outer_size):
            # one shard: FSDP2 gathers nothing and copies only the first input; the cache quantizes the weight
            return (self._tensor if mp_policy.param_dtype is None else self._tensor.to(mp_policy.param_dtype),), (
                (),
                tuple(outer_size),
            )
        forms = self._forms()
        which = self._format.gather_which(_reshards_after_forward(module), _in_backward())
        stats.update(f"gather_{o}" for o in which)
        outs = tuple(t for o in which for t in forms[o])
        return outs, (which, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        which, shape = metadata
        pairs = self._format.gathered_pairs(which, all_gather_outputs, shape) if which else {}
        if out is None:
            out = torch.empty(shape, dtype=param_dtype or self._tensor.dtype, device=self._tensor.device)
            ret = (out, (out,))
        else:
            ret = None
        # a gather inside backward refills a tensor autograd saved: keep its version, as FSDP does for its own copy
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(self._format.gathered_values(pairs, out.dtype) if pairs else all_gather_outputs[0].view(shape))
        if pairs:
            cache.install_forms(out, self._rule.value, pairs)
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


_NOT_EXPERTS = (torch.nn.Bilinear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)


def _weight_kind(module: torch.nn.Module, name: str, p: torch.Tensor) -> str | None:
    """The op kind reading parameter ``name`` of ``module``: "linear" (an ``nn.Linear`` weight), "grouped_mm"
    (a 3-D parameter of a module that is not a torch.nn layer with 3-D weights: routed experts), else None."""
    if isinstance(module, torch.nn.Linear) and name == "weight":
        return "linear"
    if p.dim() == 3 and not isinstance(module, _NOT_EXPERTS):
        return "grouped_mm"
    return None


def _gather_form(weight: torch.Tensor, fmt: Format | str, world: int, shard_dim: int = 0) -> str:
    """The form FSDP2 can gather ``weight`` (``[N, K]`` or ``[E, N, K]``) in exactly, sharded on ``shard_dim``
    over ``world`` ranks: the name of format ``fmt`` or ``"high precision (reason)"``.

    Raises:
        ValueError: ``fmt`` is not a format (:func:`mxfx.formats.get`)."""
    fmt = formats.get(fmt)
    shape = tuple(weight.shape)
    if not fmt.gather_row_multiple:
        return f"high precision ({fmt.name} has no gather forms: the parameter is gathered as it is stored)"
    unfit = fmt.unfit_reason(shape[-1], shape[-2])
    if unfit:
        return f"high precision (shape {shape}: {unfit})"
    if shard_dim % len(shape) != 0:
        return (
            f"high precision (Shard({shard_dim}): FSDP2 concatenates every gathered tensor along a "
            f"non-zero shard dim, so only tensors of the parameter's shape can be gathered, not {fmt.name} scales)"
        )
    if shape[0] % world:
        return f"high precision (shape {shape}: dim 0 does not split evenly over {world} shards)"
    rows = fmt.gather_row_multiple
    if len(shape) == 2 and (shape[0] // world) % rows:
        return (
            f"high precision (shape {shape}: {world} shards of {shape[0] // world} rows would cut a "
            f"{rows}-row {fmt.name} block)"
        )
    return fmt.name


def mx_all_gather(
    model: torch.nn.Module, options=None, *, world_size: int | None = None, shard_placement_fn=None
) -> dict[str, str]:
    """Make FSDP2's all-gather of ``model``'s weights move low-precision forms. Call before ``fully_shard``.

    Converts ``nn.Linear`` weights and routed expert weights (3-D parameters ``[E, N, K]`` read by grouped
    GEMMs) whose op the policy runs in low precision, each in the form of its op's format (mxfp8 or
    fp8_block, with the op's scale rule), where the gathered forms equal one-process quantization.

    Args:
        model: the model (not sharded yet); pass only the compiled part if some linears run eagerly.
        options: the policy (``mxfx.Policy`` or dict) given to ``torch.compile(..., backend="mxfp8")``.
        world_size: the size of the FSDP shard mesh dim (default: the default group's world size, which is
            safe for every smaller mesh). Where experts shard over a smaller mesh (expert parallel), call it
            first on the expert modules with that mesh's size, then on the model (converted weights are kept).
        shard_placement_fn: the function given to ``fully_shard`` (weights it shards on a dim other than 0
            gather in high precision).

    Returns:
        ``{parameter name: format name ("mxfp8", "fp8_block") | "high precision (reason)"}`` for every weight
        considered: the gather precision map.

    Raises:
        ValueError: an invalid policy or a scale rule the format does not have; RuntimeError: ``model``
        is already sharded.
    """
    policy = Policy.from_options(options)
    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    out = {}
    decided = set()  # (op kind, module) of every weight considered: the policy's rules were applied there
    for mod_name, mod in model.named_modules():
        mod_name = ".".join(a for a in mod_name.split(".") if a != "_orig_mod")  # compiled before: the user's names
        for name, p in list(mod.named_parameters(recurse=False)):
            kind = _weight_kind(mod, name, p)
            if kind is None:
                continue
            key = f"{mod_name}.{name}" if mod_name else name
            if type(p.data) is MXWeight:  # converted by an earlier call (e.g. the experts, with their mesh's size)
                out[key] = p.data._format.name
                continue
            if type(p.data) is not torch.Tensor:
                raise RuntimeError(
                    f"mxfx.fsdp.mx_all_gather: {key} is a {type(p.data).__name__}; call it before fully_shard"
                )
            out[key] = form = _decide(policy, kind, mod_name, p, world, shard_placement_fn)
            decided.add((kind, mod_name))
            if form in formats.NAMES:
                rule = policy.decide(kind, mod_name).scale_rule  # judged by the op's format there
                setattr(mod, name, torch.nn.Parameter(MXWeight(p.data, rule, form), requires_grad=p.requires_grad))
                _roots[mod] = weakref.ref(model)
    rule_check.observe(policy, {m for _, m in decided}, decided)
    return out


def _decide(policy: Policy, kind: str, module: str, p: torch.Tensor, world: int, shard_placement_fn) -> str:
    """The gather form of one weight: the policy's format for its op, if :func:`_gather_form` allows it."""
    decision = policy.decide(kind, module).fit(p.shape[-1], p.shape[-2])  # the passes' format fit
    if decision.precision != "mxfp8":
        return f"high precision (the op stays {decision.precision}: {decision.reason})"
    sized = policy.decide(kind, module, macs=0).precision != "mxfp8"  # a min_size above 0 applies
    if sized or policy.min_size == "auto" or any(r.min_size == "auto" for r in policy.rules if r.matches(kind, module)):
        return "high precision (min_size: the op's precision is decided per GEMM size at compile time)"
    if policy.keep_dequantized_weights:
        return "high precision (keep_dequantized_weights: its BF16 forms are built from the unsharded weight)"
    placement = shard_placement_fn(p) if shard_placement_fn is not None else None
    if placement is not None and not isinstance(placement, Shard):
        raise ValueError(
            f"mxfx.fsdp.mx_all_gather: shard_placement_fn returned {placement!r}; FSDP2 takes Shard(dim) or None"
        )
    return _gather_form(p, decision.format, world, placement.dim if placement is not None else 0)
