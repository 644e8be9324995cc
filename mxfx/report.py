"""Inspection: the per-graph precision map and the before/after dumps.

One :class:`OpRecord` per op a pass matched, rewritten or skipped, with the
module name, op kind, shapes, the precision of forward/dgrad/wgrad and saved
tensors, and why it was skipped. ``mxfx.last_report()`` returns the map of the
most recently compiled graph; ``options={"dump_dir": PATH}`` (or the
``MXFX_DUMP_DIR`` environment variable) writes, per compiled graph,
``graph_NNN/before.py``, ``after.py`` and ``precision.txt`` (NNN: the graph's number, :func:`register`).
:func:`saved_for_backward` lists what an autograd graph holds for its backward (the activation memory the
``save`` settings decide).
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import json
import os
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from mxfx import formats
from mxfx.runtime import stats

_graph_ids = itertools.count()
_reports: list["PrecisionMap"] = []


LOW_PRECISIONS = formats.NAMES
"""Precision-map entries of a rewritten op: the registered formats' names (:mod:`mxfx.formats`)."""
NONE = "-"
"""Precision-map entry of a part that does not run: no such GEMM, no backward, nothing saved."""
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def precision_of(dtype: torch.dtype) -> str:
    """The precision-map name of a dtype a part runs in: "fp32", "bf16", "fp16" (others as torch names them)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def kept_in(records) -> str:
    """The dtypes the ``forward`` columns of ``records`` (ops kept as written) name, upper case and "/"-joined, as
    a warning says them ("BF16", "FP32", "BF16/FP32")."""
    return (
        "/".join(sorted({r.forward.upper() for r in records if r.forward not in LOW_PRECISIONS + (NONE,)}))
        or "high precision"
    )


@dataclass
class OpRecord:
    """One matched op. Precisions are a format of :data:`LOW_PRECISIONS` ("mxfp8", "fp8_block"; "+"-joined when
    an op covers weights of both, as a weight_refresh can), the dtype a high-precision part runs in, from the
    graph's own dtypes (:func:`precision_of`: "bf16", "fp32"), or "-" (:data:`NONE`: that part does not run: no such
    GEMM or tensor, no backward under ``torch.no_grad()`` or in an inference graph, nothing saved for a frozen
    weight)."""

    node: str
    kind: str
    module: str
    shapes: str
    forward: str
    dgrad: str
    wgrad: str
    saved: str
    scale_rule: str | None  # None: the op's format has no scales (shown as NONE)
    reason: str = ""
    saved_bytes: tuple[int, int] = (
        0,
        0,
    )  # nominal bytes of the saved input: (as the op as written saves it, as chosen)
    macs: int | None = None  # a converted GEMM's forward multiply-accumulates at the example shapes (size hints of
    # dynamic dims, as the policy's min_size judges them); None: not a converted GEMM, or a data-dependent size

    def __post_init__(self):
        self.scale_rule = NONE if self.scale_rule is None else str(self.scale_rule)  # a ScaleRule prints as its value

    @property
    def rewritten(self) -> bool:
        """Whether a column names a low-precision format (a "+"-joined pair, "fp8_block+mxfp8", counts)."""
        return any(
            f in LOW_PRECISIONS for p in (self.forward, self.dgrad, self.wgrad, self.saved) for f in p.split("+")
        )

    def add_note(self, note: str) -> None:
        """Append ``note`` to ``reason`` (``"; "``-separated): what a later pass did to this op."""
        self.reason = "; ".join(r for r in (self.reason, note) if r)


@dataclass
class PrecisionMap:
    """Everything the passes decided for one compiled graph."""

    graph_id: int | None = None  # numbered by register(), once its graph has compiled
    records: list[OpRecord] = field(default_factory=list)
    stats_sites: list[str] = field(default_factory=list)  # statistics site prefixes of the graph's ops (Policy.stats)
    nodes: int = 0  # nodes of the graph and its subgraphs as Dynamo traced them, before the passes
    kernels: str = ""  # how the graph's mxfx kernels are launched, and why ("": not chosen, a CPU graph)
    steps: dict[str, tuple[float, int]] = field(default_factory=dict)
    """What rewriting the graph cost, per step (each pass by its module's name, then "example values" and
    "lint + recompile"), summed over the graph and its subgraphs: ``(seconds, nodes added)``, negative where the
    step removed nodes (``bench/compile_time.py --passes-only`` prints it)."""

    def add(self, record: OpRecord) -> None:
        """Append ``record`` and bump ``torch._dynamo.utils.counters["mxfx"]["<kind>_rewritten|skipped"]``."""
        self.records.append(record)
        counters["mxfx"][f"{record.kind}_{'rewritten' if record.rewritten else 'skipped'}"] += 1

    def note_step(self, step: str, seconds: float, added: int) -> None:
        """Add ``seconds`` and ``added`` nodes to :attr:`steps` ``[step]``."""
        was_s, was_n = self.steps.get(step, (0.0, 0))
        self.steps[step] = (was_s + seconds, was_n + added)

    def find(self, node: str, kinds: tuple = ("linear", "grouped_mm")) -> OpRecord | None:
        """The record of the GEMM op named ``node`` (None if absent)."""
        return next((r for r in self.records if r.node == node and r.kind in kinds), None)

    def mark_inference(self) -> None:
        """The graph was traced with grad disabled: its ops run forward only, save nothing and have no backward, so
        dgrad/wgrad/saved read "-" for every op, converted or kept as written, and no saved bytes are claimed. A
        weight_refresh record (an optimizer step, traced without grad) is left as it is: its columns name the
        cache forms it rebuilds, not a backward; so is a record that names no op that ran (all "-")."""
        for r in self.records:
            if r.kind != "weight_refresh" and (r.forward, r.dgrad, r.wgrad, r.saved) != (NONE,) * 4:
                r.dgrad = r.wgrad = r.saved = NONE
                r.saved_bytes = (0, 0)
                r.add_note("inference graph (grad disabled): forward only")

    def saved_bytes(self) -> tuple[int, int]:
        """Nominal bytes of converted ops' saved inputs: (all as the ops as written save them, as chosen)."""
        return sum(r.saved_bytes[0] for r in self.records), sum(r.saved_bytes[1] for r in self.records)

    def count(self, kind: str | None = None, rewritten: bool | None = None) -> int:
        """Number of records of ``kind`` (any if None) that were (or were not) rewritten (either if None)."""
        return sum(
            1
            for r in self.records
            if (kind is None or r.kind == kind) and (rewritten is None or r.rewritten == rewritten)
        )

    def summary(self) -> str:
        """One line: rewritten/kept counts per op kind and nominal saved-input bytes before/after packing."""
        kinds = sorted({r.kind for r in self.records})
        parts = [f"{k}: {self.count(k, True)} {self.formats(k)} / {self.count(k, False)} kept" for k in kinds]
        text = f"graph {self.graph_id}: " + ("; ".join(parts) if parts else "no matching ops")
        if self.kernels:
            text += f"; kernels {self.kernels}"
        before, after = self.saved_bytes()
        if before:
            change = f"{1 - after / before:.1%} less" if after <= before else f"{after / before - 1:.1%} more"
            text += f"; saved inputs of converted ops {before} B as written -> {after} B ({change}, nominal)"
        return text

    def formats(self, kind: str) -> str:
        """The low-precision formats the rewritten ops of ``kind`` run in, "+"-joined ("rewritten" when none)."""
        found = {
            f
            for r in self.records
            if r.kind == kind
            for p in (r.forward, r.dgrad)
            for f in p.split("+")
            if f in LOW_PRECISIONS
        }
        return "+".join(sorted(found)) or "rewritten"

    def __str__(self) -> str:
        """``print(report)`` shows :meth:`to_text`'s table."""
        return self.to_text()

    def stats_summary(self) -> str:
        """One line on the quantization statistics of this graph's sites so far (:func:`mxfx.runtime.stats.summary`:
        the sites over 1% underflow or clipped); "" when the graph has none (``Policy.stats`` off)."""
        return stats.summary(self.stats_sites) if self.stats_sites else ""

    def to_text(self) -> str:
        """The map as an aligned text table, one line per record (written as ``precision.txt``), after a header
        line and, with statistics on, a line of :meth:`stats_summary`."""
        cols = ["node", "kind", "module", "shapes", "forward", "dgrad", "wgrad", "saved", "scale_rule", "reason"]
        rows = [cols] + [[str(getattr(r, c)) for c in cols] for r in self.records]
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        head = [f"# mxfx precision map, {self.summary()}"] + ([f"# {self.stats_summary()}"] if self.stats_sites else [])
        return "\n".join([*head, *lines]) + "\n"

    def to_html(self) -> str:
        """The precision map as an HTML table, cells coloured by precision (for people who would rather look)."""
        colours = {
            **{n: formats.get(n).colour for n in formats.NAMES},
            "bf16": "#f7d794",
            "fp32": "#9cc3f5",
            NONE: "#eeeeee",
        }
        cols = ["kind", "module", "shapes", "forward", "dgrad", "wgrad", "saved", "scale_rule", "reason"]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        rows = []
        for r in self.records:
            cells = []
            for c in cols:
                v = str(getattr(r, c))
                style = f' style="background:{colours[v]}"' if v in colours else ""
                cells.append(f"<td{style}>{html.escape(v)}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        legend = " ".join(f'<span style="background:{c};padding:2px 6px">{k}</span>' for k, c in colours.items())
        return (
            "<!doctype html><meta charset=utf-8><title>mxfx precision map</title>"
            "<style>body{font:13px sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #bbb;padding:2px 6px}</style>"
            f"<h3>{html.escape(self.summary())}</h3><p>{legend}</p><table><tr>{head}</tr>{''.join(rows)}</table>\n"
        )

    def to_json(self) -> str:
        """The map as one JSON object (written as ``precision.json``): ``graph_id``, ``summary`` (the text table's
        header line), ``kernels`` (how the graph's kernels are launched and why, "" on CPU), ``steps`` (pass ->
        [seconds, nodes added]) and ``records`` (one object per record)."""
        return json.dumps(
            {
                "graph_id": self.graph_id,
                "summary": self.summary(),
                "kernels": self.kernels,
                "steps": self.steps,
                "records": [dataclasses.asdict(r) for r in self.records],
            },
            indent=1,
        )


def register(pm: PrecisionMap) -> None:
    """Number ``pm``'s graph (the next in this process) and keep ``pm`` for :func:`last_report` /
    :func:`all_reports`."""
    pm.graph_id = next(_graph_ids)
    _reports.append(pm)


def last_report() -> PrecisionMap | None:
    """The precision map of the most recently compiled graph (None before any)."""
    return _reports[-1] if _reports else None


def all_reports() -> list[PrecisionMap]:
    """Precision maps of every graph compiled in this process, oldest first."""
    return list(_reports)


def reset_reports() -> None:
    """Forget every precision map kept so far: :func:`last_report` is None and :func:`all_reports` empty until the
    next graph compiles (say, after ``torch._dynamo.reset()`` before another model). Graph numbers keep counting."""
    _reports.clear()


def write_dump(dump_dir: str, pm: PrecisionMap, before: str, after: str) -> str:
    """Write before/after graph code and the precision map; returns the graph's folder."""
    folder = os.path.join(dump_dir, f"graph_{pm.graph_id:03d}")
    os.makedirs(folder, exist_ok=True)
    for name, text in (
        ("before.py", before),
        ("after.py", after),
        ("precision.txt", pm.to_text()),
        ("precision.json", pm.to_json()),
        ("precision.html", pm.to_html()),
    ):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return folder


def saved_for_backward(out: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the autograd graph behind ``out`` saved for its backward (compiled graphs included), one per
    storage: call it after the forward, before the backward. Their storages' ``nbytes()`` sum to the memory the
    backward keeps alive, inputs, parameters and weight caches included (they are saved too)."""
    found, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for t in getattr(node, "saved_tensors", ()):
            if isinstance(t, torch.Tensor):
                found.setdefault(t.untyped_storage().data_ptr(), t)
        stack.extend(f for f, _ in node.next_functions)
    return list(found.values())
