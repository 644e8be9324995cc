"""What a compiled model left unconverted, said once per model: GEMMs whose shapes refuse the format, ops mxfx
could not rewrite, and weights no GEMM of a compiled graph read.

Every graph the backend compiles is attributed to the model being called (:func:`model_of`: the outermost
``nn.Module`` whose call is running around the compile and that holds one of the graph's parameters; for
``torch.compile(model)`` the model itself, also when graph breaks split its forward into several graphs, and for
per-block compile the model around the blocks). Its precision-map records are gathered per model, with the
parameters each GEMM record reads (:attr:`_Model.read`). The model is judged once: when a graph that is its whole
forward compiles (:func:`mxfx.names.whole_forward`), else at the next optimizer step (every graph of the forward
has compiled by then), or at exit (:mod:`mxfx.diagnostics.judgment`). The judgment warns, each at most once per model:

* **Nothing converted**: the model has GEMMs (or parameters) but not one op runs in low precision; the warning
  counts the GEMMs kept and gives their reasons and first modules. Converted ops that are no GEMM (an MXFP8
  all-to-all) count as converted; a model whose only GEMMs are those of passes the policy switches off is not
  warned about (the policy asked for it).
* **Shapes that do not fit**: GEMMs the policy would convert but whose features are not multiples of the
  format's ``feature_multiple`` (its block; ``Linear(100, 60)``): their count, and each reason with the modules it
  holds for. Ops a user rule asked for are warned about by :func:`mxfx.diagnostics.rule_check.warn_unmet_requests`
  instead; a policy-wide ``format`` is no rule, so the ops it cannot take are said here, once.
* **Ops not rewritten** (kind ``not_rewritten``, :mod:`mxfx.passes.unconverted`): GEMMs and opaque custom ops
  over a weight that no pattern matches, where the policy would convert that weight (:func:`unconverted.would_convert`:
  a weight whose features the op's format cannot tile is named in the precision map only).
* **Weights read by no compiled graph** (:func:`unread_weights`): weights of the compiled module (floating, two or
  more dims, not biases; whatever their names) that no GEMM of any compiled graph read, converted or kept: a graph
  break or an eager fallback ran their GEMMs outside ``torch.compile``, so mxfx never saw them. Named with the graph
  breaks Dynamo recorded while it compiled the model (:func:`mxfx.diagnostics.graph_breaks.new`: the reason and
  where); a break
  inside an activation-checkpointed region by a side effect of its forward names the Dynamo setting that keeps the
  region in the graph (:data:`mxfx.diagnostics.graph_breaks.CHECKPOINT_SETTING`).
* **A model no graph reached** (:func:`watch_steps`, on request): an optimizer whose weights no compiled graph took
  at all is warned about at its first step. Dynamo skips a forward whole (no graph reaches the backend, so no model
  is observed) when it breaks inside a loop, such as one over experts with ``torch.where`` per expert. Nothing of
  ``torch.compile``'s public API tells the backend which model it was given, so the check cannot tell such a model
  from one trained eagerly beside it: it runs only where asked.

Keyed by model, not by module names: a second model gets its own complete warnings, whatever names it shares
with the first. Graphs that belong to no model (an optimizer step, a compiled function) share one process-wide
scope. :func:`model_scope` gives the set :func:`mxfx.diagnostics.rule_check.warn_unmet_requests` keys its own warnings
with.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxfx import names
from mxfx.diagnostics import graph_breaks
from mxfx.diagnostics.judgment import Judgments
from mxfx.passes import unconverted
from mxfx.fx import outer_inputs, record_prefixes, strip_wrappers
from mxfx.policy import Policy
from mxfx.report import PrecisionMap, kept_in
from mxfx.diagnostics.rule_check import listed

GEMM_KINDS = ("linear", "router", "grouped_mm")
"""Precision-map kinds of the GEMMs a policy decides (each record is one GEMM op, converted or kept)."""
UNFIT = "are not multiples of"
"""Words of a kept op's reason when its features are not multiples of the format's ``feature_multiple``
(``Format.unfit_reason``)."""


@dataclass(eq=False)
class _Model:
    """What the graphs of one model showed, and which of its warnings were given."""

    model: weakref.ref | None  # None: the process-wide scope of graphs that belong to no model
    name: str
    warned: set = field(default_factory=set)  # keys of per-op warnings given for this model (rule_check)
    ops: dict = field(default_factory=dict)  # (kind, module, node, shapes) -> (record, asked by a user rule)
    # parameters by their keys (:func:`_keys`: ids and names in the model)
    read: set = field(default_factory=set)  # the parameters a GEMM record of some graph reads
    read_modules: set = field(default_factory=set)  # modules of GEMM records whose weight could not be traced back
    inputs: set = field(default_factory=set)  # the parameters some graph takes (read by a GEMM or not)
    compiled: set = field(default_factory=set)  # the compiled modules' parameters (empty: the whole model's)
    breaks: list = field(default_factory=list)  # the graph breaks Dynamo recorded while compiling it
    format: str = ""  # the policy's format, for the messages
    policies: set = field(default_factory=set)  # the policies its graphs compiled under
    others: int = 0  # converted ops that are no GEMM (all-to-all transport, SwiGLU, saved inputs)


_lock = threading.Lock()
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Model
_anonymous = _Model(None, "graphs outside any model")
_stepped: weakref.WeakSet = weakref.WeakSet()  # optimizers whose first step was checked (:func:`watch_steps`)
_taken: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a live tensor some compiled graph took
_watching: list = []  # the step post-hook's handle, once registered


def model_of(params: dict[str, torch.Tensor]) -> torch.nn.Module | None:
    """The model a graph with parameter placeholders ``params`` (graph-relative name -> real tensor) belongs to: the
    outermost module whose call is running around the compile (:func:`mxfx.names.running_modules`) and that holds
    one of them (``torch.compile``'s wrapper stands for the model it wraps); None when no such module is running (a
    compiled function, an optimizer step)."""
    ids = {id(t) for t in params.values()}
    if not ids:
        return None
    found = None
    for module in names.running_modules():
        if any(id(p) in ids for p in module.parameters()):
            found = module
    return getattr(found, "_orig_mod", found)


def model_scope(model: torch.nn.Module | None) -> _Model:
    """The record of ``model`` (created at first use); the process-wide one for None."""
    if model is None:
        return _anonymous
    with _lock:
        scope = _models.get(model)
        if scope is None:
            scope = _models[model] = _Model(weakref.ref(model), type(model).__name__)
        return scope


def observation(
    scope: _Model, gm: fx.GraphModule, example_inputs, pm: PrecisionMap, policy: Policy, whole: bool = False
) -> Callable[[], None]:
    """What rewritten graph ``gm`` (its precision map ``pm``, under ``policy``) shows of ``scope``'s model, read
    from ``gm`` as the passes left it; the function returned adds it to ``scope`` once the graph has compiled (a
    graph Dynamo traces again is never added), and judges the model then when ``gm`` is its ``whole`` forward,
    else at the next optimizer step or at exit (:mod:`mxfx.diagnostics.judgment`). Graphs of an optimizer step, and
    graphs
    compiled after the model was judged, change nothing."""
    if any(r.kind == "weight_refresh" for r in pm.records):
        return lambda: None
    real = _real_values(gm, example_inputs)
    nodes = {prefix + n.name: n for g, prefix in record_prefixes(gm).items() for n in g.graph.nodes}
    keys = _keys(scope.model() if scope.model is not None else None)
    tensors = (*real.values(), *gm.parameters())
    taken = keys(tensors)
    alive = {id(t): t for t in tensors}
    compiled = keys(compiled_parameters({id(t) for t in tensors}))
    read = {r.node: keys(_weights_read(nodes.get(r.node), real)) for r in pm.records}

    others = sum(r.rewritten and r.kind not in (*GEMM_KINDS, unconverted.KIND) for r in pm.records)

    def record():
        scope.format = scope.format or str(policy.format)
        scope.others += others
        try:
            scope.policies.add(policy)
        except TypeError:  # an unhashable inner compiler: its rules do not excuse unread weights
            pass
        scope.inputs.update(taken)
        _taken.update(alive)
        scope.compiled.update(compiled)
        scope.breaks.extend(b for b in graph_breaks.new() if b not in scope.breaks)
        for r in pm.records:
            if r.kind not in (*GEMM_KINDS, unconverted.KIND):
                continue
            asked = r.kind in GEMM_KINDS and not r.rewritten and policy.requesting_rule(r.kind, r.module) is not None
            scope.ops.setdefault((r.kind, r.module, r.node, r.shapes), (r, asked))
            weights = read[r.node]
            scope.read.update(weights)
            if not weights:
                scope.read_modules.add(r.module)

    def add():
        if _judgments.observe(scope, record) and whole:
            judge(scope)

    return add


def judge_pending() -> None:
    """Judge every model observed and not judged yet (:func:`observation`)."""
    _judgments.judge()


def judge(scope: _Model) -> None:
    """Give the warnings of ``scope`` (module docstring), once."""
    _judgments.judge(scope)


def _judge(scope: _Model) -> None:
    with _lock:
        ops = list(scope.ops.values())
    model = scope.model() if scope.model is not None else None
    where = f"model {scope.name}" if scope.model is not None else "the graphs compiled outside any model"
    gemms = [r for r, _ in ops if r.kind in GEMM_KINDS]
    converted = [r for r in gemms if r.rewritten]
    switched_off = any(r.kind == unconverted.KIND and unconverted.switched_off(r) for r, _ in ops)
    if not converted and not scope.others and (gemms or (model is not None and not switched_off)):
        _warn_nothing_converted(where, gemms, scope.format)
    else:
        unfit = [r for r, asked in ops if r.kind in GEMM_KINDS and not r.rewritten and not asked and UNFIT in r.reason]
        if unfit:
            _warn(
                f"mxfx: {where}: {len(unfit)} of its {len(gemms)} GEMM op(s) stay in {kept_in(unfit)} because their "
                f"shapes do not fit their format, though the policy would convert them: {_by_reason(unfit)}. "
                f"To keep them as written on purpose, say so with a policy rule (precision='bf16'); "
                f"mxfx.all_reports() has each op."
            )
    left = [r for r, _ in ops if r.kind == unconverted.KIND and unconverted.would_convert(r)]
    if left:
        ops_left = ", ".join(sorted({unconverted.op_of(r) for r in left}))
        _warn(
            f"mxfx: {where}: {len(left)} op(s) read a weight mxfx would convert but were not rewritten ({ops_left}); "
            f"they run in the model's own precision. See mxfx.all_reports() (kind 'not_rewritten') for each op and "
            f"why."
        )
    if model is not None:
        # compiled blocks whose forward left no graph (a graph break in a loop skips the frame) and breaks since
        # the last graph are the model's too
        scope.compiled |= _keys(model)(p for m in filter(None, map(_compiled, model.modules())) for p in m.parameters())
        scope.breaks.extend(b for b in graph_breaks.new() if b not in scope.breaks)
        missed = unread_weights(model, scope)
        if missed:
            _warn(_unread_message(where, missed, scope.breaks, _own_units(model, missed)))


_judgments = Judgments(_judge, weak=True)


def unread_weights(model: torch.nn.Module, scope: _Model | None = None) -> list[str]:
    """Names (as ``named_parameters()`` spells them) of the weights of ``model`` that no GEMM of a compiled graph of
    it read (:func:`observation`): floating, two or more dims, not named as biases (per-expert biases ``[E, N]`` are
    added, not multiplied) nor of :data:`NOT_GEMMS`, held by the compiled modules (all of ``model``'s when no
    compiled module was seen), and either taken by no compiled graph at all, or taken but read by no GEMM there
    while they are GEMM weights (:func:`_gemm_weight`). Once a backward has left gradients, weights without one
    (trainable, so no part of the step) are not named; nor are weights of a module a policy rule keeps as written
    (:meth:`mxfx.policy.Policy.keeping_rule`; an FSDP unit of its own around a router runs its GEMM eagerly)."""
    scope = scope or model_scope(model)
    modules = dict(model.named_modules())
    params = list(model.named_parameters())
    stepped = any(p.grad is not None for _, p in params)
    out = []
    for name, p in params:
        owner, _, leaf = name.rpartition(".")
        if p.dim() < 2 or not p.is_floating_point() or "bias" in leaf or isinstance(modules.get(owner), NOT_GEMMS):
            continue
        keys = (name, id(p))  # the graphs saw it by name, or by id where the model did not name it then
        if (scope.compiled and scope.compiled.isdisjoint(keys)) or (stepped and p.requires_grad and p.grad is None):
            continue
        if not scope.read.isdisjoint(keys) or any(
            owner == m or owner.endswith(f".{m}") for m in scope.read_modules if m
        ):
            continue
        if not scope.inputs.isdisjoint(keys) and not _gemm_weight(name, modules):
            continue  # taken by a graph and read by no GEMM there, as a weight of another op would be
        if any(policy.keeping_rule(owner) is not None for policy in scope.policies):
            continue  # a rule keeps its module's GEMMs as written: running them eagerly changes nothing
        out.append(strip_wrappers(name))
    return out


NOT_GEMMS = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
"""Modules whose weights no GEMM reads (lookups, convolutions): read by no compiled graph or not, never named."""


def _gemm_weight(name: str, modules: dict) -> bool:
    """Whether the parameter ``name`` is a GEMM's weight for sure: an ``nn.Linear``'s, or one whose name, or the
    class or attribute name of a module holding it, says "expert" (``experts``, ``shared_experts``, ``DbrxExperts``,
    ``GraniteMoeParallelExperts``)."""
    parts = name.split(".")
    if isinstance(modules.get(".".join(parts[:-1])), nn.Linear):
        return True
    for end in range(len(parts), 0, -1):
        module = modules.get(".".join(parts[:end]))
        if "expert" in parts[end - 1].lower() or (module is not None and "expert" in type(module).__name__.lower()):
            return True
    return False


def compiled_parameters(graph: set[int]) -> list[torch.Tensor]:
    """The parameters of the compiled modules (:func:`_compiled`) whose call is running around the compile and that
    hold one of ``graph`` (parameter ids). Empty when none is (a compiled function)."""
    out: dict[int, torch.Tensor] = {}
    for module in filter(None, map(_compiled, names.running_modules())):
        held = {id(p): p for p in module.parameters()}
        if not graph.isdisjoint(held):
            out.update(held)
    return list(out.values())


def _keys(model: torch.nn.Module | None) -> Callable[[object], set]:
    """The keys parameters are recorded by: their ids, and their names in ``model`` as ``named_parameters()`` spells
    them now. Names outlive a swap of a module's parameter objects (FSDP2 registers the unsharded parameters while
    the module runs and the sharded ones after, under the same names)."""
    names_of = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return lambda tensors: {k for t in tensors for k in (id(t), names_of.get(id(t)))} - {None}


def _compiled(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``module`` compiles: the one ``torch.compile(module)``'s wrapper wraps, ``module`` itself when
    compiled in place (``module.compile()``); None when it is not compiled."""
    if isinstance(module, OptimizedModule):
        return module._orig_mod
    return module if getattr(module, "_compiled_call_impl", None) is not None else None


