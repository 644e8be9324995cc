"""A warning when Dynamo gives up compiling a frame whose graphs mxfx converted.

After ``torch._dynamo.config.recompile_limit`` compiles of one frame (one code object: a ``forward``, or the
resume function after a graph break), Dynamo stops compiling it and runs it eagerly whenever no compiled graph's
guards hold: uncompiled, so none of mxfx's conversions apply there, at eager speed. Dynamo says so only in its
log (a WARNING of logger ``torch._dynamo.convert_frame``, emitted while that frame's compile id is current).
:func:`observe` records, per compiled graph, the frame it belongs to where mxfx converted an op of it; a filter on
that logger turns Dynamo's record for such a frame into one ``UserWarning`` per frame, naming it and the last
recompile reason. Frames mxfx converted nothing in are left to Dynamo's own log line.
"""

from __future__ import annotations

import logging
import warnings

from torch._guards import CompileContext

LOGGER = "torch._dynamo.convert_frame"
"""The logger Dynamo reports a recompile-limit hit on."""

_HIT = "torch._dynamo hit config."  # the start of that record's message; its args: limit name, limit, frame, reason

_converted: set[int] = set()  # Dynamo frame ids with a compiled graph mxfx converted ops of
_warned: set[int] = set()  # frame ids warned about (once each per process)


def _frame_id() -> int | None:
    compile_id = CompileContext.current_compile_id()
    return None if compile_id is None else compile_id.frame_id


def _first_compile_since_reset() -> bool:
    """Whether the compile under way is the first of frame 0: Dynamo numbers frames from 0 again after
    ``torch._dynamo.reset()``, so the frame ids recorded before it name other frames now."""
    compile_id = CompileContext.current_compile_id()
    return compile_id is not None and compile_id.frame_id == 0 and compile_id.frame_compile_id == 0


class _LimitFilter(logging.Filter):
    """Passes every record on; a recompile-limit record of a frame in ``_converted`` also warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith(_HIT) and len(args) >= 4:
            frame = _frame_id()
            if frame in _converted and frame not in _warned:
                _warned.add(frame)
                warn_limit_hit(*args[:4])
        return True


_FILTER = _LimitFilter()


def warn_limit_hit(limit_name: str, limit, where: str, reason) -> None:
    """The warning for frame ``where`` (``'forward' (file:line)``) hitting Dynamo's ``limit_name`` (``limit``);
    ``reason`` is Dynamo's last recompile reason (its first line is kept)."""
    reason = " ".join((str(reason).splitlines() or [""])[0].split())
    warnings.warn(
        f"mxfx: torch.compile stopped compiling {where} after {limit} compiles (torch._dynamo.config.{limit_name}): "
        f"from now on, inputs that fail its compiled graphs' guards run it eagerly, uncompiled and without mxfx's "
        f"conversions (its GEMMs in the model's own precision, at eager speed). Last recompile reason: {reason}. "
        f'TORCH_LOGS="recompiles" lists every reason; make the changing sizes dynamic '
        f"(torch._dynamo.mark_dynamic, or torch.compile(..., dynamic=True)) or raise "
        f"torch._dynamo.config.{limit_name}.",
        stacklevel=2,
    )


def observe(converted: bool) -> None:
    """Record the frame whose graph is being compiled (call from the backend) as one mxfx converted ops of when
    ``converted``, and start watching Dynamo's log for recompile-limit hits."""
    logging.getLogger(LOGGER).addFilter(_FILTER)  # once: a logger keeps one copy of a filter
    if _first_compile_since_reset():
        _converted.clear()
        _warned.clear()
    frame = _frame_id()
    if converted and frame is not None:
        _converted.add(frame)
