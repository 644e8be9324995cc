"""The graph breaks Dynamo recorded, as mxfx's warnings name them: the reason's first line and the line of user code
where it broke (:func:`new`, from ``torch._dynamo.graph_break_reasons``, where Dynamo keeps the reason of each
break it compiled a graph at).

A break is what leaves code outside every compiled graph, so its GEMMs never reach mxfx: the warning about weights
no compiled graph read (:mod:`mxfx.diagnostics.coverage`) names the breaks behind them. One break has a setting of its
own: a
side effect inside an activation-checkpointed region (:data:`CHECKPOINT_SETTING`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CHECKPOINT_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
CHECKPOINT_SETTING = f"torch._dynamo.config.{_CHECKPOINT_FLAG}"
"""The Dynamo setting that keeps an activation-checkpointed region with a side effect in its forward in the graph
(transformers' layers set a context variable there): the side effect is then not run again when the backward
recomputes the region."""
SIDE_EFFECT = "HOP: Unsafe side effect"
"""The first line of Dynamo's reason for a break by a side effect inside a higher-order op's region (activation
checkpointing is one)."""

_read = [None, 0]  # torch._dynamo.graph_break_reasons when last read: its first entry (held: not reused) and length


@dataclass(frozen=True)
class GraphBreak:
    """One graph break: the first line of Dynamo's reason and ``where`` (``file:line``, the innermost frame of user
    code Dynamo gives)."""

    reason: str
    where: str

    @property
    def in_checkpoint(self) -> bool:
        """Whether it is a side effect inside a higher-order op's region while :data:`CHECKPOINT_SETTING` is off (the
        setting keeps it in the graph when the region is activation checkpointing)."""
        return self.reason == SIDE_EFFECT and not getattr(torch._dynamo.config, _CHECKPOINT_FLAG, False)

    def __str__(self) -> str:
        return f"{self.reason!r} at {self.where}"


def new() -> list[GraphBreak]:
    """The graph breaks Dynamo recorded since the last call, each once (all it holds after ``torch._dynamo.reset()``
    emptied its list)."""
    reasons = torch._dynamo.graph_break_reasons
    first, length = _read
    start = length if reasons and reasons[0] is first and len(reasons) >= length else 0
    _read[:] = [reasons[0] if reasons else None, len(reasons)]
    out = []
    for r in reasons[start:]:
        frame = r.user_stack[-1] if r.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        found = GraphBreak((str(r.reason).splitlines() or [""])[0], where)
        if found not in out:
            out.append(found)
    return out
