"""Per-op MX settings: the one object the policy's decision produces and the MX ops read by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mxfx.numerics.block import check_rule as check_block_rule
from mxfx.numerics.mx import check_rule

FORMATS = ("mxfp8", "fp8_block")
"""Block-scaled formats the ops carry: "mxfp8" (E4M3 payload, one E8M0 scale per 32 values) and
"fp8_block" (E4M3 payload, one FP32 scale per 1x128 tile of activations and gradients and per
128x128 block of weights, ``docs/block_format.md``)."""

PRECISIONS = ("mxfp8", "bf16")
"""Precisions of a wgrad GEMM or of activations saved for backward. "mxfp8" is the low-precision
choice: it means the op's own format (:data:`FORMATS`), e.g. FP8 1x128 tiles under "fp8_block"."""


@dataclass(frozen=True)
class MXSettings:
    """How one MX op runs.

    Attributes:
        scale_rule: "rceil" or "floor" (E8M0 scale rounding, ``docs/format.md``); under "fp8_block"
            "rceil" or "amax" (``docs/block_format.md``).
        wgrad: weight-gradient GEMM precision, "mxfp8" or "bf16".
        save: precision of activations saved for backward, "mxfp8" or "bf16" (a reference).
        keep_dequantized_weights: where the GEMM is emulated, read the weight cache's BF16
            dequantized forms instead of dequantizing the MX forms per GEMM.
        format: the block-scaled format, one of :data:`FORMATS`.

    Raises:
        ValueError: a value outside those listed, naming the field.
    """

    scale_rule: str = "rceil"
    wgrad: str = "mxfp8"
    save: str = "mxfp8"
    keep_dequantized_weights: bool = False
    format: str = "mxfp8"

    def __post_init__(self):
        if self.format == "fp8_block":
            check_block_rule(self.scale_rule, "mxfx.MXSettings (format='fp8_block')")
        else:
            check_rule(self.scale_rule, "mxfx.MXSettings")
        for name, valid in (("wgrad", PRECISIONS), ("save", PRECISIONS),
                            ("keep_dequantized_weights", (False, True)), ("format", FORMATS)):
            value = getattr(self, name)
            if value not in valid or (name == "keep_dequantized_weights") != isinstance(value, bool):
                raise ValueError(f"mxfx.MXSettings: {name}={value!r} is not valid; choose one of "
                                 f"{', '.join(map(repr, valid))}")

    def graph_kwargs(self) -> dict:
        """The keyword arguments of an MX op call in a rewritten graph (the defaults of the last two left out)."""
        out = {"scale_rule": self.scale_rule, "wgrad": self.wgrad, "save": self.save}
        if self.keep_dequantized_weights:
            out["keep_dequantized_weights"] = True
        if self.format != "mxfp8":
            out["format"] = self.format
        return out


FIELDS = tuple(f.name for f in dataclasses.fields(MXSettings))


def resolve(op: str, settings: MXSettings | None, fields: dict, wgrad_default: str) -> MXSettings:
    """The settings of one op call: ``settings`` with ``fields`` (keyword arguments named as
    :class:`MXSettings` fields) replacing its values; without ``settings``, the defaults with
    ``wgrad=wgrad_default``.

    Raises:
        TypeError: a keyword that is not a settings field, naming ``op``.
        ValueError: an invalid value (see :class:`MXSettings`), prefixed by ``op``.
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"{op}: unknown keyword(s) {unknown}; settings keywords are {', '.join(FIELDS)}")
    try:
        return dataclasses.replace(settings if settings is not None else MXSettings(wgrad=wgrad_default), **fields)
    except ValueError as e:
        raise ValueError(str(e).replace("mxfx.MXSettings", op)) from None
