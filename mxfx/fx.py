"""Reading the Dynamo graph: node targets, module names and example values."""

from __future__ import annotations

import contextlib
import operator
import re

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

_ROOT = re.compile(r"^L\['(?!self')[^']*'\]\[0\]\.?|^L\['[^']*'\]\.?")  # L['self'], or the module as the first
# positional argument of a wrapped forward (Accelerate's autocast wrapper: L['args'][0])
_INDEX = re.compile(r"\[(\d+)\]")
_SUBSCRIPT = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
_BOUND_SELF = re.compile(
    r"\.\w+\.(__closure__\.\d+\.cell_contents|__defaults__\.\d+|__kwdefaults__\.\w+)\.__self__(?=\.|$)"
)
"""A module reached through its own overridden method: ``blk.forward = lambda x: checkpoint(orig, x)`` with ``orig``
the bound original, held in the function's closure or defaults (``layers.0.forward.__closure__.0.cell_contents
.__self__`` is ``layers.0``)."""
WRAPPER_NAMES = ("__dict__", "_checkpoint_wrapped_module", "_orig_mod")
"""Path segments that name no module of their own: Dynamo's ``__dict__`` access, the inner module
of torch's activation-checkpoint wrapper (``checkpoint_wrapper``, torchtitan's activation
checkpointing), which ``state_dict()`` leaves out of parameter names as well, and the module inside
``torch.compile``'s wrapper (a block replaced by ``torch.compile(block)``)."""


def normalize_fqn(dynamo_path: str) -> str:
    """Dynamo's ``L['self'].layers[0].attn`` (or ``L['args'][0].layers[0].attn``, where a wrapped forward received
    the module as its first argument) -> ``layers.0.attn`` (as ``named_modules()`` spells it, less
    activation-checkpoint wrappers: :func:`strip_wrappers`)."""
    path = _ROOT.sub("", dynamo_path)
    path = _INDEX.sub(r".\1", path)
    path = _SUBSCRIPT.sub(r".\1", path)
    path = path.replace("._modules.", ".").replace("_modules.", "")
    return strip_wrappers(_BOUND_SELF.sub("", path).strip("."))


def strip_wrappers(fqn: str) -> str:
    """``layers.0._checkpoint_wrapped_module.attention.wq`` -> ``layers.0.attention.wq``: a dotted
    name without the :data:`WRAPPER_NAMES` segments (the name ``state_dict()`` gives it)."""
    return ".".join(part for part in fqn.split(".") if part not in WRAPPER_NAMES)


def all_graphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and its subgraphs (bodies of checkpoint regions and other higher-order ops, held as attributes)."""
    return [gm] + [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]


def record_prefixes(gm: fx.GraphModule) -> dict[fx.GraphModule, str]:
    """Each graph of :func:`all_graphs` ``(gm)`` -> the prefix of its nodes' names in ``gm``'s precision map: ""
    for ``gm``, its attribute path and a dot for a subgraph (``wrap_body_0.``), whose nodes reuse the outer graph's
    names (``mx_linear`` in both)."""
    return {g: f"{name}." if name else "" for name, g in gm.named_modules() if isinstance(g, fx.GraphModule)}


CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
"""The higher-order op of an activation-checkpointed region: ``(body, *operands)``, the body's placeholders in the
operands' order."""


