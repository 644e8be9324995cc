"""What the dual-quantize probes share: a timing table of the module's kernel and each variant side by side, the
byte-equality check, the interpreter check of persistent variants, TMA scratch, and the command line.

``time_variants(title, module_fn, variants, same)`` prints, for each benchmark shape of ``bench/mx_kernels.py``
(bf16 input), the % of a 2 GiB copy of ``module_fn(x)`` and of every ``(name, fn)`` in ``variants``, and whether
the variant's outputs equal the module's (``same(got, ref)``). Bytes counted: ``per_elem`` per input value; by
default the bf16 input read once and both MX pairs written (2 + 2 x 33/32), as ``bench/mx_kernels.py`` counts the dual
passes.

``probe_main(name, time_all, check, sass)`` is each probe's command line: no argument times on a GPU, ``check``
runs ``check()`` under Triton's interpreter (``TRITON_INTERPRET=1``), ``sass`` prints offline sm90 SASS.
"""

from __future__ import annotations

import os
import sys

import torch
import triton


def same_bytes(a, b) -> bool:
    """Every tensor of ``a`` byte-equal to the one at the same place in ``b`` (fp8 and uint8 compared as bytes)."""
    return all(torch.equal(u.view(torch.uint8), w.view(torch.uint8)) for u, w in zip(a, b))


def check_persistent(probe: str, runs) -> None:
    """Under the interpreter: each ``(name, run(x, sms))`` of ``runs`` equals ``mxfx``'s ``quantize_dual`` on two
    shapes, with one and three "SMs" (one program per tile, or several tiles per program)."""
    from mxfx.kernels import dual

    g = torch.Generator().manual_seed(0)
    # not exactly representable in E4M3: the interpreter's rounding may differ from the reference's, but the
    # variants and the module's kernel run the same encode under the same interpreter, so they must agree
    for shape in ((64, 256), (96, 128)):
        x = (torch.randint(-448, 449, shape, generator=g).float() / 4).to(torch.bfloat16)
        ref = dual.quantize_dual(x, "rceil")
        for name, run in runs:
            for sms in (1, 3):
                assert same_bytes(run(x, sms), ref), (name, shape, sms)
    print(f"{probe} check: every variant checked equals the module under the interpreter")


def use_tma_scratch() -> None:
    """Give Triton global scratch for device-side tensor descriptors (``tl.make_tensor_descriptor``)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def probe_main(name: str, time_all, check=None, sass=None) -> None:
    """Run the probe ``name`` as ``sys.argv`` asks (see the module docstring)."""
    modes = {"check": check, "sass": sass}
    mode = sys.argv[1:]
    if len(mode) > 1 or (mode and modes.get(mode[0]) is None):
        usable = ", ".join(f"'{m}'" for m, fn in modes.items() if fn is not None) or "nothing"
        sys.exit(f"{name}: unknown arguments {mode}; run with no argument (GPU) or {usable}")
    if mode == ["check"]:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit(f"{name}: 'check' runs under Triton's interpreter: TRITON_INTERPRET=1 python "
                     f"-m bench.probes.{name} check")
        check()
    elif mode == ["sass"]:
        sass()
    elif not torch.cuda.is_available():
        sys.exit(f"{name}: timing needs a CUDA GPU ('check' and 'sass', where the probe has them, run on CPU)")
    else:
        time_all()


def time_variants(title: str, module_fn, variants, same, per_elem: float = 2 + 66 / 32) -> None:
    from bench.mx_kernels import SHAPES, copy_bandwidth, median_ms

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
