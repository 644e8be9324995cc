"""Quantization statistics per quantize site: how well each low-precision operand represents the values it was
made from, sampled every N optimizer steps.

A **site** is one quantize of one op, named ``<module>/<op kind>/<direction>`` (e.g.
``layers.0.mlp.up/linear/forward_x``); directions: ``forward_x`` (the forward GEMM's input), ``forward_w`` (the
weight's forward form), ``dgrad_dy`` (the output gradient the dgrad GEMM reads), ``wgrad_x`` / ``wgrad_dy`` (the
token-blocked wgrad operands of a dense linear, or of routed experts per expert group), ``<role>_fwd`` /
``<role>_bwd`` (an expert-parallel all-to-all payload, role ``dispatch`` or ``combine``). ``docs/numerics.md``
explains each statistic.

Mechanism: the autograd ops call :func:`observe` where they made an operand. It calls the custom op
``mxfx::quant_stats``, registered with an ORDERED effect so that AOTAutograd and Inductor keep it although its
result is unused. Its body reads at run time whether this step is sampled (the global optimizer step count,
:func:`mxfx.runtime.cache.step_count`, a multiple of ``every``, and sampling not switched off by
:func:`set_sampling`), so sampling on or off never recompiles; a site samples once per sampled step (the first
microbatch under gradient accumulation). On a sampled step it asks the op's format (each
format registers its :meth:`mxfx.formats.base.Format.stats_vector` here, :func:`register_format`) for one float64
vector on the tensors' device and queues it: no host sync per call. On CUDA the format's fused statistics kernel
makes it where the format has one for the layout (one launch reading the values and the operand, and a finishing
launch); elsewhere, and where none covers the operand, the plain-torch reference: the format gives the values, their
dequantization, the saturated payload values and the scale exponents (:class:`Parts`, its
:meth:`~mxfx.formats.base.Format.quant_stats`) and :func:`reduce_parts` reduces them. The queue is read back (one sync)
at the next optimizer step (a step post-hook) or when :func:`table` is read.

Outputs: :func:`table` (``mxfx.stats()``), a JSONL log ``stats.jsonl`` and TensorBoard scalars (when
``torch.utils.tensorboard`` imports) under the dump dir (:func:`set_output`), a warning the first time a site's
underflow or clipped fraction exceeds :data:`WARN_ABOVE`, and :func:`summary` (a line of the precision report).
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch._library.effects import EffectType
from torch.optim.optimizer import register_optimizer_step_post_hook

from mxfx.runtime.cache import install as install_step_hook, step_count

LAYOUTS = ("rows", "tokens", "group_tokens", "weight")
"""How an operand lays out its source's values: ``rows`` blocked along the source's last dim (an A operand,
an all-to-all payload); ``tokens`` a dense linear's wgrad operand of a ``[M, K]`` source, blocked along the tokens
M (each format pads or tiles them as its wgrad GEMM reads them); ``group_tokens`` a grouped wgrad operand of a
``[S, K]`` source, blocked along the tokens of each expert group (``offs``: the int32 cumulative group ends; the
rows each format adds to pad a group, and the rows past the last group end, which no group reads, count nowhere);
``weight`` a weight's forward form (``[N, K]`` or ``[E, N, K]``)."""

COMBINES = ("", "swiglu", "route_weight")
"""How the values quantized are formed from ``source``: the one tensor as is (""), ``silu(gate) * up`` in fp32 of
``(gate, up)`` ("swiglu"), or rows ``dy [S, D]`` times ``route_weight [S]`` in fp32 ("route_weight")."""

WARN_ABOVE = 0.01
"""Underflow or clipped fraction above which a site warns (once per site and statistic). Saturation alone does not
warn: under rceil a block's amax rounds to the largest magnitude whenever it lies within a rounding step of it (a
sparse tensor's blocks hold few values besides their amax), and under fp8_block's amax rule every block's amax is
put there; clipped values are the ones a scale failed to represent."""

HIST_MIN, HIST_BINS = -128, 256
"""Scale-exponent histogram: integer exponents ``HIST_MIN .. HIST_MIN + HIST_BINS - 1`` (E8M0's -127..127 and an FP32
scale's -126..127 fit), one bin each."""

