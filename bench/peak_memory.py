"""What is live at a step's peak of device memory, and where each live block was allocated.

:func:`record_peak` runs a function with the CUDA caching allocator's history on (``torch.cuda.memory``'s
``_record_memory_history`` / ``_snapshot``, as torch's "Understanding CUDA memory usage" guide uses them) and
returns the snapshot's trace. :func:`live_at_peak` replays a trace of allocator events: a block counts from its
``alloc`` until its ``free_requested`` (the allocator's "allocated" bytes; blocks allocated before the recording
and freed during it lower the count as they go), the peak is the largest count, and the blocks live then are grouped
by the line that allocated them: the innermost Python frame outside torch's own package (Inductor's generated
code of a compiled graph, an mxfx op body, model code), shown with its source line and, for generated code, the
``Source Nodes`` comment Inductor writes above a kernel's buffers (the FX nodes it computes).
:func:`peak_table` prints the sites as a Markdown table.

The replayed peak equals ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` at the start
(``tests/test_peak_memory.py`` checks both on a hand-built trace and, with a GPU, on a real one).
"""

from __future__ import annotations

import dataclasses
import linecache
import os
from collections import defaultdict
from typing import Callable, Iterable

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

_NODES_COMMENT = ("# Topologically Sorted Source Nodes:", "# Source Nodes:")
"""How Inductor's generated code names the FX nodes of the kernel whose buffers follow."""

_COMMENT_REACH = 40
"""Lines above an allocation searched for Inductor's source-nodes comment."""


@dataclasses.dataclass(frozen=True)
class Site:
    """Where blocks were allocated: ``file:line`` of the frame, its source line, the FX nodes named above it."""

    where: str
    code: str
    nodes: str


@dataclasses.dataclass
class Peak:
    """A replayed trace: the peak (bytes allocated, before-recording bytes included), what was allocated when the
    recording began, and the blocks allocated during it that are live at the peak, by :class:`Site`
    (``{site: [bytes, blocks]}``)."""

    peak: int
    baseline: int
    sites: dict[Site, list[int]]

    @property
    def recorded(self) -> int:
        """Bytes live at the peak that were allocated during the recording."""
        return sum(b for b, _ in self.sites.values())


def _source_nodes(filename: str, lineno: int) -> str:
    """The FX nodes of Inductor's nearest source-nodes comment above ``lineno`` (within :data:`_COMMENT_REACH`
    lines, and not past the ``def``), "" if none."""
    for n in range(lineno - 1, max(0, lineno - _COMMENT_REACH), -1):
        text = linecache.getline(filename, n).strip()
        for mark in _NODES_COMMENT:
            if text.startswith(mark):
                return text[len(mark) :].strip().split(", Original ATen:")[0]
        if text.startswith("def "):
            break
    return ""


def allocation_site(frames: Iterable[dict]) -> Site:
    """The :class:`Site` of a block from its allocation frames (innermost first, as the allocator records them):
    the first Python frame outside torch's package; the innermost frame if every one is torch's; "?" if none."""
    frames = [f for f in frames if f.get("filename", "").endswith(".py")]
    if not frames:
        return Site("?", "", "")
    frame = next((f for f in frames if not f["filename"].startswith(_TORCH_DIR)), frames[0])
    filename, line = frame["filename"], int(frame["line"])
    code = linecache.getline(filename, line).strip()
    return Site(f"{os.path.basename(filename)}:{line} ({frame.get('name', '?')})", code, _source_nodes(filename, line))


def live_at_peak(events: Iterable[dict], baseline: int) -> Peak:
    """Replay allocator trace ``events`` (dicts with ``action``, ``addr``, ``size``, ``frames``) from ``baseline``
    bytes allocated: the peak and the blocks live at it by site (module docstring)."""
    live: dict[int, tuple[int, tuple]] = {}
    current = peak = baseline
    at_peak: dict[int, tuple[int, tuple]] = {}
    for e in events:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = (e["size"], tuple(e.get("frames", ())))
            current += e["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_requested":
            live.pop(e["addr"], None)
            current -= e["size"]
    sites: dict[Site, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in at_peak.values():
        entry = sites[
            allocation_site({"filename": f["filename"], "line": f["line"], "name": f.get("name")} for f in frames)
        ]
        entry[0] += size
        entry[1] += 1
    return Peak(peak, baseline, dict(sites))


def record_peak(fn: Callable[[], object], max_entries: int = 1_000_000) -> tuple[Peak, int]:
    """Run ``fn()`` on the current CUDA device with the allocator's history recorded (Python stacks): the replayed
    :class:`Peak` and ``torch.cuda.max_memory_allocated()`` over the same run (equal when the history kept every
    event: ``max_entries`` bounds it)."""
    if not torch.cuda.is_available():
        raise RuntimeError("record_peak: replays the CUDA allocator's history; no CUDA device is available here")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    return live_at_peak(snapshot["device_traces"][device], baseline), torch.cuda.max_memory_allocated()


def peak_table(peak: Peak, top: int = 12) -> str:
    """The ``top`` sites by bytes live at the peak, as a Markdown table, under a line splitting the peak into what
    was held from before the run and what the run allocated, and saying how much of the latter the listed sites
    hold. Raises ValueError for ``top`` below 1."""
    if top < 1:
        raise ValueError(f"peak_table: top={top} must be at least 1 (the sites to list)")
    gib = 2.0**30
    rows = sorted(peak.sites.items(), key=lambda kv: -kv[1][0])
    listed = sum(size for _, (size, _) in rows[:top])
    from_before = peak.peak - peak.recorded  # what was held before the run and not yet freed at the peak
    head = (
        f"peak {peak.peak / gib:.2f} GiB = {from_before / gib:.2f} held from before the run (of "
        f"{peak.baseline / gib:.2f}) + {peak.recorded / gib:.2f} allocated in it and live at the peak; the sites "
        f"listed hold {listed / gib:.2f} of those {peak.recorded / gib:.2f}"
    )
    lines = [head, "", "| MiB | blocks | allocated at | code | FX nodes |", "|---:|---:|---|---|---|"]
    for site, (size, blocks) in rows[:top]:
        code = site.code.replace("|", "\\|")[:90]
        lines.append(f"| {size / 2**20:.1f} | {blocks} | {site.where} | `{code}` | {site.nodes[:80]} |")
    rest = rows[top:]
    if rest:
        lines.append(f"| {sum(s for _, (s, _) in rest) / 2**20:.1f} | {sum(b for _, (_, b) in rest)} | "
                     f"{len(rest)} other site{'s' if len(rest) > 1 else ''} | | |")  # fmt: skip
    return "\n".join(lines)