def outer_inputs(gm: fx.GraphModule) -> tuple[dict[fx.Node, int], list[fx.GraphModule]]:
    """``(placeholder -> index, bodies)``: the index among ``gm``'s placeholders of the input each placeholder of
    ``gm``, or of an activation-checkpointed region's body in it (:data:`CHECKPOINT`, at any depth), stands for
    (the same tensor handed down as an operand; a placeholder fed a computed value is left out), and those bodies."""
    index_of = {p: i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    bodies, pending = [], [gm]
    while pending:
        g = pending.pop()
        for node in g.graph.nodes:
            if node.op != "call_function" or node.target is not CHECKPOINT or node.args[0].op != "get_attr":
                continue
            body = getattr(g, node.args[0].target)
            inner = [n for n in body.graph.nodes if n.op == "placeholder"]
            index_of.update((p, index_of[a]) for p, a in zip(inner, node.args[1:]) if a in index_of)
            bodies.append(body)
            pending.append(body)
    return index_of, bodies


PREFIX_META = "mxfx_module_prefix"  # gm.meta key: the graph's place in the whole model ("layers.3.")
STATS_SITES_META = "mxfx_stats_sites"  # gm.meta key: statistics site prefixes given to ops of the graph so far


def unique_stats_site(gm: fx.GraphModule, kwargs: dict, kind: str) -> dict:
    """``kwargs`` of a new op call of ``kind`` whose ``stats`` site prefix
    (:meth:`mxfx.ops.settings.OpSettings.observe`, a module name) an earlier op of the same kind in ``gm`` already has,
    with ``#1``, ``#2``... appended: sites name one op each (a module that calls ``F.linear`` twice). ``kwargs`` as they
    are without ``stats``."""
    site = kwargs.get("stats")
    if not site:
        return kwargs
    taken = gm.meta.setdefault(STATS_SITES_META, set())
    n, unique = 0, site
    while (unique, kind) in taken:
        n += 1
        unique = f"{site}#{n}"
    taken.add((unique, kind))
    return {**kwargs, "stats": unique}


def stats_sites(gm: fx.GraphModule) -> list[str]:
    """The statistics site prefixes of the op calls in ``gm`` and its subgraphs, in graph order."""
    return [
        n.kwargs["stats"]
        for g in all_graphs(gm)
        for n in g.graph.nodes
        if n.op == "call_function" and isinstance(n.kwargs.get("stats"), str) and n.kwargs["stats"]
    ]


def module_fqn(node: fx.Node) -> str:
    """FQN of the innermost module a node was traced in, as the whole model's ``named_modules()``
    spells it ("" at the root or when unknown): the graph's own name of it, behind the graph's
    prefix (:data:`PREFIX_META`, set by the backend from :func:`mxfx.names.graph_place`)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    prefix = node.graph.owning_module.meta.get(PREFIX_META, "") if node.graph.owning_module is not None else ""
    if not stack:
        return prefix.rstrip(".")
    return (prefix + normalize_fqn(list(stack.values())[-1][0])).rstrip(".")


def parameter_placeholders(gm: fx.GraphModule, example_inputs) -> dict[str, torch.Tensor]:
    """Graph-relative dotted name (``attn.qkv.weight``) -> real tensor of each placeholder Dynamo made
    for a module parameter or buffer (its source path names it)."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if (
            isinstance(value, torch.Tensor)
            and isinstance(name, str)
            and ("_parameters[" in name or "_buffers[" in name)
        ):
            out[normalize_fqn(name.replace("_parameters", "_modules").replace("_buffers", "_modules"))] = value
    return out


