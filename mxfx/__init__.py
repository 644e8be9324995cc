"""mxfx: MXFP8 (OCP Microscaling) training of Mixture-of-Experts models as a torch.compile backend.

Use ``torch.compile(model, backend="mxfp8", options={...})``; the backend is found
through an entry point, no import needed. This package also exposes the format
reference (:func:`quantize`, :func:`dequantize`), the :class:`Policy`, and the
inspection helpers (:func:`all_reports` / :func:`last_report`: the precision map of every compiled graph / of the
last, :func:`reset_reports` forgets them; :func:`stats`: quantization statistics per quantize site,
:func:`watch_steps`: a model no compiled graph reached, named at its optimizer's first step).
"""

from mxfx.numerics.mx import dequantize, quantize  # noqa: F401
from mxfx.policy import DEFAULT_RULES, Policy, Rule  # noqa: F401
from mxfx.names import name_modules  # noqa: F401
from mxfx.diagnostics.coverage import watch_steps  # noqa: F401
from mxfx.report import all_reports, last_report, reset_reports  # noqa: F401
from mxfx.runtime.stats import reset as reset_stats, table as stats  # noqa: F401
from mxfx.ops import grouped_mm as _grouped_mm  # noqa: F401,E402  (registers every torch.ops.mxfx op)

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_RULES",
    "Policy",
    "Rule",
    "all_reports",
    "dequantize",
    "last_report",
    "name_modules",
    "quantize",
    "reset_reports",
    "reset_stats",
    "stats",
    "watch_steps",
]