def _own_units(model: torch.nn.Module, missed: list[str]) -> list[str]:
    """The innermost FSDP2 units (``fully_shard``) of ``model`` holding the ``missed`` weights (names as
    :func:`unread_weights` gives them), where such a unit is not compiled itself: FSDP2 calls a unit outside the
    graph of the compiled block around it, and a forward of torch's own (``nn.Linear``) called there runs eagerly."""
    units = {
        strip_wrappers(name)
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule) and _compiled(module) is None and module is not model
    }
    out = []
    for weight in missed:
        holders = [u for u in units if weight.startswith(f"{u}.")]
        if holders:
            out.append(max(holders, key=len))
    return list(dict.fromkeys(out))


def _unread_message(where: str, missed: list[str], breaks: list[graph_breaks.GraphBreak], units: list[str] = ()) -> str:
    text = (
        f"mxfx: {where}: {len(missed)} weight(s) were read by no GEMM of a compiled graph, so they were not "
        f"converted: a graph break or an eager fallback ran their GEMMs outside torch.compile, in the model's own "
        f"precision: {listed(missed)}. "
    )
    if units:
        text += (
            f"{listed(units)} {'is an FSDP2 unit of its own' if len(units) == 1 else 'are FSDP2 units of their own'} "
            f"(fully_shard) inside a compiled block: FSDP2 calls a unit outside the block's graph, and a forward of "
            f"torch's own (nn.Linear) called there runs eagerly. Shard it with its block to convert it, or keep it "
            f"as written with a policy rule (precision='bf16')."
        )
        if all(any(w.startswith(f"{u}.") for u in units) for w in missed):
            return text
        text += " "
    if breaks:
        text += (
            f"Graph breaks Dynamo recorded while compiling it: {'; '.join(map(str, breaks[:4]))}"
            f"{f' and {len(breaks) - 4} more' if len(breaks) > 4 else ''}. "
        )
    else:
        text += (
            "Dynamo recorded no graph break for it: it ran that code without compiling it (a "
            "torch.compiler.disable'd function, a file it skips, or a frame past its recompile limit). "
        )
    if any(b.in_checkpoint for b in breaks):
        text += (
            f"A side effect inside an activation-checkpointed region (torch.utils.checkpoint; transformers' "
            f"activation_checkpointing_enable) keeps the region out of the graph: "
            f"{graph_breaks.CHECKPOINT_SETTING} = True keeps it in, the side effect then not run again when the "
            f"backward recomputes the region. "
        )
    return text + (
        "torch._dynamo.explain shows where the forward breaks; an expert implementation without a Python "
        "loop over the experts (transformers: experts_implementation='grouped_mm') keeps them in the graph."
    )