def example_value(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for ``node`` (None for non-nodes or non-tensors)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def is_dtensor(t) -> bool:
    """True for a DTensor (a tensor-parallel operand): MX ops take local tensors only."""
    if t is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # optional: torch builds without distributed

    return isinstance(t, DTensor)


def shape_str(t: torch.Tensor | None) -> str:
    """``[2, 16, 64]`` for the precision map ("?" without an example value); symbolic sizes print as symbols."""
    if t is None:
        return "?"
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def known_size(dim) -> int | None:
    """A concrete int for a possibly symbolic size (its hint); None for a data-dependent
    (unbacked) size such as expert-parallel received rows from ``.tolist()`` splits."""
    if isinstance(dim, int):
        return dim
    try:
        return int(dim.node.hint) if dim.node.hint is not None else int(dim)
    except Exception:  # unbacked symbol without a hint
        return None


def size_hint(dim) -> int:
    """:func:`known_size`, with 0 for a data-dependent size (byte estimates only)."""
    n = known_size(dim)
    return 0 if n is None else n


def gemm_size(m_dims, n, k) -> tuple[int | None, tuple[int, int, int] | None]:
    """``(MACs, (M, N, K))`` of a GEMM whose M is the product of ``m_dims``, for the policy's
    ``min_size``; ``(None, None)`` when a size is data-dependent, which ``min_size`` cannot
    judge at compile time (the op is then rewritten, as with ``min_size=0``)."""
    sizes = [known_size(d) for d in (*m_dims, n, k)]
    if any(s is None for s in sizes):
        return None, None
    m = 1
    for d in sizes[:-2]:
        m *= d
    return m * sizes[-2] * sizes[-1], (m, sizes[-2], sizes[-1])


def is_call(node: fx.Node, functions: tuple = (), methods: tuple = ()) -> bool:
    """True when ``node`` calls one of ``functions`` or a Tensor method named in ``methods``."""
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


CASTS = ("to", "bfloat16", "float", "half", "type", "contiguous")
"""Tensor methods that only change dtype or layout: walked through to reach a weight's parameter."""


def _is_last_two_transpose(node: fx.Node) -> bool:
    """True for ``t.transpose(-2, -1)`` (in any spelling of the last two dims)."""
    if not (is_call(node, (torch.transpose,), ("transpose",)) and len(node.args) >= 3):
        return False
    val = example_value(node.args[0])
    dims = {d % val.dim() for d in node.args[1:3]} if val is not None else set()
    return val is not None and dims == {val.dim() - 2, val.dim() - 1}


def weight_source(b: fx.Node) -> tuple[fx.Node, bool]:
    """Walk ``b`` back through casts and last-two-dim transposes.

    Returns ``(source, transposed)``: ``b`` equals ``source`` (cast) transposed
    ``transposed`` times modulo 2.
    """
    transposed = False
    while isinstance(b, fx.Node):
        if _is_last_two_transpose(b):
            transposed, b = not transposed, b.args[0]
        elif b.op == "call_method" and b.target in CASTS and len(b.users) == 1:
            b = b.args[0]
        else:
            break
    return b, transposed


def target_name(node: fx.Node) -> str:
    """The name of what ``node`` calls: a Tensor method's, an ATen overload's schema name, a function's
    ``__name__``; "" for other nodes."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return t._schema.name.split("::")[-1]
        return getattr(t, "__name__", "")
    return ""


def mutated_args(node: fx.Node) -> list:
    """Nodes an in-place call writes: its first argument, or the members of a list first argument."""
    name = target_name(node)
    if not name.endswith("_") or name.endswith("__") or not node.args:
        return []
    first = node.args[0]
    if isinstance(first, (list, tuple)):
        return [a for a in first if isinstance(a, fx.Node)]
    return [first] if isinstance(first, fx.Node) else []


_FRESH_METHODS = (
    "argsort", "sort", "topk", "clone", "new_zeros", "new_empty", "new_ones", "new_full", "sum", "cumsum", "bincount",
    "histc", "eq", "ne", "lt", "le", "gt", "ge", "div", "floor_divide", "remainder", "mul", "add", "sub", "neg",
    "__floordiv__", "__mul__", "__add__", "__sub__", "__truediv__", "__mod__", "__neg__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__",
)  # fmt: skip
_FRESH_FNS = (
    torch.argsort, torch.sort, torch.topk, torch.clone, torch.empty_like, torch.zeros_like, torch.ones_like,
    torch.full_like, torch.sum, torch.cumsum, torch.bincount, torch.histc, torch.eq, torch.div, torch.floor_divide,
    torch.remainder, torch.mul, torch.add, torch.sub, operator.floordiv, operator.mul, operator.add, operator.sub,
    operator.truediv, operator.mod, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge,
)  # fmt: skip
"""Calls that return new tensors, never a view of their first argument: :func:`written` stops there. Casts
(``float``, ``to``, ``contiguous``) are not among them: they return their input itself where it already fits."""


def _may_alias(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user``'s result may be (or hold) a view of ``node``: ``node`` is its first argument (or in a list
    first argument), as in every view op (``view``, ``t``, ``as_strided``, ``movedim``, ``unfold``, ...), and
    ``user`` is not a call known to return a new tensor (:data:`_FRESH_FNS`, :data:`_FRESH_METHODS`)."""
    if user.op not in ("call_function", "call_method") or not user.args:
        return False
    first = user.args[0]
    if not (first is node or (isinstance(first, (list, tuple)) and any(a is node for a in first))):
        return False
    return not is_call(user, _FRESH_FNS, _FRESH_METHODS)


def written(node: fx.Node, allowed: tuple = ()) -> bool:
    """Whether the graph writes ``node``'s tensor, or what may be a view of it (any depth), in place: an in-place
    method or op (name ending in ``_``), ``operator.setitem`` into it, or an ``out=`` argument; the nodes in
    ``allowed`` (a write the caller knows of) excepted. Conservative: any call taking ``node`` first may return a
    view of it (:func:`_may_alias`) unless it is known to return a new tensor, so an unusual op in between can make
    this True for a tensor never written."""
    seen, frontier = set(), [node]
    while frontier:
        cur = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            if user in allowed:
                continue
            if cur in mutated_args(user) or user.kwargs.get("out") is cur:
                return True
            if user.op == "call_function" and user.target is operator.setitem and user.args[0] is cur:
                return True
            if _may_alias(user, cur):
                frontier.append(user)
    return False


def replace_with_call(gm: fx.GraphModule, node: fx.Node, fn, args: tuple) -> fx.Node:
    """Put ``fn(*args)`` where ``node`` stands: inserted before it, given its meta (an example value made where
    none carries over), read by its users; ``node`` erased. Returns the new node."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(fn, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    if "example_value" not in new.meta:
        fill_example_value(new)
    return new


def erase_unused_chain(gm: fx.GraphModule, node) -> None:
    """Erase the now-unused casts/transposes that fed the old weight operand.

    Only these nodes: a graph-wide dead-code elimination would also drop
    in-place writes such as ``operator.setitem`` that have no users.
    """
    while (
        isinstance(node, fx.Node)
        and not node.users
        and node.op == "call_method"
        and node.target in (*CASTS, "transpose")
    ):
        parent = node.args[0]
        gm.graph.erase_node(node)
        node = parent


_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_devices(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    """Per node of ``gm``, the device types ("cpu", "cuda") whose autocast is on where the node runs.

    Starts from the global autocast state the backend is called under (the state the graph was
    traced in) and follows the ``torch.autocast`` regions Dynamo keeps in the graph as
    ``_enter_autocast`` / ``_exit_autocast`` calls (``enabled=False`` regions turn a device off).
    """
    stack = [frozenset(d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))]
    state = {}
    for node in gm.graph.nodes:
        if is_call(node, (_ENTER_AUTOCAST,)) and len(node.args) >= 3:
            device, _, enabled = node.args[:3]
            stack.append(stack[-1] | {device} if enabled else stack[-1] - {device})
        elif is_call(node, (_EXIT_AUTOCAST,)) and len(stack) > 1:
            stack.pop()
        state[node] = stack[-1]
    return state


def mixed_dtype_reason(op: str, operands: dict, autocast_on: bool) -> str:
    """Why a GEMM whose floating operands differ in dtype is left as written ("" when they agree).

    ``operands`` maps operand names to example values (None entries are ignored). Eager PyTorch
    rejects such a GEMM (``mat1 and mat2 must have the same dtype``) unless autocast casts its
    operands (``autocast_on``); left as written, the compiled graph fails exactly as eager does
    instead of running in MXFP8 with a result dtype eager never gives.
    """
    dtypes = {name: t.dtype for name, t in operands.items() if t is not None}
    if autocast_on or len(set(dtypes.values())) <= 1:
        return ""
    listed = ", ".join(f"{name} {str(d).removeprefix('torch.')}" for name, d in dtypes.items())
    return f"operand dtypes differ ({listed}) outside autocast: left as written, where {op} rejects them as in eager"


def fill_example_values(gm: fx.GraphModule) -> int:
    """Give every call node a pass inserted without ``meta["example_value"]`` one, by running its
    target on its inputs' example values (Dynamo's fake tensors: no data, no kernels). Returns how many.

    AOTAutograd's cache takes a method call (``x.view(...)``) as cache-safe only when its receiver
    carries an example value, so a rewritten graph without them would never be cached. A node whose
    target cannot run on fake inputs is left as it is (the graph then only misses that cache).
    """
    return sum(
        fill_example_value(node)
        for node in gm.graph.nodes
        if node.op in ("call_function", "call_method") and "example_value" not in node.meta
    )


def fill_example_value(node: fx.Node) -> bool:
    """Give call node ``node`` the example value of its target run on its inputs' example values, under
    ``torch.no_grad()`` (so it requires no grad: a node a pass inserts has no backward of its own) and, as Dynamo
    runs it, the Python dispatcher (ops on symbolic sizes, such as a pad of a symbolic token count, take their
    Python decompositions); False, and no value, where an input has none or the target cannot run on fake inputs."""
    missing = []

    def value(a):
        if not isinstance(a, fx.Node):
            return a
        if "example_value" not in a.meta:
            missing.append(a)
        return a.meta.get("example_value")

    args, kwargs = fx.node.map_aggregate(node.args, value), fx.node.map_aggregate(node.kwargs, value)
    if missing:
        return False
    fakes = [a for a in _tensors((args, kwargs)) if isinstance(a, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else contextlib.nullcontext()
    try:
        with torch.no_grad(), mode, enable_python_dispatcher():
            if node.op == "call_method":
                val = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                val = node.target(*args, **kwargs)
    except Exception:  # not runnable on fake tensors: leave it
        return False
    node.meta["example_value"] = val
    return True


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    fx.node.map_aggregate(tree, lambda a: out.append(a) if isinstance(a, torch.Tensor) else None)
    return out
