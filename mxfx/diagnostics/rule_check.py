"""Policy settings that do not apply as written: a module glob matching no module, or a rule matching no op mxfx
decides (its modules hold no such op, or none of its ``op`` kind; both warned once, judged against the whole
model), a rule asking for low precision that an op's shape refuses (:func:`warn_unmet_requests`), a ``stats``
modules glob matching no quantize site, and a ``transport`` where no graph has an all-to-all (warned once, judged
as rules are).

A rule's module glob is judged against the module names of every graph compiled
under the same policy (equal policies, e.g. the same ``options`` dict, count as
one), not graph by graph: with one graph per block (FSDP2, per-block
``torch.compile(block)``) a rule for one kind of block matches no module of
another block's graph and is still right. Names are collected as each graph is
compiled (the innermost module of each op, as the passes see it), and from the weights
:func:`mxfx.fsdp.mx_all_gather` decides the all-gather form of under the policy (a rule keeping a module
FSDP runs eagerly, such as a router sharded as its own unit, still decides its all-gather); a policy is
judged once (:mod:`mxfx.diagnostics.judgment`): when a graph that is the whole forward of the
module being called compiles (:func:`mxfx.names.whole_forward`), else at the first
optimizer step after its first graph, or at process exit when neither comes
(per-block inference).

A rule whose glob matches modules is judged the same way against the ops the passes recorded there (the precision
map's records of the op kinds a rule decides, :data:`mxfx.policy.OP_KINDS`; "saved" where an MX op saves its
input): a rule matching no op of any graph compiled under the policy (a norm module, ``op="grouped_mm"`` on an
attention module) changes nothing and warns, naming the modules it matches and the op kinds found there.

The unmatched-module warning names the rule and a few of the module names that exist. A graph traced from a
block (per-block compile, or the part of a layer a graph break cuts out) is named from the model when the
model's call runs around the compile or the model is registered (:mod:`mxfx.names`); otherwise its names are the
block's own (``attn.q_proj``, not ``layers.0.attn.q_proj``), and the warning says how to get the full ones.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from mxfx import formats
from mxfx.formats import Format
from mxfx.diagnostics.judgment import Judgments
from mxfx.fx import all_graphs, module_fqn
from mxfx.policy import NARROW, OP_KINDS, Policy
from mxfx.report import kept_in

EXAMPLES = 6
"""How many existing module names a warning lists."""


@dataclass
class _Seen:
    """What the graphs of one policy showed, until it is judged."""

    modules: set = field(default_factory=set)  # module names
    ops: set = field(default_factory=set)  # (op kind, module), rule_ops
    sites: set = field(default_factory=set)  # quantization statistics site prefixes (Policy.stats)
    converted: set = field(default_factory=set)  # modules of ops converted to a low-precision format


_seen: dict[Policy, _Seen] = {}


def observe(
    policy: Policy,
    modules: set[str],
    ops: set[tuple[str, str]] = frozenset(),
    whole: bool = False,
    sites=(),
    converted=(),
) -> None:
    """Record the module names, the ``(op kind, module)`` ops (:func:`rule_ops`), the statistics ``sites`` and the
    modules of ``converted`` ops of one graph compiled under ``policy``; judged now when the graph is the ``whole``
    forward of the module being called (:func:`mxfx.names.whole_forward`), else at the next optimizer step or at
    exit."""
    if not policy.rules and policy.stats is None and not policy.transport:
        return
    try:
        hash(policy)
    except TypeError:  # an unhashable inner compiler: such a policy is not judged
        return

    def record():
        seen = _seen.setdefault(policy, _Seen())
        seen.modules.update(modules)
        seen.ops.update(ops)
        seen.sites.update(sites)
        seen.converted.update(converted)

    if _judgments.observe(policy, record) and whole:
        judge_pending(policy)


def rule_ops(records) -> set[tuple[str, str]]:
    """``(op kind, module)`` of every op among precision-map ``records``, plus ``("saved", module)`` where a rewritten
    op has a saved input (what ``op="saved"`` rules decide). Only kinds of :data:`OP_KINDS` are ops a rule decides;
    the others (``combine``, ``not_rewritten``) are listed in warnings as found."""
    ops = {(r.kind, r.module) for r in records}
    return ops | {("saved", r.module) for r in records if r.kind in OP_KINDS and r.rewritten and r.saved != "-"}


def unmatched_rules(policy: Policy, modules: set[str]) -> list:
    """The rules of ``policy`` with a module glob that matches none of ``modules``."""
    return [r for r in policy.rules if r.module is not None and not any(r.matches_module(m) for m in modules)]


def opless_rules(policy: Policy, modules: set[str], ops: set[tuple[str, str]]) -> list:
    """The rules of ``policy`` whose glob matches one of ``modules`` (or that have none) but that match none of
    ``ops``: they change nothing."""
    unmatched = unmatched_rules(policy, modules)
    return [
        r for r in policy.rules if r not in unmatched and not any(k in OP_KINDS and r.matches(k, m) for k, m in ops)
    ]


def judge_pending(policy: Policy | None = None) -> None:
    """Warn once per unmatched rule of ``policy`` (of every policy seen since the last judgment when None), over
    the module names and ops of all its graphs so far, then forget them."""
    _judgments.judge(policy)


def _judge(policy: Policy) -> None:
    seen = _seen.pop(policy, _Seen())
    modules, ops = seen.modules, seen.ops
    names = sorted(m for m in modules if m)
    examples = listed(names)
    for rule in unmatched_rules(policy, modules):
        warnings.warn(
            f"mxfx: policy {policy.describe_rule(rule)} matches no module of the graphs compiled under this "
            f"policy, so it changes nothing. Module names there ({len(names)}): {examples or 'none'}. A glob matches a "
            f"name as named_modules() spells it or any dotted suffix of it (e.g. 'layers.0.*' matches "
            f"'model.layers.0.mlp'), and the modules inside a matched one. A graph traced from a block (compiled "
            f"on its own, or cut out of a layer by a graph break) names its modules from the block when no model "
            f"holding the block is being called or registered: call mxfx.name_modules(model) once and they are "
            f"named from the model.",
            stacklevel=2,
        )
    for rule in opless_rules(policy, modules, ops):
        warnings.warn(_opless_message(policy, rule, modules, ops), stacklevel=2)
    if policy.stats is not None and not seen.sites:
        warnings.warn(_siteless_stats_message(policy, seen.converted), stacklevel=2)
    if policy.transport and not any(k == "all_to_all" for k, _ in ops):
        warnings.warn(
            f"mxfx: policy transport={dict(policy.transport)!r} sets the precision of expert-parallel all-to-alls, "
            f"but the graphs compiled under this policy have none (no dispatch or combine across ranks"
            f"{'; the all_to_all pass is off in this policy' if not policy.pass_enabled('all_to_all') else ''}), so it "
            f"changes nothing; drop it",
            stacklevel=2,
        )


_judgments = Judgments(_judge)


def _siteless_stats_message(policy: Policy, converted: set[str]) -> str:
    """The warning for a ``stats`` modules glob that matches no quantize site of the policy's graphs."""
    glob = policy.stats["modules"]
    names = sorted({m or "<root>" for m in converted})
    if not names:
        where = "no op of them is converted to a low-precision format, so they have no quantize site at all"
    else:
        where = f"the modules with quantize sites (converted ops) are {listed(names)}: point the glob there"
    return (
        f"mxfx: policy stats modules={glob!r} matches no quantize site of the graphs compiled under this policy, "
        f"so no statistics are sampled; {where}. The glob matches a module name as a rule's module glob does "
        f"(the name or a dotted suffix of it, and the modules inside a matched one)."
    )