def watch_steps():
    """Check each optimizer's first step from now on (a global step post-hook, registered once): when none of the
    weights it steps (floating, two or more dims, with a gradient) was taken by a graph the backend compiled, warn
    with their names (:func:`_unseen_message`). For a process that trains only models compiled with
    ``backend="mxfp8"``: a model trained eagerly beside them is warned about too. Coverage of a model some graph
    reached is :func:`unread_weights`' part, always on. Returns the hook's handle (``.remove()`` ends the check)."""
    with _lock:
        if not _watching or _watching[0].id not in (_watching[0].hooks_dict_ref() or {}):
            _watching[:] = [register_optimizer_step_post_hook(_first_step)]
        return _watching[0]


def _first_step(optimizer, args, kwargs) -> None:
    if optimizer in _stepped:
        return
    _stepped.add(optimizer)
    named = [
        (name, p)
        for group in optimizer.param_groups
        for name, p in zip(group.get("param_names") or [None] * len(group["params"]), group["params"])
        if p.grad is not None and p.dim() >= 2 and p.is_floating_point()
    ]
    with _lock:  # by identity: the id of a tensor a graph took and that has died since may be a new weight's now
        took = [_taken.get(id(p)) is p for _, p in named]
    if named and not any(took):
        _warn(_unseen_message(type(optimizer).__name__, named, graph_breaks.new()))