JSONL = "stats.jsonl"
"""File name of the sample log in the dump dir (``stats_rank<r>.jsonl`` for the ranks r > 0 of a process group)."""

FUSED_ENV = "MXFX_STATS_FUSED"
"""Environment variable: unset or 1/true/yes/on takes the formats' fused statistics kernels on CUDA where they cover a
site; 0/false/no/off makes every sample from the plain-torch reference (:func:`reduce_parts`), e.g. to cross-check
a sample (read at every sample, :func:`fused_enabled`)."""

_FIELDS = (
    "values",
    "nonzero",
    "underflow",
    "saturated",
    "clipped",
    "nonfinite",
    "err_sq",
    "ref_sq",
    "amax",
    "exp_min",
    "exp_max",
)


class Parts(NamedTuple):
    """What a format gives for one quantize (:meth:`mxfx.formats.base.Format.quant_stats`).

    Attributes:
        values: float32, the values quantized (padding zeros may be included: they count nowhere).
        dequantized: float32 of ``values``' shape, the operand's values as the GEMM reads them.
        saturated: bool of ``values``' shape, payload at the format's largest magnitude (E4M3: |qdata| == 448).
        exponents: int tensor, the integer scale exponent of every block whose values are finite and not all zero.
    """

    values: torch.Tensor
    dequantized: torch.Tensor
    saturated: torch.Tensor
    exponents: torch.Tensor


_formats: dict[str, Callable[..., torch.Tensor]] = {}


def register_format(name: str, stats_vector: Callable[..., torch.Tensor]) -> None:
    """Make ``stats_vector(source, combine, operand, rule, layout, offs) -> tensor`` answer for operands of format
    ``name`` (``offs``: the group ends of a ``group_tokens`` operand, else None): one sample, the float64 vector of
    :func:`reduce_parts`, on the operand's device.

    Raises:
        ValueError: ``name`` already registered.
    """
    if name in _formats:
        raise ValueError(f"mxfx.runtime.stats: format {name!r} already has a statistics function")
    _formats[name] = stats_vector


def fused_enabled() -> bool:
    """The :data:`FUSED_ENV` switch: True when unset or 1/true/yes/on, False for 0/false/no/off.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(FUSED_ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{FUSED_ENV}={value!r} is not a switch; set it to 0/false/no/off (plain-torch statistics) or "
        f"1/true/yes/on (fused kernels where they cover a site), or unset it"
    )


@dataclass
class Row:
    """One site of :func:`table`: its latest sample (a dict, :func:`reduce_parts`'s keys plus ``site``,
    ``format``, ``scale_rule``, ``step``) and running extremes over all its samples."""

    site: str
    format: str
    scale_rule: str
    samples: int = 0
    last: dict = field(default_factory=dict)
    max_underflow: float = 0.0
    max_saturation: float = 0.0
    max_clipped: float = 0.0
    max_rms_error: float = 0.0
    max_amax: float = 0.0
    exp_min: int | None = None
    exp_max: int | None = None


@dataclass
class Table:
    """:func:`table`'s answer: one :class:`Row` per site, sorted by site; ``str()`` is an aligned text table, or
    without rows why there are none (``empty``: statistics off, a ``modules`` glob matching no quantize site, or
    no sampled step yet)."""

    rows: list[Row]
    empty: str = ""

    def row(self, site: str) -> Row:
        """The row of ``site``.

        Raises:
            KeyError: no sample of that site, naming the sites there are.
        """
        for r in self.rows:
            if r.site == site:
                return r
        sites = ", ".join(r.site for r in self.rows) or f"none ({self.empty})"
        raise KeyError(f"mxfx.stats: no samples of site {site!r}; sites: {sites}")

    def __str__(self) -> str:
        if not self.rows:
            return f"# mxfx quantization stats: no samples: {self.empty or 'none taken yet'}\n"
        cols = [
            "site",
            "format",
            "step",
            "underflow",
            "saturation",
            "clipped",
            "scale exp",
            "rms error",
            "amax",
            "max underflow",
            "max clipped",
            "exp range",
            "max rms error",
            "samples",
        ]
        pct = lambda v: f"{v:.3%}"  # noqa: E731
        rng = lambda a, b: "-" if a is None else f"{a}..{b}"  # noqa: E731
        body = [
            [
                r.site,
                f"{r.format}/{r.scale_rule}",
                str(r.last["step"]),
                pct(r.last["underflow"]),
                pct(r.last["saturation"]),
                pct(r.last["clipped"]),
                rng(r.last["scale_exp_min"], r.last["scale_exp_max"]),
                f"{r.last['rms_error']:.3e}",
                f"{r.last['amax']:.4g}",
                pct(r.max_underflow),
                pct(r.max_clipped),
                rng(r.exp_min, r.exp_max),
                f"{r.max_rms_error:.3e}",
                str(r.samples),
            ]
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in [cols, *body]) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [cols, *body]]
        return "\n".join(["# mxfx quantization stats (latest sample, then extremes over all samples)", *lines]) + "\n"


@dataclass(eq=False)
class _State:
    lock: threading.RLock = field(default_factory=threading.RLock)
    sampling: bool = True  # set_sampling
    queue: list = field(default_factory=list)  # (site, format, rule, step, vector on its device)
    rows: dict = field(default_factory=dict)  # site -> Row
    warned: set = field(default_factory=set)  # (site, statistic) warned about
    taken: dict = field(default_factory=dict)  # site -> the step of its latest sample (one per site and step)
    ran: dict = field(default_factory=dict)  # site -> its every: the sites whose statistics op has run
    compiled: dict = field(default_factory=dict)  # modules glob -> [graphs compiled with it, their site prefixes]
    output: str | None = None  # dump dir: stats.jsonl and TensorBoard there
    writer: object = None  # TensorBoard SummaryWriter of ``output``, False where it cannot be made
    hook_handle: object = None


state = _State()


def sampled(every: int) -> bool:
    """Whether an op observing every ``every`` steps samples now (a host read: no sync, no guard)."""
    return state.sampling and step_count() % every == 0


def set_sampling(enabled: bool) -> bool:
    """Switch sampling on or off at run time for every site (compiled graphs keep their ops: no recompile); returns
    the previous setting.

    Raises:
        TypeError: ``enabled`` not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"mxfx.runtime.stats.set_sampling: enabled={enabled!r} must be True or False")
    with state.lock:
        previous, state.sampling = state.sampling, enabled
    return previous


