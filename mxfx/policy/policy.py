"""Per-op precision policy: which ops the passes rewrite, and how.

A :class:`Policy` holds global settings and an ordered list of :class:`Rule`;
for each matched op the first rule whose module glob and op kind both match
decides its precision (user rules first, then :data:`DEFAULT_RULES`). Settings a
rule leaves unset fall back to the policy-wide value, then to the op kind's
default (``wgrad``: "mxfp8" for dense linears, "bf16" for routed grouped GEMMs,
as in the Olmo recipe, the recipe, "Routed Experts", "Dense and Shared-Expert Linears").

``torch.compile(model, backend="mxfp8", options={...})`` accepts a Policy or a
plain dict of its fields (rules as dicts); :meth:`Policy.from_toml` reads the
same keys from a TOML file. Unknown keys or values raise ValueError listing the
valid ones.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import warnings
import tomllib
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

from mxfx import formats
from mxfx.formats import Format, ScaleRule
from mxfx.ops.settings import PRECISIONS, OpSettings
from mxfx.policy.crossover import prefers_low_precision

OP_KINDS = ("linear", "grouped_mm", "swiglu", "router", "saved", "all_to_all", "weight_refresh")
INNER_COMPILERS = ("inductor", "aot_eager", "eager")
KERNEL_LAUNCHES = ("inductor", "opaque", "auto")
"""Values of :attr:`Policy.kernels`: MX kernels launched by Inductor's code, kept as mxfx's custom ops, or either
per graph by its size (:mod:`mxfx.policy.launch_cost`)."""
PASSES = (
    "all_to_all",
    "linear",
    "grouped_mm",
    "dispatch_mx",
    "dispatch_backward",
    "swiglu",
    "combine",
    "combine_sum",
    "shared_quantize",
    "saved",
    "weight_refresh",
)
"""The graph passes, in the order the backend runs them: each is the module of that name in :mod:`mxfx.passes`
(its ``run``) and a switch of :attr:`Policy.passes` (every pass on by default); ``mxfx.passes.PIPELINE`` is built
from it, so a new pass is its module and its name here. all_to_all runs first (dispatch and combine become
``mx_all_to_all`` before the passes that read their rows); dispatch_mx after linear and grouped_mm (the grouped
GEMMs take MX rows made before the dispatch: received, or quantized before the gather); dispatch_backward after
dispatch_mx (which reads the plain row gathers it replaces); combine_sum after combine (which takes the
route-weight multiply into the GEMM first); shared_quantize after the
passes that set a linear's input (swiglu) and before saved, which counts a shared copy once."""
POLICY_ENV = "MXFX_POLICY"
"""Environment variable: a TOML file of :class:`Policy` fields, the policy of compiles given no ``options``."""
_IGNORED_FILES: set[str] = set()  # MXFX_POLICY values already warned about as overridden by given options
DUMP_ENV = "MXFX_DUMP_DIR"
STATS_ENV = "MXFX_STATS"
"""Environment variable: the ``stats`` of a policy that leaves the field out (``Policy()``, an ``options`` dict or
an ``MXFX_POLICY`` file without ``stats``; a policy given ``stats``, None included, keeps it, as ``options`` win
over ``MXFX_POLICY``), as ``every=100,modules=layers.*`` (either key may be left out; "1"/"on"/"true"/"yes" alone:
the defaults, :data:`STATS_DEFAULTS`; "0"/"off"/"false"/"no"/"none": off)."""


class _FromEnv:
    """The default of a :class:`Policy` field that an environment variable fills when the field is left out
    (given, None included, the field keeps its value)."""

    def __init__(self, env: str):
        self.env = env

    def __repr__(self) -> str:
        return f"<${self.env} or None>"


STATS_FROM_ENV = _FromEnv(STATS_ENV)
"""``Policy.stats`` left out: the policy takes :data:`STATS_ENV`'s value (resolved at ``Policy(...)``: a built
policy's ``stats`` is a dict or None)."""
STATS_ENV_FORM = (
    f"write {STATS_ENV}='every=100,modules=layers.*' (either key may be left out; every: optimizer steps "
    f"between samples, an int >= 1; modules: a module glob), {STATS_ENV}=1 (or on) for the defaults, or "
    f"{STATS_ENV}=0 (or off) for none"
)
"""The valid forms of :data:`STATS_ENV`, as its errors give them."""
NARROW = "narrower than one block"
"""Words of a kept GEMM's reason when one of its features is smaller than the format's block (a gate's projection
with 1 output): padding is no answer for it (:meth:`Decision.fit`)."""
STATS_DEFAULTS = {"every": 100, "modules": "*"}
"""The ``stats`` keys a policy may give and their defaults: sample every 100 optimizer steps, every module."""

FORMAT_CHOICES = formats.CHOICES
"""Values of the ``format`` field: a registered format's name (:mod:`mxfx.formats`), or "auto" (per compile, the
format with native GEMMs on the current device: fp8_block on sm90, mxfp8 elsewhere)."""

SCALE_RULES = formats.SCALE_RULES
"""Scale rules a policy takes: "rceil", "floor" (mxfp8 only) and "amax" (fp8_block only). Each format judges
its own (:meth:`mxfx.formats.Format.rule`): at ``Policy(...)`` where a rule or the policy-wide values fix both
fields, else when an op's decision is made, naming the rules that combined and the module."""