_first_step = torch.compiler.disable(_first_step, recursive=True)


def _unseen_message(optimizer: str, named: list, breaks: list[graph_breaks.GraphBreak]) -> str:
    """The warning for an optimizer whose ``named`` weights ((name or None, tensor) pairs) no compiled graph took.
    Names come from the optimizer (built over ``model.named_parameters()``), else from the models registered
    with :func:`mxfx.name_modules`, else shapes stand for them."""
    by_id = {id(p): n for root in names.roots() for n, p in names.parameters_by_name(root).items()}
    found = [name or by_id.get(id(p)) for name, p in named]
    said = (
        listed(found)
        if all(found)
        else (
            f"shapes {listed([tuple(p.shape) for _, p in named])} (an optimizer built over model.named_parameters(), "
            f"or mxfx.name_modules(model), has them named)"
        )
    )
    text = (
        f"mxfx: {optimizer} stepped {len(named)} weight(s) that no graph compiled by the mxfp8 backend took, so "
        f"none was converted: their model ran outside torch.compile, in its own precision: {said}. "
    )
    if breaks:
        text += f"Graph breaks Dynamo recorded: {'; '.join(map(str, breaks[:4]))}. "
    else:
        text += (
            "Dynamo compiled no graph of it: it skips a whole forward when the forward breaks inside a loop "
            "(a loop over the experts with torch.where per expert breaks on the data-dependent shape). "
        )
    return text + (
        "torch.compile(model, backend='mxfp8', fullgraph=True) raises at the line that breaks; an expert "
        "implementation without a Python loop over the experts (grouped GEMMs, torch._grouped_mm; "
        "transformers: experts_implementation='grouped_mm') keeps them in the graph."
    )


