"""What an op's precision-map columns say, read from the graph's own example values.

A column names the dtype that runs, not the one a policy hoped for: an op left as written computes in the dtype
of its output (autocast's where autocast is on for it, the operands' own where it is off, as in an
``autocast(enabled=False)`` region or an FP32 model without autocast), and its backward GEMMs in the same dtype.
A column reads ``-`` where that part does not run: no backward for an op no gradient flows through (under
``torch.no_grad()``, or with nothing that needs a gradient), no dgrad for an input that needs none, no wgrad and
nothing saved for a frozen weight.
"""

from __future__ import annotations

import torch

from mxfx.policy import Decision
from mxfx.report import NONE, precision_of

NO_BACKWARD = "no gradient flows through it (torch.no_grad() or no operand needs one): forward only"
FROZEN = "frozen weight: no weight gradient"


def ran(t: torch.Tensor | None) -> str:
    """The precision-map name of example value ``t``'s dtype ("fp32", "bf16", ...; "?" without one)."""
    return precision_of(t.dtype) if t is not None else "?"


def needs_grad(t: torch.Tensor | None) -> bool:
    """Whether example value ``t`` takes part in a backward (True without one: not known, claimed as before)."""
    return t is None or t.requires_grad


def gemm_columns(out, x, w, forward: str, dgrad: str, wgrad: str, saved: str, reason: str = "") -> dict:
    """The :class:`mxfx.report.OpRecord` fields ``forward``, ``dgrad``, ``wgrad``, ``saved`` and ``reason`` of an op
    whose output, input and weight have example values ``out``, ``x``, ``w`` (None where not known, or no weight),
    given what each column says with a full backward: ``-`` for the parts that do not run, with a note saying
    why after ``reason``. The no-backward note is left to :meth:`mxfx.report.PrecisionMap.mark_inference` in a
    graph traced with grad disabled."""
    if not needs_grad(out):
        dgrad = wgrad = saved = NONE
        note = NO_BACKWARD if torch.is_grad_enabled() else ""
    else:
        trained = needs_grad(w)
        dgrad = dgrad if needs_grad(x) else NONE
        wgrad, saved = (wgrad, saved) if trained else (NONE, NONE)
        note = "" if trained else FROZEN
    return {
        "forward": forward,
        "dgrad": dgrad,
        "wgrad": wgrad,
        "saved": saved,
        "reason": "; ".join(r for r in (reason, note) if r),
    }


def kept_dtype(out, x) -> str:
    """The dtype a GEMM left as written runs in (:func:`ran`): its output's, else its input's."""
    return ran(out if out is not None else x)


def kept_gemm(out, x, w, reason: str) -> dict:
    """:func:`gemm_columns` of a GEMM left as written (for ``reason``): every part in its output's dtype."""
    p = kept_dtype(out, x)
    return gemm_columns(out, x, w, p, p, p, p, reason)


def converted_gemm(d: Decision, out, x, w, high_wgrad: str, reason: str = "") -> dict:
    """:func:`gemm_columns` of a GEMM converted per decision ``d``: forward and dgrad in its format, the wgrad in
    its format or ``high_wgrad`` (the dtype the op's high-precision wgrad GEMM runs in), the saved input as the
    format's copy or as the input itself (its own dtype); plus ``macs``, the GEMM's size as ``d`` was decided on."""
    fmt = d.format.name
    columns = gemm_columns(out, x, w, fmt, fmt, d.shown(d.wgrad, high_wgrad), d.shown(d.save, ran(x)), reason)
    return {**columns, "macs": d.macs}