KIND_DEFAULT_WGRAD = {"linear": "mxfp8", "grouped_mm": "bf16"}
_GEMM_FIELDS = ("precision", "wgrad", "save", "scale_rule", "min_size", "format")
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": _GEMM_FIELDS,
    "router": _GEMM_FIELDS,
    "grouped_mm": _GEMM_FIELDS,
    # fused into its consumer GEMM, which quantizes the product in its own format and scale rule
    "swiglu": ("precision", "save"),
    "saved": ("precision",),
    # the payload travels in the transport format of the op's format; the policy's transport decides directions
    "all_to_all": ("precision", "scale_rule", "format"),
    # rebuilds the caches the model's ops made, in their formats and scale rules (:mod:`mxfx.passes.weight_refresh`)
    "weight_refresh": (),
}
"""The :class:`Rule` fields the passes read for an op of each kind of :data:`OP_KINDS`: a rule with that ``op``
may set only these (``Rule(op="all_to_all", wgrad=...)`` is refused); a rule without ``op`` may set any field
some kind reads."""
_WEIGHT_REFRESH_ADVICE = (
    "The refresh runs in the compiled optimizer step (torch.compile(opt.step, backend='mxfp8')) and rebuilds each "
    "weight's caches in the format and scale_rule its ops were given: set those with rules for the ops that read "
    "the weight (linear, router, grouped_mm); to leave the refresh out of the step, compile the step with "
    "options={'passes': {'weight_refresh': False}} (an optimizer step hook then rebuilds the caches, to the same "
    "values)"
)
"""What sets the cache refresh of a compiled optimizer step, as the error for a rule with ``op="weight_refresh"``
says it."""
TRANSPORT_DIRECTIONS = ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd")
"""Expert-parallel all-to-all directions; all four travel as MXFP8 by default (the recipe, "Routed Experts")."""


def _check_rule_fits_format(fmt: str, scale_rule: str, where: str) -> None:
    """Raise ValueError when ``scale_rule`` is not a rule of format ``fmt`` ("auto": a rule of every format)."""
    valid = formats.rules_of(fmt)
    if scale_rule not in valid:
        kinds = "; ".join(f.description for f in (formats.get(n) for n in formats.NAMES))
        raise ValueError(
            f"mxfx policy: {where}: scale_rule={scale_rule!r} is not a rule of format={fmt!r}; choose one of "
            f"{', '.join(map(repr, valid))} ({kinds})"
        )


_DEFAULT_SCALE_RULE = "rceil"
"""The policy-wide scale rule when none is given (:attr:`Policy.scale_rule`'s default)."""


def _without_scales(fmt: str) -> bool:
    """Whether policy value ``fmt`` names a format without scales (one whose scale rule changes nothing)."""
    return fmt != formats.AUTO and not formats.get(fmt).scale_rules


def _may_keep_dequantized(fmt: str | None) -> bool:
    """Whether ops of policy value ``fmt`` may run in a format with BF16 dequantized weight forms ("auto" may)."""
    if fmt is None:
        return False
    return fmt == formats.AUTO or formats.get(fmt).dequantized_weight_forms


def _check_choice(what: str, value: Any, valid: tuple) -> None:
    if value is not None and value not in valid:
        raise ValueError(f"mxfx policy: {what}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}")


def check_precisions(op: str, **choices: str) -> None:
    """Raise ValueError naming ``op`` when a precision argument (``wgrad=``, ``save=``) is not in :data:`PRECISIONS`."""
    for name, value in choices.items():
        if value not in PRECISIONS:
            raise ValueError(f"{op}: {name}={value!r} is not valid; choose one of {', '.join(map(repr, PRECISIONS))}")


def _check_stats(value: Any) -> "ReadOnlyDict | None":
    """A policy's ``stats`` value, validated, with the defaults of :data:`STATS_DEFAULTS` filled in (None: off).

    Raises:
        ValueError: not a dict, an unknown key, ``every`` not an int >= 1, ``modules`` not a glob string.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"mxfx policy: stats={value!r} must be a dict like {{'every': 100, 'modules': 'layers.*'}} or None"
        )
    unknown = sorted(set(value) - set(STATS_DEFAULTS))
    if unknown:
        raise ValueError(f"mxfx policy: unknown stats key(s) {unknown}; valid keys: {', '.join(STATS_DEFAULTS)}")
    out = {**STATS_DEFAULTS, **value}
    every, modules = out["every"], out["modules"]
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"mxfx policy: stats['every']={every!r} must be an int >= 1 (optimizer steps between samples)")
    if not isinstance(modules, str) or not modules.strip():
        raise ValueError(f"mxfx policy: stats['modules']={modules!r} must be a module glob such as 'layers.*.mlp.*'")
    return ReadOnlyDict(out)


def parse_stats_env(text: str) -> dict | None:
    """The ``stats`` dict of the :data:`STATS_ENV` value ``text``, validated: ``key=value`` pairs separated by commas
    (``every=100,modules=layers.*``); "1"/"on"/"true"/"yes" alone for the defaults (``{}``); "0"/"off"/"false"/
    "no"/"none" for off (None).

    Raises:
        ValueError: a pair without "=", a key given twice, an unknown key, an ``every`` that is not an int >= 1 or an
            empty ``modules``, naming the variable and its valid forms (:data:`STATS_ENV_FORM`).
    """
    text = text.strip()
    if text.lower() in ("1", "on", "true", "yes"):
        return {}
    if text.lower() in ("0", "off", "false", "no", "none"):
        return None
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"mxfx policy: {STATS_ENV}={text!r}: {item!r} is not key=value; {STATS_ENV_FORM}")
        key, value = key.strip(), value.strip()
        if key in out:
            raise ValueError(
                f"mxfx policy: {STATS_ENV}={text!r}: {key} is given twice; give each key once: {STATS_ENV_FORM}"
            )
        if key == "every":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(
                    f"mxfx policy: {STATS_ENV}={text!r}: every={value!r} is not an integer; {STATS_ENV_FORM}"
                ) from None
        out[key] = value
    try:
        _check_stats(out)
    except ValueError as e:
        raise ValueError(
            f"mxfx policy: {STATS_ENV}={text!r}: {str(e).removeprefix('mxfx policy: ')}; {STATS_ENV_FORM}"
        ) from None
    return out


def _check_min_size(value: Any, allow_none: bool = True) -> None:
    if value is None and not allow_none:
        raise ValueError(
            "mxfx policy: min_size=None is only meaningful on a Rule (not set); a Policy needs a "
            "non-negative int or 'auto'"
        )
    if value is None or value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() and value > 0 else ""
        raise ValueError(f"mxfx policy: min_size={value!r} must be a non-negative int or 'auto'{hint}")


class _NamedFields:
    """Mixin: unknown keyword arguments (or dict keys, via ``cls(**d)``) raise a ValueError listing
    the valid keys, not a bare TypeError."""

    _WHAT = "option"

    def __new__(cls, *args, **kwargs):
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"mxfx policy: unknown {cls._WHAT} key(s) {unknown}; valid keys: {', '.join(names)}")
        return super().__new__(cls)


class ReadOnlyDict(dict):
    """A dict that refuses edits (TypeError), hashes by its sorted items, and still copies, pickles and
    converts like a dict: the ``passes`` and ``transport`` of a validated :class:`Policy`."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            "mxfx policy: a Policy's mappings are read-only; build a new Policy "
            "(e.g. dataclasses.replace(policy, passes={...}))"
        )

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __deepcopy__(self, memo):
        return self  # immutable, and so are its str keys and bool/str values