def set_output(dump_dir: str | os.PathLike | None) -> None:
    """Write every sample from now on to ``<dump_dir>/stats.jsonl`` and, where ``torch.utils.tensorboard``
    imports, as TensorBoard scalars under ``<dump_dir>/tensorboard`` (``stats_rank<r>.jsonl``, ``tensorboard_rank<r>``
    on the ranks r > 0 of a process group); None: neither. The backend calls it with the
    policy's ``dump_dir`` when it compiles a graph with statistics on."""
    with state.lock:
        new = None if dump_dir is None else os.fspath(dump_dir)
        if new != state.output:
            _close_writer()
            state.output = new


def reduce_parts(parts: Parts) -> torch.Tensor:
    """One sample as a float64 vector on the tensors' device: the counts and sums of :data:`_FIELDS`, then the
    :data:`HIST_BINS` exponent histogram. Counts are exact (below 2^53); values whose own value or whose block
    is not finite are left out of every statistic and counted as ``nonfinite``. ``clipped``: saturated values
    whose magnitude was above the largest the block's scale represents (the clamp cut them; under rceil none)."""
    x, dq = parts.values.float(), parts.dequantized.float()
    ok = torch.isfinite(x) & torch.isfinite(dq)
    x, dq = x.masked_fill(~ok, 0.0), dq.masked_fill(~ok, 0.0)
    # dq - x is exact in fp32 (a quantized value is within a factor 2 of its value, or 0); squares and sums in fp64
    diff = dq - x
    nonzero = x != 0
    saturated = ok & parts.saturated
    e = parts.exponents.reshape(-1).to(torch.int64)
    hist = torch.bincount((e - HIST_MIN).clamp(0, HIST_BINS - 1), minlength=HIST_BINS)[:HIST_BINS]
    big = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    n_ok = torch.count_nonzero(ok)
    counts = torch.stack(
        [
            n_ok,
            torch.count_nonzero(nonzero),
            torch.count_nonzero(nonzero & (dq == 0)),
            torch.count_nonzero(saturated),
            torch.count_nonzero(saturated & (x.abs() > dq.abs())),
            x.numel() - n_ok,
        ]
    ).double()
    d64, x64 = diff.reshape(-1).double(), x.reshape(-1).double()
    sums = torch.stack(
        [
            torch.dot(d64, d64),
            torch.dot(x64, x64),
            torch.cat([x.abs().reshape(-1), x.new_zeros(1)]).amax().double(),  # 0 when empty
            e.min().double() if e.numel() else big,
            e.max().double() if e.numel() else -big,
        ]
    )
    return torch.cat([counts, sums, hist.double()])


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _sample(vector: list[float], site: str, fmt: str, rule: str, step: int) -> dict:
    v = dict(zip(_FIELDS, vector))
    hist = vector[len(_FIELDS) :]
    values, nonzero = int(v["values"]), int(v["nonzero"])
    return {
        "site": site,
        "format": fmt,
        "scale_rule": rule,
        "step": step,
        "rank": _rank(),
        "values": values,
        "nonzero": nonzero,
        "underflow_count": int(v["underflow"]),
        "saturated_count": int(v["saturated"]),
        "clipped_count": int(v["clipped"]),
        "nonfinite": int(v["nonfinite"]),
        "underflow": v["underflow"] / nonzero if nonzero else 0.0,
        "saturation": v["saturated"] / values if values else 0.0,
        "clipped": v["clipped"] / values if values else 0.0,
        "rms_error": math.sqrt(v["err_sq"] / v["ref_sq"]) if v["ref_sq"] else 0.0,
        "amax": v["amax"],
        "scale_exp_min": int(v["exp_min"]) if math.isfinite(v["exp_min"]) else None,
        "scale_exp_max": int(v["exp_max"]) if math.isfinite(v["exp_max"]) else None,
        "scale_exp_hist": {str(HIST_MIN + i): int(c) for i, c in enumerate(hist) if c},
    }


