"""Timing table shared by the dual-quantize probes: the module's kernel and each probe variant side by side.

``time_variants(title, module_fn, variants, same)`` prints, for each benchmark shape of ``bench/kernels.py``
(bf16 input), the % of a 2 GiB copy of ``module_fn(x)`` and of every ``(name, fn)`` in ``variants``, and whether
the variant's outputs equal the module's (``same(got, ref)``). Bytes counted: ``per_elem`` per input value; by
default the bf16 input read once and both MX pairs written (2 + 2 x 33/32), as ``bench/kernels.py`` counts the dual
passes.
"""

from __future__ import annotations

import torch


def time_variants(title: str, module_fn, variants, same, per_elem: float = 2 + 66 / 32) -> None:
    from kernels import SHAPES, copy_bandwidth, median_ms  # bench/ is on sys.path in the probes

    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s\n| variant | shape | % of copy | bytes |\n|---|---|---|---|")
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = per_elem * m * k
        ref = module_fn(x)
        pct = 100 * nbytes / median_ms(lambda: module_fn(x)) / 1e6 / copy_gbs
        print(f"| {title} | {m}x{k} | {pct:.1f}% | - |", flush=True)
        for name, fn in variants:
            pct = 100 * nbytes / median_ms(lambda: fn(x)) / 1e6 / copy_gbs
            ok = "exact" if same(fn(x), ref) else "DIFFER"
            print(f"| {name} | {m}x{k} | {pct:.1f}% | {ok} |", flush=True)
        del x, ref
        torch.cuda.empty_cache()
