"""The ``"mxfp8"`` torch.compile backend: rewrite the Dynamo graph, then hand it to the inner compiler.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="mxfp8", options={...})`` works without importing
mxfx first. ``options`` is a :class:`mxfx.Policy` or a dict of its fields.
``torch.compile(..., mode=...)`` (torch takes mode or options, not both) reaches the
inner Inductor as that mode's settings, less CUDA graphs (:func:`inductor_mode_options`).
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
import torch.fx as fx
from torch._dynamo.exc import RestartAnalysis

from mxfx import cache_key, names, passes, post_grad, report, variants
from mxfx.diagnostics import coverage, recompiles, rule_check
from mxfx.runtime import cache, stats
from mxfx import formats
from mxfx import device as devices
from mxfx.kernels.common import launch
from mxfx.passes import weight_refresh, wgrad_accumulation
from mxfx.fx import (
    PREFIX_META,
    all_graphs,
    example_value,
    fill_example_values,
    parameter_placeholders,
    record_prefixes,
    stats_sites,
)
from mxfx.policy import Policy, launch_cost

log = logging.getLogger("mxfx")
_warned_float16 = False  # the float16 warning is given once per process


def _warn_float16_once(gm: fx.GraphModule, pm: report.PrecisionMap) -> None:
    """Warn, on the first graph with MX ops and float16 tensors, that BF16 autocast is the supported precision.

    An MX value can exceed float16's largest finite value: 65504 rounds to 2^8 x 256 = 65536
    under rceil, which is inf in float16, where eager gives 65504 (floor rounds it down, to 57344).
    """
    global _warned_float16
    if _warned_float16 or not pm.count(rewritten=True):
        return
    values = (example_value(n) for g in all_graphs(gm) for n in g.graph.nodes)
    if any(v is not None and v.dtype == torch.float16 for v in values):
        _warned_float16 = True
        warnings.warn(
            "mxfx: this graph computes in float16; MXFP8 values near float16's top (65504 rounds to 65536 under "
            "rceil) overflow to inf where eager does not. The supported precision is bf16 autocast "
            "(torch.autocast(device, torch.bfloat16)) over FP32 parameters.",
            stacklevel=3,
        )


def inductor_mode_options(mode: str | None) -> dict:
    """Inductor settings of a ``torch.compile`` mode for the inner compiler, without CUDA graphs.

    The weight caches are looked up, and their freshness checked against the weight's version
    counter, by host code inside the graph; a CUDA graph replay skips host code and would keep
    using the caches of the step it was recorded in. So ``"reduce-overhead"`` and the CUDA
    graphs of ``"max-autotune"`` are turned off, with a warning.

    Raises:
        RuntimeError: an unknown mode (Inductor's own message).
    """
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode))
    if opts.pop("triton.cudagraphs", False):
        warnings.warn(
            f"mxfx: torch.compile mode={mode!r} asks for CUDA graphs; the mxfp8 backend turns them off, since a graph "
            f"replay would skip the weight-cache freshness checks. Its other settings apply: {opts or 'none'}",
            stacklevel=3,
        )
    return opts


CACHE_SAFE_INDUCTOR = {"allow_buffer_reuse": False, "inplace_buffers": False}
"""Inductor settings of every graph that calls mxfx: no buffer reuse, no in-place reuse of a kernel's input.

The weight-cache ops (``mxfx::cached_weight_*``) return the caches themselves, tensors that outlive the
graph. Inductor treats an op's outputs as buffers it owns and, once they are dead, writes later buffers of
the same size into them (seen on CUDA with torch 2.11: an expert weight's ``[64, 16, 8]`` fp32 scale grid
became an RMSNorm's ``[4, 2048, 1]`` buffer, and every later forward read those values as scales). Freed
buffers still go back to the CUDA caching allocator, which hands the same blocks out again, so the memory
held is about the same."""


def inductor_patches(gm: fx.GraphModule, mode: str | None = None) -> dict:
    """Inductor config patches for the inner compile of rewritten graph ``gm``: the ``mode``'s settings
    (:func:`inductor_mode_options`), then, where ``gm`` calls mxfx, :data:`CACHE_SAFE_INDUCTOR`, the cache
    keys of :func:`mxfx.cache_key.config_patches` and mxfx's post-grad rewrites (:mod:`mxfx.post_grad`)."""
    keys = cache_key.config_patches(gm)
    mxfx_graph = {**CACHE_SAFE_INDUCTOR, **post_grad.config_patch()} if keys else {}
    return {**inductor_mode_options(mode), **mxfx_graph, **keys}


def _inner_compile(inner, gm: fx.GraphModule, example_inputs, mode: str | None = None):
    if mode not in (None, "default") and inner != "inductor":
        warnings.warn(
            f"mxfx: torch.compile mode={mode!r} applies to the inner Inductor only; inner={inner!r} ignores it",
            stacklevel=3,
        )
    if callable(inner):
        return inner(gm, example_inputs)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        threads = launch.compile_threads()  # checked on every device: a typo shows on a CPU rehearsal too
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if device is None:
            return compile_fx(gm, example_inputs, config_patches=inductor_patches(gm, mode))
        from mxfx.kernels.common import compile_ahead  # imports Triton: only for a CUDA graph

        launch.key_kernels_as_inductor(device)  # the ops' own kernels found again by a warm process (see there)
        with compile_ahead.during(device, threads):  # their compiles start while the graph compiles
            return compile_fx(gm, example_inputs, config_patches=inductor_patches(gm, mode))
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return gm.forward  # "eager": the rewritten ops are autograd functions and run as they are


def _kernel_launch(policy: Policy, pm: report.PrecisionMap, example_inputs) -> str:
    """How the rewritten graph's mxfx kernels are launched: the policy's ``kernels``, else the
    ``MXFX_OPAQUE_KERNELS`` switch, else "auto", which :func:`mxfx.policy.launch_cost.choose` settles from the
    graph's converted GEMMs. On CUDA the choice and its reason go in the precision map's header."""
    switch = None if policy.kernels else launch.env_switch(launch.OPAQUE_ENV, None)  # read only where it decides
    mode = policy.kernels or {True: "opaque", False: "inductor", None: "auto"}[switch]
    why = f"policy kernels={mode!r}" if policy.kernels else f"{launch.OPAQUE_ENV}={int(bool(switch))}"
    if mode == "auto":
        gemms = [r.macs for r in pm.records if r.kind in ("linear", "router", "grouped_mm") and r.rewritten]
        mode, why = launch_cost.choose(gemms)
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        pm.kernels = f"{mode} ({why})"
    return mode


def trace_artifact(name: str, payload_fn, encoding: str = "string") -> None:
    """Emit ``payload_fn()`` as a structured trace artifact ``name`` of the graph being compiled.

    With ``TORCH_TRACE=<dir>`` the artifacts land in torch's structured trace beside Dynamo's and
    Inductor's own, and ``tlparse`` shows them per compiled graph; otherwise ``payload_fn`` is not called.
    """
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn
    )


def rewrite(gm: fx.GraphModule, policy: Policy) -> report.PrecisionMap:
    """Run every enabled pass on ``gm`` in place and return its precision map.

    Subgraphs (the bodies of ``torch.utils.checkpoint`` regions and other
    higher-order ops, held as GraphModule attributes) are rewritten too. The map records what each
    step cost (:attr:`mxfx.report.PrecisionMap.steps`).
    """
    graphs = all_graphs(gm)
    pm = report.PrecisionMap(nodes=sum(len(g.graph.nodes) for g in graphs))
    steps = [(run.__module__.rpartition(".")[2], run) for name, run in passes.PIPELINE if policy.pass_enabled(name)]
    steps += [("example values", _fill_example_values), ("lint + recompile", _lint_recompile)]
    prefixes = record_prefixes(gm)
    for g in graphs:
        own = report.PrecisionMap()  # the passes find records by node name, which one graph alone keeps unique
        for step, run in steps:
            nodes, start = len(g.graph.nodes), time.perf_counter()
            run(g, policy, own)
            pm.note_step(step, time.perf_counter() - start, len(g.graph.nodes) - nodes)
        for r in own.records:  # a subgraph's names qualified by its place (mxfx.fx.record_prefixes)
            r.node = prefixes[g] + r.node
        pm.records += own.records
    pm.stats_sites = stats_sites(gm)
    return pm


def _fill_example_values(g: fx.GraphModule, policy: Policy, pm: report.PrecisionMap) -> None:
    fill_example_values(g)  # AOTAutograd's cache needs them (mxfx.cache_key)


def _lint_recompile(g: fx.GraphModule, policy: Policy, pm: report.PrecisionMap) -> None:
    g.graph.lint()
    g.recompile()


_warned_formats: set[str] = set()  # formats whose GPU note was given (once per process each)


def _warn_keep_dequantized_unused(pm: report.PrecisionMap, policy: Policy, on: torch.device) -> None:
    """Warn once per process when ``keep_dequantized_weights`` can act nowhere: no converted op of this graph runs a
    format with BF16 dequantized weight forms, and neither the policy's format nor any rule's resolves to one on
    ``on`` (so no other graph has such an op either; e.g. ``format="auto"`` on sm90)."""
    if not policy.keep_dequantized_weights or "keep_dequantized" in _warned_formats:
        return
    converted = [r for r in pm.records if r.rewritten and r.kind in cache.WEIGHT_KINDS]
    names = sorted({f for r in converted for f in (r.forward, r.dgrad) if f in formats.NAMES})
    if not converted or any(formats.get(f).dequantized_weight_forms for f in names):
        return
    if any(
        formats.get(f, on).dequantized_weight_forms
        for f in [policy.format, *(r.format for r in policy.rules if r.format)]
    ):
        return
    _warned_formats.add("keep_dequantized")
    warnings.warn(
        f"mxfx: keep_dequantized_weights=True keeps BF16 weight copies for emulated GEMMs, but no op runs a "
        f"format that has them here: the policy's format {policy.format!r} and its rules resolve to "
        f"{'/'.join(names)} on {on.type}, which reads its low-precision weights directly, so it does nothing; "
        f"drop it, or add a rule with format="
        f"{next(n for n in formats.NAMES if formats.get(n).dequantized_weight_forms)!r}",
        stacklevel=4,
    )


def _warn_format_notes(pm: report.PrecisionMap, example_inputs, policy: Policy) -> None:
    """Warn once per process and format when a graph on a CUDA GPU has ops of a format whose GEMMs are emulated
    there while another format runs natively (MXFP8 on sm90: the note names fp8_block), and when
    ``keep_dequantized_weights`` can act nowhere (:func:`_warn_keep_dequantized_unused`)."""
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
    _warn_keep_dequantized_unused(pm, policy, device or torch.device("cpu"))
    if device is None:
        return
    arch = devices.arch_of(devices.capability(device))
    native = formats.get(formats.AUTO, device)
    used = {f for r in pm.records if r.rewritten for f in (r.forward, r.dgrad) if f in formats.NAMES}
    for fmt in map(formats.get, sorted(used - _warned_formats)):
        if arch in fmt.native_archs or arch not in native.native_archs:
            continue
        _warned_formats.add(fmt.name)
        warnings.warn(
            f"mxfx: {fmt.name} has no tensor cores on {arch}: its GEMMs are emulated (dequantize + BF16 "
            f"GEMM). options={{'format': {native.name!r}}} (or 'auto') runs {native.name} tensor-core GEMMs "
            f"instead; BENCHMARKS.md has both formats' measured speed and loss on the H200.",
            stacklevel=3,
        )


def mxfp8_backend(
    gm: fx.GraphModule, example_inputs, options: Policy | dict | None = None, mode: str | None = None, **_unused
):
    """torch.compile backend: MXFP8 rewrite of ``gm`` per ``options``, then the inner compiler.

    ``mode`` (from ``torch.compile(..., mode=...)``) configures the inner Inductor; see
    :func:`inductor_mode_options`.

    Raises:
        ValueError / TypeError: invalid options (the message lists valid keys/values).
    """
    policy = Policy.from_options(options)
    params = parameter_placeholders(gm, example_inputs)
    model = coverage.model_of(params)
    place = names.graph_place(params, model)
    scope = coverage.model_scope(model)  # the model's warnings: once per model, complete
    # blocks running through this graph that the policy decides differently for get a variant each (mxfx.variants)
    parts = variants.groups(policy, rule_check.graph_modules(gm), place) if place.shared else [[place.prefix]]
    copies = [variants.graph_copy(gm) for _ in parts[1:]]  # before the rewrite: each variant rewrites its own graph
    compiled = {}
    for graph, group in zip([gm, *copies], parts):
        fn = _compile_for(graph, example_inputs, policy, mode, group, place, params, scope)
        compiled.update(dict.fromkeys(group, fn))
    if len(parts) == 1:
        return fn
    name = next(iter(params))
    index = next(i for i, v in enumerate(example_inputs) if v is params[name])
    return variants.by_place(place.root, index, name, compiled)


def _inputs_at(example_inputs, params: dict, held: dict, prefix: str) -> list:
    """``example_inputs`` with each parameter of the graph replaced by the one of the block at ``prefix``
    (``held``: the model's parameters by full name); others as they are."""
    rel_of = {id(t): rel for rel, t in params.items()}
    return [held.get(prefix + rel_of[id(v)], v) if id(v) in rel_of else v for v in example_inputs]


def _publish(pm: report.PrecisionMap, policy: Policy, before: str, after: str) -> None:
    """Number and keep ``pm`` (:func:`mxfx.report.register`), log its summary, emit it as trace artifacts and, with
    ``policy.dump_dir``, write the graph's dump (``before`` / ``after``: its code before and after the passes)."""
    report.register(pm)
    log.info("mxfx: %s", pm.summary())
    trace_artifact("mxfx_precision_map", pm.to_text)
    trace_artifact("mxfx_precision_map_json", pm.to_json, "json")
    if policy.dump_dir:
        log.info("mxfx: wrote %s", report.write_dump(policy.dump_dir, pm, before, after))


def _compile_for(
    gm: fx.GraphModule,
    example_inputs,
    policy: Policy,
    mode: str | None,
    group: list[str],
    place: names.Place,
    params: dict,
    scope,
):
    """Rewrite ``gm`` for the blocks ``group`` (full-name prefixes; its names are the first's), report it, and
    compile it with the inner compiler."""
    prefix = group[0]
    before = gm.print_readable(print_output=False) if policy.dump_dir else ""
    trace_artifact("mxfx_graph_before", lambda: before or gm.print_readable(print_output=False))
    for g in gm.modules():  # module names behind the graph's place in the model (mxfx.names)
        if isinstance(g, fx.GraphModule):
            g.meta[PREFIX_META] = prefix
    modules = rule_check.graph_modules(gm)
    pm = rewrite(gm, policy)
    whole = not prefix and names.whole_forward(params)
    # judged now for a whole-model graph, else over all graphs at the first optimizer step
    rule_check.observe(
        policy,
        modules,
        rule_check.rule_ops(pm.records),
        whole=whole,
        sites=pm.stats_sites,
        converted={r.module for r in pm.records if r.rewritten},
    )
    rule_check.warn_unmet_requests(policy, pm.records, scope.warned)
    _warn_float16_once(gm, pm)
    recompiles.observe(pm.count(rewritten=True) > 0)
    if not torch.is_grad_enabled():  # Dynamo calls the backend in the grad mode the graph was traced in
        pm.mark_inference()
    held = names.parameters_by_name(place.root) if group != [place.prefix] else {}
    observations = []  # every block run through this graph: its weights are read by the graph's GEMMs
    inputs = [
        example_inputs if block == place.prefix else _inputs_at(example_inputs, params, held, block) for block in group
    ]
    if policy.fuse_wgrad_accumulation:
        wgrad_accumulation.settle(gm, inputs, pm)
    for block_inputs in inputs:
        observations.append(coverage.observation(scope, gm, block_inputs, pm, policy, whole=whole))
    _warn_format_notes(pm, example_inputs, policy)
    after = gm.print_readable(print_output=False) if policy.dump_dir else ""  # as the passes left it
    trace_artifact("mxfx_graph_after", lambda: after or gm.print_readable(print_output=False))
    if any(r.rewritten and r.kind in cache.WEIGHT_KINDS for r in pm.records):
        cache.install()  # step post-hook + Inductor lowering for the weight caches
    if policy.stats is not None:  # quantization statistics: their samples go to this policy's dump dir (or nowhere)
        stats.note_compiled(policy.stats["modules"], pm.stats_sites)
    if pm.stats_sites:
        stats.set_output(policy.dump_dir)
    kernels = _kernel_launch(policy, pm, example_inputs)
    try:
        with launch.kernels_launched(kernels):  # the ops' bodies are traced inside the inner compile
            compiled = _inner_compile(policy.inner, gm, example_inputs, mode)
    except RestartAnalysis:
        # Dynamo traces the frame again (AOTAutograd asks for it under dynamic=True, for Python float scalars): the
        # graph of that trace takes this one's place
        raise
    except BaseException:
        _publish(pm, policy, before, after)  # a graph that failed to compile keeps its map and dump, to read why
        raise
    _publish(pm, policy, before, after)
    for add in observations:
        add()
    if gm.meta.get(weight_refresh.PLANS_META):  # an optimizer step that rebuilds caches in-graph
        compiled = cache.after_step(compiled)
    return compiled