@torch.library.custom_op("mxfx::quant_stats", mutates_args=())
def _quant_stats(
    source: list[torch.Tensor],
    combine: str,
    operand: list[torch.Tensor | None],
    format: str,
    rule: str,
    layout: str,
    site: str,
    every: int,
    offs: torch.Tensor | None,
) -> torch.Tensor:
    """Queue one sample of ``site`` when this step is sampled (:func:`sampled`) and the site has none of this step yet
    (the first microbatch's, under gradient accumulation); returns an empty tensor. Everything a sample needs
    beyond the tensors the op made anyway (padding maps, decodes) is computed here, on sampled steps only."""
    step = step_count()
    state.ran[site] = every
    if sampled(every) and state.taken.get(site) != step:
        state.taken[site] = step
        with torch.no_grad():
            vector = _formats[format](source, combine, operand, rule, layout, offs)
        with state.lock:
            state.queue.append((site, format, rule, step, vector))
            if state.hook_handle is None:
                install()
    return source[0].new_empty(0)


@_quant_stats.register_fake
def _(source, combine, operand, format, rule, layout, site, every, offs):
    return source[0].new_empty(0)


_quant_stats.register_effect(EffectType.ORDERED)  # kept and ordered in compiled graphs though its result is unused


def observe(
    site: str,
    fmt: str,
    rule: str,
    layout: str,
    source,
    operand,
    every: int,
    combine: str = "",
    offs: torch.Tensor | None = None,
) -> None:
    """Sample quantize site ``site`` every ``every`` optimizer steps: ``operand`` (a tuple of tensors or None, as
    format ``fmt`` made it with scale rule ``rule``) against the values it was made from (``source`` as
    ``combine`` forms them, see :data:`COMBINES`), laid out per ``layout`` (:data:`LAYOUTS`; ``offs``, the int32
    group ends, with ``group_tokens`` only). Call it where the operand is made, in eager code or under tracing (a
    graph op whose body decides at run time).

    Raises:
        ValueError: an unknown layout, combine, format, an ``every`` below 1, or ``offs`` given without
            ``group_tokens`` or missing with it, naming the site.
    """
    if (
        layout not in LAYOUTS
        or combine not in COMBINES
        or fmt not in _formats
        or not isinstance(every, int)
        or every < 1
    ):
        raise ValueError(
            f"mxfx.runtime.stats.observe({site!r}): layout={layout!r} (one of {LAYOUTS}), combine={combine!r} "
            f"(one of {COMBINES}), format={fmt!r} (one of {tuple(_formats)}), every={every!r} (an int >= 1)"
        )
    if (layout == "group_tokens") != isinstance(offs, torch.Tensor):
        raise ValueError(
            f"mxfx.runtime.stats.observe({site!r}): layout={layout!r} with offs={type(offs).__name__}; "
            f"the group ends (an int32 tensor) go with layout='group_tokens' and with no other layout"
        )
    torch.ops.mxfx.quant_stats(list(source), combine, list(operand), fmt, str(rule), layout, site, every, offs)