def listed(names) -> str:
    """Up to :data:`EXAMPLES` of ``names`` (repeats dropped), quoted and comma-separated, with ", ... (N in all)"
    when there are more."""
    names = list(dict.fromkeys(names))
    return ", ".join(map(repr, names[:EXAMPLES])) + (f", ... ({len(names)} in all)" if len(names) > EXAMPLES else "")


def _opless_message(policy: Policy, rule, modules: set[str], ops: set[tuple[str, str]]) -> str:
    """The warning for a rule that matches no op (:func:`opless_rules`): where it looks, the op kinds found
    there, where ops of its kind are, and what to do."""
    if rule.module is None:
        found = {k for k, _ in ops}
        head = f"matches no {rule.op + ' ' if rule.op else ''}op of the graphs compiled under this policy"
    else:
        matched = sorted({_matched_prefix(rule, m) for m in modules if m and rule.matches_module(m)})
        found = {k for k, m in ops if rule.matches_module(m)}
        wanted = f"{rule.op} op" if rule.op else f"op a rule decides ({', '.join(_FORWARD_KINDS)})"
        head = f"matches module{'s' if len(matched) > 1 else ''} {listed(matched)}, but there is no {wanted} there"
    holders = sorted({m for k, m in ops if m and (k == rule.op if rule.op else k in _FORWARD_KINDS)})
    if not holders:
        advice = (
            f"The graphs compiled under this policy have no "
            f"{rule.op + ' op at all' if rule.op else 'op a rule decides'}"
        )
        off = [p for p in ([_PASS_OF.get(rule.op, rule.op)] if rule.op else []) if not policy.pass_enabled(p)]
        advice += f" (the {off[0]!r} pass is off in this policy's passes); drop the rule" if off else "; drop the rule"
    else:
        advice = (
            f"{'The ' + rule.op + ' ops' if rule.op else 'Ops a rule decides'} are in {listed(holders)}: point "
            f"the module glob there"
        )
        if rule.op and found & set(OP_KINDS):
            advice += ", or set op to a kind found there (or leave op out to match every kind)"
        advice += ", or drop the rule"
    return (
        f"mxfx: policy {policy.describe_rule(rule)} {head}, so it changes nothing. Op kinds found there: "
        f"{', '.join([k for k in OP_KINDS if k in found] + sorted(found - set(OP_KINDS))) or 'none'}. {advice}."
    )