@dataclass(frozen=True)
class Rule(_NamedFields):
    """One policy rule; ``None`` fields do not constrain (match) or do not set (decide).

    Attributes:
        module: fnmatch glob on module FQNs as ``named_modules()`` spells them,
            matched against the whole name or any dotted suffix of it, so
            ``"layers.0.*"`` matches ``layers.0.attn`` and a Hugging Face model's
            ``model.layers.0.attn`` but not ``layers.10.attn`` or ``xlayers.0.attn``.
            A rule for a module covers the ops of the modules inside it:
            ``"layers.0.mlp"`` matches the ops of ``model.layers.0.mlp`` and of
            ``model.layers.0.mlp.experts``, ``model.layers.0.mlp.gate``, ... (the glob is
            matched against the op's module and each module enclosing it), except
            the ops a default rule keeps (routers, the vocabulary projection): those
            only a rule naming them changes (its op kind, or a glob matching their own
            module; :meth:`Rule.names`). None matches any module. A glob that matches no module of any graph
            compiled under the policy warns once, as does a rule matching no op of those graphs (a module
            without a GEMM, an ``op`` kind its modules lack) (:mod:`mxfx.diagnostics.rule_check`).
        op: op kind, one of :data:`OP_KINDS`; None matches any kind. A rule with an op kind may set only the
            fields that kind reads (:data:`KIND_FIELDS`; another raises ValueError naming it, the kind, what the
            kind reads and which kinds read the field; ``weight_refresh`` reads none). A rule without one may set
            any field: each is read by some kind it matches, and the ops that do not read it ignore it.
        precision: forward/dgrad compute precision, "mxfp8" or "bf16" (bf16 means
            the op is left as the model wrote it).
        wgrad: weight-gradient precision, "mxfp8" or "bf16".
        save: precision of activations saved for backward, "mxfp8" or "bf16".
        scale_rule: a scale rule of the op's format ("rceil", "floor" for mxfp8, "amax" for fp8_block).
        min_size: smallest GEMM, in multiply-accumulates M*N*K, that is rewritten,
            or "auto" (see :class:`Policy`).
        format: the op's low-precision format, one of :data:`FORMAT_CHOICES` (see :class:`Policy`).
    """

    _WHAT = "rule"

    module: str | None = None
    op: str | None = None
    precision: str | None = None
    wgrad: str | None = None
    save: str | None = None
    scale_rule: str | None = None
    min_size: int | str | None = None
    format: str | None = None

    def __post_init__(self):
        if self.module is not None and not isinstance(self.module, str):
            raise ValueError(
                f"mxfx policy: rule module={self.module!r} must be a glob string (e.g. 'layers.*.attn.qkv') or None"
            )
        if self.module is not None and not self.module.strip():
            raise ValueError(
                f"mxfx policy: rule module={self.module!r} is blank and would match no module; leave module out to "
                "match every module, or give a glob (e.g. 'layers.*.attn.qkv')"
            )
        _check_choice("op", self.op, OP_KINDS)
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("wgrad", self.wgrad, PRECISIONS)
        _check_choice("save", self.save, PRECISIONS)
        _check_choice("scale_rule", self.scale_rule, SCALE_RULES)
        _check_min_size(self.min_size)
        _check_choice("format", self.format, FORMAT_CHOICES)
        settings = ("precision", "wgrad", "save", "scale_rule", "min_size", "format")
        if all(getattr(self, f) is None for f in settings):
            raise ValueError(
                f"mxfx policy: rule {self.describe()} matches ops but sets nothing; give it one of "
                f"{', '.join(settings)} (e.g. precision='bf16')"
            )
        self._check_fields_read()
        moot = [f for f in ("wgrad", "save") if getattr(self, f) == "mxfp8"]
        moot += [f for f in ("scale_rule", "min_size", "format") if getattr(self, f) is not None]
        if self.precision == "bf16" and moot:
            raise ValueError(
                f"mxfx policy: rule {self.describe()} keeps its ops as the model wrote them "
                f"(precision='bf16'), so {', '.join(moot)} would do nothing; drop "
                f"{'it' if len(moot) == 1 else 'them'} or use precision='mxfp8'"
            )

    def _check_fields_read(self) -> None:
        """Raise ValueError when the rule sets a field its ``op`` kind never reads (:data:`KIND_FIELDS`), naming the
        field, the kind, the fields that kind reads and the kinds that read it (for ``weight_refresh``, which reads
        none: what sets the refresh). A rule without ``op`` is not judged: every field is read by some kind it
        can match."""
        if self.op is None:
            return
        reads = KIND_FIELDS[self.op]
        if not reads:
            raise ValueError(
                f"mxfx policy: rule {self.describe()} is for {self.op}, which reads no rule field, so it "
                f"would do nothing; drop it. {_WEIGHT_REFRESH_ADVICE}"
            )
        for name in _GEMM_FIELDS:  # every setting, in field order
            if getattr(self, name) is not None and name not in reads:
                readers = [k for k in OP_KINDS if name in KIND_FIELDS[k]]
                raise ValueError(
                    f"mxfx policy: rule {self.describe()} sets {name}, which {self.op} ops never read "
                    f"(they read {', '.join(reads)}), so it would do nothing; drop it, or set it with a "
                    f"rule for the op kinds that read it ({', '.join(readers)})"
                )

    def matches(self, kind: str, module: str) -> bool:
        """Whether the rule applies to an op of ``kind`` in module ``module`` (its op kind and module glob)."""
        return (self.op is None or self.op == kind) and (self.module is None or self.matches_module(module))

    def matches_module(self, module: str) -> bool:
        """Whether the module glob matches ``module`` or a module enclosing it, whole or by a dotted suffix
        (True without a glob): ``"mlp"`` matches ``layers.0.mlp`` and ``layers.0.mlp.experts``."""
        return self.module is None or _covers(self.module, module)

    def names(self, kind: str, module: str) -> bool:
        """Whether the rule names an op of ``kind`` in ``module`` itself: by its op kind, or by a glob matching the
        op's own module (not only a module enclosing it). Only such a rule overrides a default rule
        (:data:`DEFAULT_RULES`: routers, the vocabulary projection)."""
        return self.op == kind or (self.module is not None and _glob_matches(self.module, module))

    def describe(self) -> str:
        """Compact form: only the fields the rule sets, e.g. ``(module='lm_head', precision='bf16')``."""
        return _describe({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def _describe(fields: Mapping) -> str:
    """A rule's fields as :meth:`Rule.describe` writes them: the set ones, in :class:`Rule`'s field order, then any
    other keys (a rule dict's unknown ones)."""
    order = [f.name for f in dataclasses.fields(Rule)]
    keys = sorted(fields, key=lambda k: order.index(k) if k in order else len(order))
    return "(" + ", ".join(f"{k}={fields[k]!r}" for k in keys if fields[k] is not None) + ")"


def _indexed_rule(index: int, fields) -> Rule:
    """The :class:`Rule` of ``rules[index]`` given as a dict of its fields.

    Raises:
        ValueError: the rule's own error, naming it as ``rules[index] (...)``.
    """
    fields = dict(fields)
    try:
        return Rule(**fields)
    except ValueError as e:
        message = str(e).removeprefix("mxfx policy: ").removeprefix(f"rule {_describe(fields)} ")
        raise ValueError(f"mxfx policy: rules[{index}] {_describe(fields)}: {message}") from None


def _glob_matches(glob: str, name: str) -> bool:
    """Whether ``glob`` matches the dotted name ``name`` whole or one of its dotted suffixes."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), glob) for i in range(len(parts)))


def _covers(glob: str, module: str) -> bool:
    """Whether ``glob`` matches ``module`` or a module enclosing it, whole or by a dotted suffix."""
    parts = module.split(".")
    return any(_glob_matches(glob, ".".join(parts[:end])) for end in range(len(parts), 0, -1))


@dataclass(frozen=True)
class HeadRule(Rule):
    """A rule for a vocabulary projection by name (:data:`DEFAULT_RULES`): matches a module of that name itself,
    whole or by a dotted suffix, but not the modules inside one (``layer.0.output.dense`` of a BERT-style
    encoder is a feed-forward projection, not the head)."""

    def matches_module(self, module: str) -> bool:
        return self.module is None or _glob_matches(self.module, module)


DEFAULT_RULES: tuple[Rule, ...] = (
    # Routers keep their own precision: routing decisions are sensitive and the GEMM is tiny.
    Rule(op="router", precision="bf16"),
    # The vocabulary projection stays BF16 (the recipe: MXFP8 covers attention and MLP projections only);
    # a glob matches dotted suffixes, so these cover model.lm_head too (the projection itself, not modules inside).
    HeadRule(module="lm_head", precision="bf16"),
    HeadRule(module="output", precision="bf16"),
)


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one op."""

    precision: str
    wgrad: str
    save: str
    scale_rule: ScaleRule
    rule: Rule | None  # the rule that matched, None for the built-in defaults
    reason: str = ""  # why precision is not mxfp8 ("" when it is)
    keep_dequantized_weights: bool = False
    format: Format = formats.DEFAULT  # resolved on the current device, never "auto"
    stats: str = ""  # site prefix of the op's quantization statistics ("": none), Policy.stats
    stats_every: int = 100
    fuse_wgrad_accumulation: bool = False
    macs: int | None = None  # the GEMM's multiply-accumulates as decided on (None: not a GEMM, or not known)

    @property
    def settings(self) -> OpSettings:
        """The settings the op of this decision runs with."""
        return OpSettings(
            scale_rule=self.scale_rule,
            wgrad=self.wgrad,
            save=self.save,
            keep_dequantized_weights=self.keep_dequantized_weights,
            format=self.format,
            stats=self.stats,
            stats_every=self.stats_every,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
        )

    def shown(self, precision: str, as_written: str) -> str:
        """A precision as the precision map prints it: the low-precision choice ("mxfp8") named by this
        op's format (e.g. "fp8_block"); the high-precision one ("bf16") as ``as_written``, the dtype that part
        runs in ("fp32" in an FP32 model without autocast)."""
        return self.format.name if precision == "mxfp8" else as_written

    def fit(self, k: int, n: int, runs: str = "") -> "Decision":
        """This decision for a GEMM of ``k`` in / ``n`` out features: turned BF16 (left as the model wrote it) with
        the format's reason when they are not multiples of its ``feature_multiple``; unchanged otherwise. ``runs``:
        the dtype the GEMM as written runs in, as the precision map names it ("fp32", "bf16"; "" when not known),
        which the reason's hint names."""
        why = self.format.unfit_reason(k, n) if self.precision == "mxfp8" else ""
        if not why:
            return self
        smaller = [
            f.name for f in (formats.get(n_) for n_ in formats.NAMES) if f.low_precision and not f.unfit_reason(k, n)
        ]
        block = self.format.feature_multiple
        narrow = " and ".join(
            f"{v} {side} feature{'s' if v > 1 else ''}" for v, side in ((k, "input"), (n, "output")) if v < block
        )
        if smaller:
            hint = f"; a rule with format={smaller[0]!r} takes them"
        elif narrow:  # padding 1 output to a block would be most of the GEMM: a gate's projection stays as written
            hint = f"; the GEMM is {NARROW} ({narrow}), too narrow to pad: it stays as the model wrote it"
        else:
            kept = f"in {runs.upper()}" if runs and runs != "?" else "as the model wrote it"
            hint = f"; pad the features or keep it {kept}"
        return dataclasses.replace(self, precision="bf16", reason=why + hint)


@dataclass(frozen=True)
class Policy(_NamedFields):
    """Global settings and per-op rules for the mxfp8 backend.

    Resolution, per op and per setting: the first matching rule (user rules,
    then :data:`DEFAULT_RULES`) that *sets* that field wins; a rule leaves the
    fields it does not set to later rules, then to the policy-wide values. So
    ``{"op": "linear", "min_size": 2**30}`` changes the size threshold only and
    the vocabulary projection still stays BF16 by the default rule.

    Attributes:
        scale_rule: "rceil" (default) or "floor" for every op no rule overrides ("rceil" or "amax" for
            fp8_block ops).
        format: the low-precision format of every op no rule overrides: "mxfp8" (default; native
            GEMMs on Blackwell, exact emulation on Hopper and CPU), "fp8_block" (E4M3 with FP32 scales
            per 1x128 activation/gradient tile and 128x128 weight block, the DeepSeek-V3 recipe; native
            FP8 GEMMs on Hopper, exact emulation on CPU; ``docs/block_format.md``), "bf16_gemm" (BF16
            GEMMs from BF16 copies of the FP32 main weights cast once per step: the BF16 baseline at the same
            recipe, and the way to get BF16 routed-expert GEMMs where autocast cannot reach them), or "auto"
            (fp8_block on sm90, mxfp8 elsewhere, resolved per compile on the current CUDA device). The
            precision values "mxfp8" of ``precision``/``wgrad``/``save`` mean "in the op's format";
            ``precision="bf16"`` leaves an op exactly as the model wrote it.
        wgrad: overrides the per-kind wgrad default for every op no rule overrides.
        save: default saved-activation precision ("mxfp8": pack where it replaces BF16).
        min_size: default minimum GEMM size in multiply-accumulates (0: rewrite all
            eligible), or "auto" (opt-in): rewrite a GEMM only where the measured
            crossover table of the op's format on the current device
            (``mxfx/policy/crossover_<format>_sm<cc>.json``, written by ``bench/crossover.py --format``) says
            that format's forward+backward beats BF16 at the nearest measured projection family and token count
            (:func:`mxfx.policy.crossover.prefers_low_precision`); routed grouped GEMMs use the
            average rows per expert as M. Without a table of the format for the device it warns
            once and rewrites everything eligible.
        keep_dequantized_weights: where the GEMM is emulated (no native MX GEMM:
            Hopper, CPU), cache each MX weight's dequantized BF16 forward and dgrad
            operands instead of its MX forms (rebuilt once per optimizer step, in one
            pass over the weight) and feed them to the GEMM, saving the weight
            dequantize in every GEMM. Holds 2 bytes per weight value per orientation
            (4 for both, against about 2 for the MX forms). Results are identical on CUDA;
            on CPU, whose emulation otherwise runs in fp32, they differ only in blocks with
            scales below 2^-118, where BF16 flushes E4M3 subnormals.
            Off by default.
        rules: user rules, checked in order before :data:`DEFAULT_RULES`.
        passes: per-pass on/off switches, e.g. ``{"linear": False}``.
        inner: compiler run after the rewrite: "inductor" (default), "aot_eager",
            "eager", or any torch.compile backend callable ``(gm, example_inputs)``; a callable
            that runs Inductor must turn its buffer reuse off (``mxfx.backend.CACHE_SAFE_INDUCTOR``).
        dump_dir: write before/after graphs and the precision map here. Left out, the ``MXFX_DUMP_DIR``
            environment variable's folder (else no dump); given, None included, it wins over the variable.
        transport: precision per expert-parallel all-to-all direction, keys from
            :data:`TRANSPORT_DIRECTIONS`, values "mxfp8" or "bf16"; unset
            directions are MXFP8, e.g. ``{"dispatch_bwd": "bf16"}``. A rule with
            ``op="all_to_all", precision="bf16"`` keeps a module's all-to-alls as written.
        stats: quantization statistics per quantize site (:mod:`mxfx.runtime.stats`, ``docs/numerics.md``), or None
            (off). Left out, the policy takes the ``MXFX_STATS`` environment variable's value (:data:`STATS_ENV`),
            else None; given, None included, it wins over the variable, as ``options`` win over ``MXFX_POLICY``
            (:meth:`from_options`). A dict with
            ``every`` (sample every this many optimizer steps, default 100) and ``modules`` (a glob matched as a
            rule's module glob, default every module), e.g. ``{"every": 100, "modules": "layers.*.mlp.*"}``. The
            rewritten ops of matching modules carry a statistics op whose body samples on the steps it names;
            None leaves the compiled graphs as they are without it.
        kernels: how mxfx's Triton kernels enter a compiled CUDA graph: "inductor" (traced in as ``wrap_triton``
            calls that Inductor's generated code launches: less host time per call, a longer first compile, since
            Inductor analyses and compiles each such kernel per call site) or "opaque" (mxfx's custom ops, each
            launching its kernels: a shorter first compile, more host time per call) or "auto" (either, per graph:
            opaque where the GPU time of the graph's converted GEMMs covers the custom ops' extra host time,
            :mod:`mxfx.policy.launch_cost`; the precision map's header names the choice and why).
            None (default): the ``MXFX_OPAQUE_KERNELS`` environment variable's choice where it is set, else
            "auto"; given, it wins over the variable. Each ``torch.compile`` call reads its own options (a compiled
            optimizer step's too). Graphs on CPU always
            keep the custom ops; the grouped GEMMs stay ops either way.
        fuse_wgrad_accumulation: the converted ops' wgrad GEMMs write each FP32 weight's gradient into its ``.grad``
            themselves (add to it; write a new one where it is None) and return none to autograd, whose
            ``AccumulateGrad`` then adds nothing (``docs/caches.md``, "Weight gradients written by their GEMM").
            Where that cannot be exact the op returns its gradient to autograd as without it, and the precision
            map says why: a weight that is not an FP32 leaf parameter, or one with gradient hooks or
            post-accumulate-grad hooks when the graph compiles (one registered later raises in the backward).
            Under compiled autograd on when the graph compiles every op returns its gradient to autograd (turned
            on later, a fused op raises in the backward). On by default: each wgrad GEMM
            adds into ``.grad`` itself (CPU reference, cuBLAS, the routed Triton kernel's epilogue); set False to
            take weight gradients with ``torch.autograd.grad``, which a fused weight refuses.
    """

    scale_rule: str = _DEFAULT_SCALE_RULE
    wgrad: str | None = None
    save: str = "mxfp8"
    min_size: int | str = 0
    keep_dequantized_weights: bool = False
    rules: tuple[Rule, ...] = ()
    passes: Mapping = field(default_factory=dict)
    inner: str | Callable = "inductor"
    dump_dir: str | None = _FromEnv(DUMP_ENV)
    transport: Mapping = field(default_factory=dict)
    format: str = "mxfp8"
    stats: Mapping | None = STATS_FROM_ENV
    kernels: str | None = None
    fuse_wgrad_accumulation: bool = True

    def __post_init__(self):
        for name, valid in (("scale_rule", SCALE_RULES), ("save", PRECISIONS)):
            if getattr(self, name) not in valid:  # None is not a value here
                raise ValueError(
                    f"mxfx policy: {name}={getattr(self, name)!r} is not valid; "
                    f"choose one of {', '.join(map(repr, valid))}"
                )
        _check_choice("wgrad", self.wgrad, PRECISIONS)
        _check_choice("kernels", self.kernels, KERNEL_LAUNCHES)
        _check_choice("format", self.format, FORMAT_CHOICES)
        if self.format is None:
            raise ValueError(
                f"mxfx policy: format=None is not valid; choose one of {', '.join(map(repr, FORMAT_CHOICES))}"
            )
        if not isinstance(self.rules, (list, tuple)) or not all(isinstance(r, (Rule, dict)) for r in self.rules):
            raise ValueError(f"mxfx policy: rules={self.rules!r} must be a list of mxfx.Rule or dicts of Rule fields")
        if not isinstance(self.passes, Mapping):
            raise ValueError(
                f"mxfx policy: passes={self.passes!r} must be a dict of pass name -> bool; passes: {', '.join(PASSES)}"
            )
        if isinstance(self.dump_dir, _FromEnv):  # left out: the environment variable decides
            env = os.environ.get(DUMP_ENV, "")
            object.__setattr__(self, "dump_dir", env if env.strip() else None)  # blank: unset, as empty
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"mxfx policy: dump_dir={self.dump_dir!r} must be a path (str) or None")
        if self.dump_dir is not None and not os.fspath(self.dump_dir).strip():
            raise ValueError(
                f"mxfx policy: dump_dir={os.fspath(self.dump_dir)!r} is blank; name a folder for the graphs and "
                "precision maps, or leave dump_dir out (None) to write none"
            )
        if self.dump_dir is not None and os.path.exists(self.dump_dir) and not os.path.isdir(self.dump_dir):
            raise ValueError(
                f"mxfx policy: dump_dir={os.fspath(self.dump_dir)!r} is a file, not a folder; name a folder (it is "
                f"created where missing) or unset {DUMP_ENV}"
            )
        _check_min_size(self.min_size, allow_none=False)
        for flag in ("keep_dequantized_weights", "fuse_wgrad_accumulation"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"mxfx policy: {flag}={getattr(self, flag)!r} must be True or False")
        if not callable(self.inner) and self.inner not in INNER_COMPILERS:
            raise ValueError(
                f"mxfx policy: inner={self.inner!r} is not valid; "
                f"choose one of {', '.join(map(repr, INNER_COMPILERS))} or a backend callable"
            )
        rules = tuple(r if isinstance(r, Rule) else _indexed_rule(i, r) for i, r in enumerate(self.rules))
        object.__setattr__(self, "rules", rules)
        _check_rule_fits_format(self.format, self.scale_rule, "policy-wide")
        if self.scale_rule != _DEFAULT_SCALE_RULE and _without_scales(self.format):
            raise ValueError(
                f"mxfx policy: scale_rule={self.scale_rule!r} would do nothing: format={self.format!r} has no scales "
                f"({formats.get(self.format).description}); drop scale_rule, or choose a format with scales"
            )
        if self.keep_dequantized_weights and not any(
            _may_keep_dequantized(f) for f in [self.format, *(r.format for r in rules)]
        ):
            raise ValueError(
                f"mxfx policy: keep_dequantized_weights=True would do nothing with format={self.format!r} (it "
                f"caches BF16 weights for emulated GEMMs of a format that has such forms; this one reads its "
                f"own low-precision forms): drop it, or give the ops it is for a rule with a format that has "
                f"them ({', '.join(repr(n) for n in formats.NAMES if _may_keep_dequantized(n))})"
            )
        for r in rules:
            if r.format is not None or r.scale_rule is not None:
                self._check_scale_rule_of(r)
        for name, on in self.passes.items():
            _check_choice("passes", name, PASSES)
            if not isinstance(on, bool):
                raise ValueError(f"mxfx policy: passes[{name!r}]={on!r} must be True or False")
        if not isinstance(self.transport, Mapping):
            raise ValueError(f"mxfx policy: transport={self.transport!r} must be a dict of direction -> precision")
        for direction, precision in self.transport.items():
            _check_choice("transport", direction, TRANSPORT_DIRECTIONS)
            if precision not in PRECISIONS:
                raise ValueError(
                    f"mxfx policy: transport[{direction!r}]={precision!r} is not valid; choose one of 'mxfp8', 'bf16'"
                )
        # validated once: read-only from here on, as the frozen fields are
        object.__setattr__(self, "passes", ReadOnlyDict(self.passes))
        object.__setattr__(self, "transport", ReadOnlyDict(self.transport))
        stats = self.stats
        if stats is STATS_FROM_ENV:  # left out: the environment variable decides
            stats = parse_stats_env(os.environ[STATS_ENV]) if os.environ.get(STATS_ENV, "").strip() else None
        object.__setattr__(self, "stats", _check_stats(stats))

    @classmethod
    def from_options(cls, options: "Policy | dict | None") -> "Policy":
        """Build a policy from ``torch.compile(..., options=...)``: a Policy, a dict, or None.

        None (a trainer that passes only the backend name, e.g. torchtitan's ``--compile.backend``)
        gives the policy of the TOML file named by ``MXFX_POLICY`` when it is set, else the defaults.

        Given options win: where ``MXFX_POLICY`` is set too, its file is not read, and that is warned once per
        file name.

        Raises:
            FileNotFoundError: ``MXFX_POLICY`` names no file.
        """
        ignored = os.environ.get(POLICY_ENV, "").strip()
        if options is not None and ignored and ignored not in _IGNORED_FILES:
            _IGNORED_FILES.add(ignored)
            warnings.warn(
                f"mxfx policy: {POLICY_ENV}={ignored!r} is set, but the compile gives options, which win: the file "
                f"is not read. Put its settings in the options (mxfx.Policy.from_toml reads the file into a Policy "
                f"to pass), or give no options",
                stacklevel=2,
            )
        if options is None:
            path = os.environ.get(POLICY_ENV, "").strip()
            if not path:
                return cls()
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"mxfx policy: {POLICY_ENV}={path!r} is not a file; set it to a TOML file "
                    f"of Policy fields (see mxfx.Policy.from_toml) or unset it"
                )
            return cls.from_toml(path)
        if isinstance(options, Policy):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"mxfx policy: options must be a mxfx.Policy or a dict, got {type(options).__name__}")
        return cls(**options)

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> "Policy":
        """Read a policy from a TOML file with the same keys (rules as ``[[rules]]`` tables).

        Raises:
            FileNotFoundError: ``path`` is not a file.
            ValueError / TypeError: the file is not UTF-8 TOML, or its keys or values are not a policy's; the
                message names the file.

        A file that sets no field (empty, or comments only) warns and gives the default policy.
        """
        name = os.fspath(path)
        if not os.path.isfile(name):
            raise FileNotFoundError(
                f"mxfx policy: {name!r} is not a file; pass a TOML file of Policy fields (rules as [[rules]] tables)"
            )
        with open(name, "rb") as f:
            try:
                table = tomllib.load(f)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"mxfx policy: {name!r} is not valid UTF-8 TOML (no byte-order mark): {e}") from e
        if not table:
            warnings.warn(
                f"mxfx policy file {name!r} sets no field: the default policy applies (write the Policy fields "
                f"there, rules as [[rules]] tables, or name another file)",
                stacklevel=2,
            )
        try:
            return cls(**table)
        except (TypeError, ValueError) as e:
            raise type(e)(f"mxfx policy file {name!r}: {str(e).removeprefix('mxfx policy: ')}") from e

    def stats_site(self, module: str) -> str:
        """The statistics site prefix of the ops of ``module`` (its name, ``"<root>"`` for the model's own ops) when
        ``stats`` is on and its ``modules`` glob covers the module, else ""."""
        if self.stats is None or not _covers(self.stats["modules"], module or "<root>"):
            return ""
        return module or "<root>"

    def describe_rule(self, rule: Rule) -> str:
        """``rule`` as errors and warnings name it: ``rules[i] (...)`` for a user rule of this policy (its index in
        ``rules`` and the fields it sets), ``default rule (...)`` for one of :data:`DEFAULT_RULES`."""
        if rule in self.rules:
            return f"rules[{self.rules.index(rule)}] {rule.describe()}"
        return f"{'default ' if rule in DEFAULT_RULES else ''}rule {rule.describe()}"

    def _check_scale_rule_of(self, rule: Rule) -> None:
        """Raise ValueError when user rule ``rule``'s scale rule is not one of its format's, where the rule sets
        one of the two and inherits the other from the policy-wide values: naming the rule, which field it
        inherits, and the fix."""
        fmt, scale_rule = rule.format or self.format, rule.scale_rule or self.scale_rule
        where = self.describe_rule(rule)
        if rule.scale_rule is not None and _without_scales(fmt):
            raise ValueError(
                f"mxfx policy: {where}: scale_rule={rule.scale_rule!r} would do nothing: its format={fmt!r} has no "
                f"scales ({formats.get(fmt).description}); drop scale_rule from the rule"
            )
        valid = formats.rules_of(fmt)
        if scale_rule in valid:
            return
        if rule.scale_rule is None:  # the rule's format, the policy-wide scale rule
            fixed = {
                f.name: getattr(rule, f.name) for f in dataclasses.fields(rule) if getattr(rule, f.name) is not None
            }
            fixed["scale_rule"] = valid[0]
            raise ValueError(
                f"mxfx policy: {where}: its format={fmt!r} does not take scale_rule={scale_rule!r}, which the "
                f"rule inherits from the policy-wide scale_rule (it sets none); give the rule a scale_rule "
                f"of {fmt} ({', '.join(map(repr, valid))}), e.g. {fixed}"
            )
        if rule.format is None:  # the rule's scale rule, the policy-wide format
            takers = [n for n in formats.NAMES if formats.get(n).scale_rules and scale_rule in formats.rules_of(n)]
            raise ValueError(
                f"mxfx policy: {where}: scale_rule={scale_rule!r} is not a rule of format={fmt!r}, which the "
                f"rule inherits from the policy-wide format (it sets none); choose one of "
                f"{', '.join(map(repr, valid))}, or give the rule a format that takes {scale_rule!r} "
                f"({', '.join(f'format={n!r}' for n in takers)})"
            )
        _check_rule_fits_format(fmt, scale_rule, where)

    def transport_precision(self, direction: str) -> str:
        """Precision of one all-to-all direction (one of :data:`TRANSPORT_DIRECTIONS`)."""
        _check_choice("transport", direction, TRANSPORT_DIRECTIONS)
        return self.transport.get(direction, "mxfp8")

    def pass_enabled(self, name: str) -> bool:
        """Whether pass ``name`` runs (``passes`` switches; every pass is on by default)."""
        return self.passes.get(name, True)

    def _matching(self, kind: str, module: str) -> list[Rule]:
        """The rules that apply to an op, in order: user rules, then default rules. Where a default rule matches
        (a router, the vocabulary projection), only user rules that name the op (:meth:`Rule.names`) come before
        it: a rule for a whole block (``layers.0``) or for every op does not switch its router or head."""
        defaults = [r for r in DEFAULT_RULES if r.matches(kind, module)]
        user = [r for r in self.rules if r.matches(kind, module) and (not defaults or r.names(kind, module))]
        return [*user, *defaults]

    def requesting_rule(self, kind: str, module: str) -> Rule | None:
        """The user rule that asks for low precision for an op of ``kind`` in ``module``: the first matching rule
        that sets ``precision`` when it says "mxfp8", else (no matching rule sets it) the first matching user rule
        that sets ``format``; None when no user rule asks (the op is converted by default, or kept by a rule)."""
        matching = self._matching(kind, module)
        decider = next((r for r in matching if r.precision is not None), None)
        if decider is not None:
            return decider if decider.precision == "mxfp8" else None
        return next((r for r in matching if r.format is not None), None)

    def keeping_rule(self, module: str) -> Rule | None:
        """The user rule that keeps the GEMMs of ``module`` as written whatever their kind: the first rule that
        matches the module, names no ``op`` and sets ``precision``, when it sets one other than "mxfp8"; else None."""
        rule = next((r for r in self.rules if r.op is None and r.precision and r.matches_module(module)), None)
        return rule if rule is not None and rule.precision != "mxfp8" else None

    def decide(
        self, kind: str, module: str, macs: int | None = None, gemm: tuple[int, int, int] | None = None
    ) -> Decision:
        """Resolve precision for an op of ``kind`` in module ``module`` with a GEMM of ``macs`` MACs.

        ``gemm`` = ``(M, N, K)`` of that GEMM, needed by ``min_size="auto"``
        (without it an "auto" op is rewritten).
        """
        _check_choice("op", kind, OP_KINDS)
        matching = self._matching(kind, module)

        def first(name):  # each setting comes from the first matching rule that sets it
            return next(((getattr(r, name), r) for r in matching if getattr(r, name) is not None), (None, None))

        get = lambda name: first(name)[0]  # noqa: E731
        fmt = formats.get(get("format") or self.format)
        precision, rule = first("precision")
        precision = precision or "mxfp8"
        min_size, size_rule = first("min_size")
        min_size = self.min_size if min_size is None else min_size
        reason = ""
        if precision != "mxfp8":
            origin = "default rule" if rule in DEFAULT_RULES else "policy rule"
            reason = f"kept as written by {origin} {rule.describe()}"  # precision='bf16': as written, in any dtype
        elif min_size == "auto":
            if gemm is not None and fmt.low_precision:  # a BF16 format has no crossover with BF16
                faster, why = prefers_low_precision(fmt.name, *gemm, keep_dequantized=self.keep_dequantized_weights)
                if not faster:
                    precision, reason = "bf16", f"min_size='auto': {why}"
        elif macs is not None and macs < min_size:
            precision, reason = "bf16", f"GEMM of {macs} MACs is below min_size {min_size}"
        rule = rule or size_rule or (matching[0] if matching else None)
        if kind == "all_to_all":  # the payload travels in the transport format of the op's format
            fmt = formats.get(fmt.transport)
        return Decision(
            precision=precision,
            wgrad=get("wgrad") or self.wgrad or KIND_DEFAULT_WGRAD.get(kind, "mxfp8"),
            save=get("save") or self.save,
            scale_rule=(
                self._judged_rule(fmt, first("format")[1], first("scale_rule")[1], kind, module)
                if precision == "mxfp8"
                else ScaleRule(get("scale_rule") or self.scale_rule)
            ),
            rule=rule,
            reason=reason,
            keep_dequantized_weights=self.keep_dequantized_weights,
            format=fmt,
            stats=self.stats_site(module) if precision == "mxfp8" else "",
            stats_every=self.stats["every"] if self.stats is not None else 100,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            macs=macs,
        )

    def _judged_rule(
        self, fmt: Format, format_rule: Rule | None, rule_rule: Rule | None, kind: str, module: str
    ) -> ScaleRule:
        """The scale rule of an op, judged by its format: each field may come from a different rule (or the
        policy-wide value), so some combinations only meet for some modules.

        Raises:
            ValueError: naming the op, the module and where the format and the scale rule came from, with a fix.
        """
        scale_rule = (rule_rule.scale_rule if rule_rule is not None else None) or self.scale_rule
        try:
            return fmt.rule(scale_rule, "mxfx policy")
        except ValueError as e:
            origin = lambda r, f: self.describe_rule(r) if r is not None else f"policy-wide {f}"  # noqa: E731
            transport = " (the all-to-all's transport format)" if kind == "all_to_all" else ""
            raise ValueError(
                f"{e}; for the {kind} op of module {module!r}, format {fmt.name!r}{transport} comes from "
                f"{origin(format_rule, 'format=' + repr(self.format))} and scale_rule={scale_rule!r} from "
                f"{origin(rule_rule, 'scale_rule')}: add before those rules (the first rule that sets a field wins) "
                f"a rule for this module or op that sets both "
                f"(e.g. {{'module': {module!r}, 'op': {kind!r}, 'scale_rule': {fmt.scale_rules[0].value!r}}})"
            ) from None