def flush() -> int:
    """Read the queued samples back (one host sync per device), update :func:`table`'s rows, write the outputs and
    warn about sites over :data:`WARN_ABOVE`; returns how many samples were read."""
    with state.lock:
        queue, state.queue = state.queue, []
    if not queue:
        return 0
    by_device: dict = {}
    for i, item in enumerate(queue):
        by_device.setdefault(item[4].device, []).append(i)
    vectors: list = [None] * len(queue)
    for idx in by_device.values():
        host = torch.stack([queue[i][4] for i in idx]).cpu().tolist()
        for i, v in zip(idx, host):
            vectors[i] = v
    samples = [_sample(v, site, fmt, rule, step) for (site, fmt, rule, step, _), v in zip(queue, vectors)]
    with state.lock:
        for s in samples:
            _update(s)
        _write(samples)
    for s in samples:
        _warn(s)
    return len(samples)


def _update(s: dict) -> None:
    row = state.rows.get(s["site"])
    if row is None:
        row = state.rows[s["site"]] = Row(s["site"], s["format"], s["scale_rule"])
    row.samples += 1
    row.last = s
    row.format, row.scale_rule = s["format"], s["scale_rule"]
    row.max_underflow = max(row.max_underflow, s["underflow"])
    row.max_saturation = max(row.max_saturation, s["saturation"])
    row.max_clipped = max(row.max_clipped, s["clipped"])
    row.max_rms_error = max(row.max_rms_error, s["rms_error"])
    row.max_amax = max(row.max_amax, s["amax"])
    if s["scale_exp_min"] is not None:
        row.exp_min = s["scale_exp_min"] if row.exp_min is None else min(row.exp_min, s["scale_exp_min"])
        row.exp_max = s["scale_exp_max"] if row.exp_max is None else max(row.exp_max, s["scale_exp_max"])