_FORWARD_KINDS = ("linear", "grouped_mm", "swiglu", "router", "all_to_all")
"""Op kinds of :data:`mxfx.policy.OP_KINDS` that are ops of the forward itself (not ``saved`` inputs, nor the
``weight_refresh`` of an optimizer step)."""
_PASS_OF = {"router": "linear"}
"""The pass of :data:`mxfx.policy.PASSES` that rewrites an op kind, where its name differs from the kind."""


def _matched_prefix(rule, module: str) -> str:
    """The outermost module enclosing (or being) ``module`` that ``rule``'s glob matches."""
    parts = module.split(".")
    return next(".".join(parts[:end]) for end in range(1, len(parts) + 1) if rule.matches_module(".".join(parts[:end])))


def graph_modules(gm: torch.fx.GraphModule) -> set[str]:
    """The innermost module name of every op in ``gm`` and its subgraphs, as :func:`module_fqn` gives them."""
    return {
        module_fqn(n)
        for g in all_graphs(gm)
        for n in g.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
    }


REQUEST_KINDS = ("linear", "router", "grouped_mm")
"""Op kinds whose precision a rule decides and whose shape can refuse it (a kept op of another kind is reported
by its own pass)."""
_warned_unmet: set[tuple] = set()  # (rule, kind, module, node) already warned


def warn_unmet_requests(policy: Policy, records, warned: set | None = None) -> None:
    """Warn, once per rule and op, when an op a user rule asks to convert (:meth:`Policy.requesting_rule`) is kept
    in BF16 (its shape, ``min_size`` or operands refuse it): one warning per rule per graph, naming each such op's
    module, shapes and reason. Ops no user rule asks for (only the policy-wide values or the default rules would
    convert them) are warned about by :mod:`mxfx.diagnostics.coverage`. ``warned`` holds the ops already warned about:
    the
    model's (:func:`mxfx.diagnostics.coverage.model_scope`), so that every model gets its complete warning;
    process-wide when
    None."""
    unmet: dict = {}
    warned = _warned_unmet if warned is None else warned
    for r in records:
        if r.kind not in REQUEST_KINDS or r.rewritten:
            continue
        rule = policy.requesting_rule(r.kind, r.module)
        key = (rule, r.kind, r.module, r.node)
        if rule is None or key in warned:
            continue
        warned.add(key)
        unmet.setdefault(rule, []).append(r)
    for rule, ops in unmet.items():
        fmt = policy.decide(ops[0].kind, ops[0].module).format
        each = "; ".join(f"{r.module or r.node} ({r.kind} {r.shapes}): {r.reason}" for r in ops[:EXAMPLES])
        warnings.warn(
            f"mxfx: policy {policy.describe_rule(rule)} asks for {fmt.name}, but {len(ops)} op(s) it matches stay "
            f"{kept_in(ops)}: {each}{'; ...' if len(ops) > EXAMPLES else ''}. {_remedy(ops, fmt)}",
            stacklevel=2,
        )


def _remedy(ops, fmt: Format) -> str:
    """What to do about ``ops`` (precision-map records kept in BF16) that a rule asks to convert under format ``fmt``,
    from their reasons: what converts them, and for ops narrower than one block (:data:`mxfx.policy.NARROW`, a
    gate's projection), that padding is no answer."""
    fixes = []
    if any("min_size" in r.reason for r in ops):
        fixes.append("lower min_size (min_size=0 on the rule)")
    if any("multiple" in r.reason and NARROW not in r.reason for r in ops):
        finer = [
            f for f in map(formats.get, formats.NAMES) if f.low_precision and f.feature_multiple < fmt.feature_multiple
        ]
        others = "".join(f"; format={f.name!r} needs {f.feature_multiple}" for f in finer)
        block = f"{fmt.feature_multiple} ({fmt.name}{others})" if finer else f"{fmt.feature_multiple}"
        fixes.append(f"pad their features to a multiple of {block}")
    narrow = [r.module or r.node for r in ops if NARROW in r.reason]
    out = f"To convert them, {' or '.join(fixes)}; otherwise drop the rule or narrow its module glob." if fixes else ""
    if narrow:
        one = len(narrow) == 1
        out += (
            f"{' ' if out else ''}{listed(narrow)} {'is' if one else 'are'} {NARROW}, too narrow to convert: narrow "
            f"the rule's module glob to leave {'it' if one else 'them'} out, or drop the rule."
        )
    return out or "See the reasons above; otherwise drop the rule or narrow its module glob."