def _real_values(gm: fx.GraphModule, example_inputs) -> dict:
    """Placeholder node of ``gm``, or of an activation-checkpointed region's body that stands for one of ``gm``'s
    inputs (:func:`mxfx.fx.outer_inputs`) -> the real tensor Dynamo passed for it."""
    index_of, _ = outer_inputs(gm)
    values = list(example_inputs)
    return {p: values[i] for p, i in index_of.items() if i < len(values) and isinstance(values[i], torch.Tensor)}


def _weights_read(node: fx.Node | None, real: dict) -> list[torch.Tensor]:
    """The real parameters the op at ``node`` reads through casts, views and indexing (empty when they cannot be
    traced to an input of the outer graph: inside the body of a higher-order op other than activation
    checkpointing)."""
    if node is None:
        return []
    out = []
    for operand in unconverted.operands(node):
        p = unconverted.parameter_behind(operand)
        value = real.get(p) if p is not None and p.op == "placeholder" else None
        if value is None and p is not None and p.op == "get_attr":
            value = _attr(node.graph.owning_module, p.target)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _warn_nothing_converted(where: str, gemms, fmt: str) -> None:
    if not gemms:
        _warn(
            f"mxfx: {where} converted no op (policy format {fmt!r}): its compiled graphs hold no GEMM mxfx decides "
            f"(graph breaks may have left them in eager code; torch._dynamo.explain shows where). It runs in its own "
            f"precision."
        )
        return
    _warn(
        f"mxfx: {where} converted no op (policy format {fmt!r}): its {len(gemms)} GEMM op(s) all stay in "
        f"{kept_in(gemms)}: {_by_reason(gemms)}. It runs in its own precision; mxfx.all_reports() has each op."
    )


def _by_reason(records) -> str:
    """``records`` grouped by reason, the largest group first: each reason with its count and the modules it holds
    for, so that every module is listed under its own reason."""
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.reason or "kept", []).append(r)
    return "; ".join(
        f"{len(rs)} x {reason} ({listed([r.module or r.node for r in rs])})"
        for reason, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    )


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)
