"""Per-op settings: the one object a policy decision produces and the autograd ops read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mxfx import formats
from mxfx.formats import Format, ScaleRule
from mxfx.runtime import stats

PRECISIONS = ("mxfp8", "bf16")
"""Precisions of a wgrad GEMM or of activations saved for backward. "mxfp8" is the low-precision
choice: it means the op's own format, e.g. FP8 1x128 tiles under ``format="fp8_block"``."""


@dataclass(frozen=True)
class OpSettings:
    """How one low-precision op runs.

    Attributes:
        format: the :class:`~mxfx.formats.Format` (a name or ``"auto"`` is turned into the object).
        scale_rule: a :class:`~mxfx.formats.ScaleRule` of that format (its string value is accepted).
        wgrad: weight-gradient GEMM precision, "mxfp8" (the format's) or "bf16".
        save: precision of activations saved for backward, "mxfp8" (the format's) or "bf16" (a reference).
        keep_dequantized_weights: where the GEMM is emulated, read the weight cache's BF16
            dequantized forms instead of dequantizing the low-precision forms per GEMM (formats without
            emulated GEMMs ignore it).
        stats: quantization statistics (:mod:`mxfx.runtime.stats`): the site prefix of the op's quantizes
            (its module's name; sites ``<stats>/<op kind>/<direction>``), "" (default) for none.
        stats_every: sample every this many optimizer steps (an int >= 1; read only with ``stats``).
        fuse_wgrad_accumulation: the wgrad GEMM writes the weight's gradient into the parameter's ``.grad`` itself
            (adds to it, or writes a new one) and the op returns none to autograd (:mod:`mxfx.ops.wgrad`,
            :mod:`mxfx.runtime.main_grad`); False: the op returns it and autograd accumulates it.

    Raises:
        ValueError: a value outside those listed, or a scale rule the format does not take, naming the field.
    """

    scale_rule: ScaleRule | str = ScaleRule.RCEIL
    wgrad: str = "mxfp8"
    save: str = "mxfp8"
    keep_dequantized_weights: bool = False
    format: Format | str = formats.DEFAULT.name  # a name, not the object: Dynamo reads defaults without a source
    stats: str = ""
    stats_every: int = 100
    fuse_wgrad_accumulation: bool = False

    def __post_init__(self):
        object.__setattr__(self, "format", formats.get(self.format))
        object.__setattr__(self, "scale_rule", self.format.rule(self.scale_rule, "mxfx.OpSettings"))
        if not isinstance(self.stats, str):
            raise ValueError(
                f"mxfx.OpSettings: stats={self.stats!r} must be a site prefix string (a module name), "
                f"or '' for no statistics"
            )
        if not isinstance(self.stats_every, int) or isinstance(self.stats_every, bool) or self.stats_every < 1:
            raise ValueError(
                f"mxfx.OpSettings: stats_every={self.stats_every!r} must be an int >= 1 (optimizer steps "
                f"between samples)"
            )
        flags = ("keep_dequantized_weights", "fuse_wgrad_accumulation")
        for name, valid in (("wgrad", PRECISIONS), ("save", PRECISIONS), *((f, (False, True)) for f in flags)):
            value = getattr(self, name)
            if value not in valid or (name in flags) != isinstance(value, bool):
                raise ValueError(
                    f"mxfx.OpSettings: {name}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}"
                )

    def graph_kwargs(self) -> dict:
        """The keyword arguments of an op call in a rewritten graph: plain values (the defaults of the last
        ones left out: without statistics, the call is that of an op without the ``stats`` fields)."""
        out = {"scale_rule": self.scale_rule.value, "wgrad": self.wgrad, "save": self.save}
        if self.keep_dequantized_weights:
            out["keep_dequantized_weights"] = True
        if self.format is not formats.DEFAULT:
            out["format"] = self.format.name
        if self.stats:
            out["stats"], out["stats_every"] = self.stats, self.stats_every
        if self.fuse_wgrad_accumulation:
            out["fuse_wgrad_accumulation"] = True
        return out

    def observe(self, kind: str, direction: str, layout: str, source, operand, combine: str = "", offs=None) -> None:
        """Sample the quantize site ``<stats>/<kind>/<direction>`` (:func:`mxfx.runtime.stats.observe`): ``operand``,
        made by this op's format, against ``source`` (``offs``: the group ends of a ``group_tokens`` operand);
        nothing when ``stats`` is ""."""
        if self.stats:
            stats.observe(
                f"{self.stats}/{kind}/{direction}",
                self.format.name,
                self.scale_rule.value,
                layout,
                source,
                operand,
                self.stats_every,
                combine,
                offs,
            )


FIELDS = tuple(f.name for f in dataclasses.fields(OpSettings))


def settings_of(kwargs: dict) -> OpSettings:
    """The settings an op call of a rewritten graph carries in its keyword arguments
    (:meth:`OpSettings.graph_kwargs`)."""
    return OpSettings(**{k: kwargs[k] for k in FIELDS if k in kwargs})


_DEFAULTS = {wgrad: OpSettings(wgrad=wgrad) for wgrad in PRECISIONS}
"""The default settings by wgrad precision, built once: an op traced by Dynamo (``torch.compile`` of code calling
the op itself) then reads a module global instead of building a Format from the dataclass defaults, an object
Dynamo cannot create without a source."""


def resolve(op: str, settings: OpSettings | None, fields: dict, wgrad_default: str) -> OpSettings:
    """The settings of one op call: ``settings`` with ``fields`` (keyword arguments named as
    :class:`OpSettings` fields) replacing its values; without ``settings``, the defaults with
    ``wgrad=wgrad_default``.

    Raises:
        TypeError: a keyword that is not a settings field, naming ``op``.
        ValueError: an invalid value (see :class:`OpSettings`), prefixed by ``op``.
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"{op}: unknown keyword(s) {unknown}; settings keywords are {', '.join(FIELDS)}")
    base = settings if settings is not None else _DEFAULTS[wgrad_default]
    if not fields:
        return base
    try:
        return dataclasses.replace(base, **fields)
    except ValueError as e:
        raise ValueError(str(e).replace("mxfx.OpSettings", op)) from None