def _tensorboard_writer(log_dir: str):
    """A TensorBoard ``SummaryWriter`` writing to ``log_dir``, or None where ``torch.utils.tensorboard`` does not
    import (it needs the ``tensorboard`` package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency
    except ImportError:
        return None
    return SummaryWriter(log_dir=log_dir)


def _close_writer() -> None:
    if state.writer:
        state.writer.close()
    state.writer = None


def _write(samples: list[dict]) -> None:
    if state.output is None:
        return
    os.makedirs(state.output, exist_ok=True)
    rank = _rank()
    name = JSONL if rank == 0 else JSONL.replace(".jsonl", f"_rank{rank}.jsonl")
    with open(os.path.join(state.output, name), "a") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    if state.writer is None:
        state.writer = (
            _tensorboard_writer(os.path.join(state.output, "tensorboard" + (f"_rank{rank}" if rank else ""))) or False
        )
    if state.writer:
        for s in samples:
            for key in ("underflow", "saturation", "rms_error", "amax", "scale_exp_min", "scale_exp_max"):
                if s[key] is not None:
                    state.writer.add_scalar(f"mxfx_stats/{s['site']}/{key}", s[key], s["step"])
        state.writer.flush()


def _warn(s: dict) -> None:
    for stat, what in (
        ("underflow", "of its nonzero values flush to zero"),
        ("clipped", "of its values were above the largest magnitude their block's scale represents"),
    ):
        key = (s["site"], stat)
        if s[stat] > WARN_ABOVE and key not in state.warned:
            state.warned.add(key)
            warnings.warn(
                f"mxfx: quantize site {s['site']} ({s['format']}, scale_rule={s['scale_rule']}): {stat} "
                f"{s[stat]:.2%} at step {s['step']} ({what}; above {WARN_ABOVE:.0%}); docs/numerics.md says "
                f"what to look at",
                stacklevel=3,
            )


def note_compiled(modules: str, prefixes) -> None:
    """Record a graph compiled with statistics on under the ``modules`` glob of its policy's ``stats``, its ops
    carrying the site prefixes ``prefixes`` (none: the glob matched no quantize site of it), for :func:`table`'s
    answer when there are no samples."""
    with state.lock:
        graphs = state.compiled.setdefault(modules, [0, set()])
        graphs[0] += 1
        graphs[1].update(prefixes)


def _why_empty() -> str:
    """Why :func:`table` has no rows: statistics off, a ``modules`` glob that matched no quantize site of the
    graphs compiled with it, sampling switched off, or no sampled step run yet."""
    if state.ran or any(prefixes for _, prefixes in state.compiled.values()):
        if not state.sampling:
            return "sampling is switched off (mxfx.runtime.stats.set_sampling(False))"
        every = sorted(set(state.ran.values()))
        when = f"on optimizer steps that are multiples of {', '.join(map(str, every))}, " if every else ""
        return (
            f"no sampled step has run yet: {len(state.ran)} site(s) ran, which sample {when}the first microbatch "
            f"of the step (the step count is now {step_count()})"
        )
    if state.compiled:
        globs = ", ".join(f"modules={glob!r} ({graphs} graph(s))" for glob, (graphs, _) in state.compiled.items())
        return (
            f"statistics are on, but their module glob matches no quantize site of the graphs compiled with it: "
            f"{globs}; point it at modules with converted ops (the precision map names them)"
        )
    return (
        "statistics are off (Policy(stats={'every': 100, 'modules': '*'}) turns them on, as does MXFX_STATS=1 "
        "for a policy that leaves stats out)"
    )


def table() -> Table:
    """The statistics so far, one :class:`Row` per site (queued samples are read first, :func:`flush`); without
    rows, :attr:`Table.empty` says why."""
    flush()
    with state.lock:
        return Table([state.rows[k] for k in sorted(state.rows)], "" if state.rows else _why_empty())


def reset() -> None:
    """Forget every sample, queued or read, the warnings given (each site warns again) and which sites ran (the
    graphs compiled with statistics on are still known)."""
    with state.lock:
        state.queue.clear()
        state.rows.clear()
        state.warned.clear()
        state.taken.clear()
        state.ran.clear()


def summary(prefixes=None) -> str:
    """One line on the sites of the modules ``prefixes`` name (site prefixes as ops carry them, ``<module>`` or
    ``<module>/all_to_all/<role>``; all sites when None): how many exceed :data:`WARN_ABOVE` underflow or
    clipped values at their worst sample, naming them."""
    rows = table().rows
    if prefixes is not None:
        modules = {p.split("/")[0] for p in prefixes}
        rows = [r for r in rows if r.site.split("/")[0] in modules]
    if not rows:
        return "quantization stats: no sample yet"
    parts = []
    for stat, attr in (("underflow", "max_underflow"), ("clipped", "max_clipped")):
        over = sorted((r for r in rows if getattr(r, attr) > WARN_ABOVE), key=lambda r: -getattr(r, attr))
        if over:
            names = ", ".join(f"{r.site} {getattr(r, attr):.1%}" for r in over[:3]) + (", ..." if len(over) > 3 else "")
            parts.append(f"{len(over)} site{'s' if len(over) > 1 else ''} {stat} > {WARN_ABOVE:.0%}: {names}")
    if not parts:
        return f"quantization stats: {len(rows)} sites, none with underflow or clipped > {WARN_ABOVE:.0%}"
    return f"quantization stats ({len(rows)} sites, worst sample): " + "; ".join(parts)


def _step_post_hook(optimizer, args, kwargs) -> None:
    flush()


_step_post_hook = torch.compiler.disable(_step_post_hook, recursive=True)


def install() -> None:
    """Read the queue back at every optimizer step (a global step post-hook; idempotent), and make the optimizer
    steps advance the step count (the weight cache's hook, :func:`mxfx.runtime.cache.install`: ops called outside
    the backend too). Called at the first sample."""
    with state.lock:
        if state.hook_handle is None:
            install_step_hook()
            state.hook_handle = register_optimizer_step_post_hook(_step_post_hook)
