"""Probe: a SwiGLU SiLU cheaper than ``div.rn``, checked against PyTorch's CUDA ``F.silu`` on every fp32 input.

Usage: ``python -m bench.probes.silu_exhaustive [check] [points] [time] [sass]`` (check, points and time by
default; needs CUDA). ``SILU_TIMED=0,5`` picks the variants ``time`` runs (indices below).

``div.rn.f32`` computes a reciprocal, one Newton step and one quotient correction, then a range check
(``FCHK``) and a branch to a slow path per value, which made the issue-bound SwiGLU kernel slower than
the division itself. The variants run the same five operations without the check:

0. ``div_rn``: ``tl.math.div_rn``, the module's arithmetic until 2026-12-02; equal to ``F.silu`` everywhere;
1. ``fast``: no check at all. Exact for g > -87.3365; below, the reciprocal of ``1 + exp(-g) > 2^126``
   flushes to +0 (and ``inf * 0`` gives NaN once exp overflows, g < -88.72);
2. ``fast, inf clamp``: the divisor clamped at FLT_MAX in the Newton step and residual only;
3. ``fast, quarter``: dividing by d / 4 (written ``fma(exp, 0.25, 0.25)``, which rounds unlike ``1 + exp``);
4. ``fast, clamp 2^126``: the divisor clamped at 2^126, giving ``g * 2^-126`` below -87.3365, which is
   NOT small for huge negative gates (g = -1e38 gives -1.2): not usable;
5. ``module``: ``silu_triton.silu_f32``, the library's SiLU: the divisor clamped at FLT_MAX, negations
   written as ``x * -1.0``, so that every finite g <= ``SILU_FLUSH_GATE`` gives -0 (``F.silu``'s own
   value below -88.72). Checked against ``mxfx.kernels.common.silu.silu_fp32``, the CPU reference, which
   states the band by that constant on g.

Variants 1-4 write ``-x``, which Triton 3.6 lowers to ``0 - x``: an extra FADD per negation (``sass``
shows them), and -(+0) = +0, which gave their flushed quotients a positive sign.

Sections:

* ``check``: all 2^32 fp32 bit patterns g in chunks of 2^28, each variant against ``F.silu(g)`` bit for
  bit (two NaNs equal): how many differ, how many of those are NaN where ``F.silu`` is +-Inf (an MX
  block is non-finite either way), the g range of the rest; and variants 4 and 5 against ``F.silu``
  with their documented difference applied, which they must match everywhere.
* ``points``: each variant's value and fp32 bits at a few gates around the flush threshold (-87.3,
  -88.7, -1e38, +-Inf, +-0, NaN), next to ``F.silu``'s: what the sign and size of each variant's zero are.
* ``time``: % of a 2 GiB copy for the module's SwiGLU + quantize, and for a probe kernel of the module's
  streamed pass per variant and tile.
* ``sass``: the raw MUFU reciprocal of divisors around 2^126, and each variant's SASS as the installed
  Triton compiles it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    sys.exit("silu_exhaustive: needs Triton and a CUDA GPU (pip install -e '.[gpu]')")

from bench.mx_kernels import SHAPES, copy_bandwidth, median_ms
from mxfx.kernels.mx import device_path
from mxfx.kernels.mx import swiglu
from mxfx.kernels.common.silu_triton import FLT_MAX, exp_f32, rcp_approx_ftz, silu_f32
from mxfx.kernels.mx.blocks import conversion_bits, load_blocks, store_dequantized
from mxfx.kernels.common.silu import silu_fp32
from mxfx.kernels.mx.swiglu import _store_mx

CHUNK = 1 << 28
TIMED = tuple(int(v) for v in os.environ.get("SILU_TIMED", "0,5").split(","))
"""Variants the ``time`` section runs (indices into VARIANTS; the others' figures: docs/kernel-notes.md, 2026-12-01)."""
VARIANTS = ("div_rn", "fast", "fast, inf clamp", "fast, quarter", "fast, clamp 2^126", "module")
FLUSH_DIVISOR = 2.0**126  # from here on the reciprocal flushes to zero


def swiglu_setup(m, k, copy_gbs):
    """Print the module's three SwiGLU rows at [m, k], and return what the probe kernels take there:
    ``(gu, outs, layouts, nbytes, save_bytes)``, outs = (q, s, h, gq, gs, uq, us) buffers, layouts =
    [(name, (gate, up, RPR, gate row stride, up row stride))] for separate gate/up and gate_up halves,
    and the bytes moved by the MX-only and the values + saved-pairs passes."""
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    g, u = (
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
        torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
    )
    q, gq, uq = (torch.empty(m, k, dtype=torch.uint8, device="cuda") for _ in range(3))
    s, gs, us = (torch.empty(m, k // 32, dtype=torch.uint8, device="cuda") for _ in range(3))
    h = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    nbytes = 4 * m * k + m * k * 33 / 32
    save_bytes = nbytes + 2 * m * k + 2 * m * k * 33 / 32
    for name, fn, nb in (
        ("module, separate", lambda: device_path.swiglu_quantize(g, u, "rceil"), nbytes),
        ("module, halves", lambda: device_path.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil"), nbytes),
        (
            "module, halves + values + saved",
            lambda: device_path.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil", torch.bfloat16, save_inputs=True),
            save_bytes,
        ),
    ):
        print(f"| {name} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |", flush=True)
    layouts = [("separate", (g, u, 1, 32, 32)), ("halves", (gu[:, :k], gu[:, k:], k // 32, 2 * k, 2 * k))]
    return gu, (q, s, h, gq, gs, uq, us), layouts, nbytes, save_bytes


@triton.jit
def _newton(g, d, dc):
    """div.rn's fast path without its range check: reciprocal of d, one Newton step and one quotient
    correction against dc, the residual negated so that a zero g keeps its sign."""
    r = rcp_approx_ftz(d)
    r = tl.fma(r, tl.fma(-dc, r, 1.0), r)
    q = g * r
    return tl.fma(-r, tl.fma(dc, q, -g), q)


@triton.jit
def silu_variant(g, V: tl.constexpr):
    if V == 0:
        s = tl.math.div_rn(g, 1.0 + exp_f32(-g))
    elif V == 1:
        d = 1.0 + exp_f32(-g)
        s = _newton(g, d, d)
    elif V == 2:
        d = 1.0 + exp_f32(-g)
        s = _newton(g, d, tl.minimum(d, FLT_MAX))
    elif V == 3:
        d = tl.minimum(tl.fma(exp_f32(-g), 0.25, 0.25), FLT_MAX)
        s = _newton(g, d, d) * 0.25
    elif V == 4:
        d = tl.minimum(1.0 + exp_f32(-g), 2.0**126)
        s = _newton(g, d, d)
    else:  # the module's
        s = silu_f32(g)
    return s


@triton.jit
def _silu_all(out_ptr, base, V: tl.constexpr, BR: tl.constexpr):
    """out[i] = SiLU of the fp32 whose bits are base + i."""
    i = tl.program_id(0) * (BR * 32) + tl.arange(0, BR)[:, None] * 32 + tl.arange(0, 32)[None, :]
    g = (base + i).to(tl.float32, bitcast=True)
    tl.store(out_ptr + i, silu_variant(g, V))


@triton.jit
def _silu_points(g_ptr, out_ptr, ROWS, V: tl.constexpr):
    """out = SiLU variant V of g, a [ROWS, 32] fp32 tensor (one row per program, grid (ROWS,))."""
    i = tl.program_id(0) * 32 + tl.arange(0, 1)[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + i, silu_variant(tl.load(g_ptr + i), V))


@triton.jit(do_not_specialize=["R"])
def _swiglu_v(
    g_ptr,
    u_ptr,
    q_ptr,
    s_ptr,
    h_ptr,
    gq_ptr,
    gs_ptr,
    uq_ptr,
    us_ptr,
    R,
    RPR,
    sgr,
    sur,
    V: tl.constexpr,
    SAVE: tl.constexpr,
    BR: tl.constexpr,
    EVEN: tl.constexpr,
    CONVERT: tl.constexpr,
):
    """The module's streamed SwiGLU pass (MX only, or with values and saved pairs) with SiLU variant V."""
    r0, b = tl.program_id(0) * BR, tl.program_id(1)
    g = load_blocks(g_ptr, r0, R, RPR, sgr, BR, EVEN, CONVERT)
    u = load_blocks(u_ptr, r0, R, RPR, sur, BR, EVEN, CONVERT)
    qbits, sbyte = _store_mx(q_ptr, s_ptr, silu_variant(g, V) * u, b, r0, 0, R, 32, True, BR, 32, EVEN, CONVERT)
    if SAVE:
        store_dequantized(h_ptr, qbits, sbyte, b, r0, 0, R, 32, BR, 32, EVEN)
        _store_mx(gq_ptr, gs_ptr, g, b, r0, 0, R, 32, True, BR, 32, EVEN, CONVERT)
        _store_mx(uq_ptr, us_ptr, u, b, r0, 0, R, 32, True, BR, 32, EVEN, CONVERT)


def _clamp_126(g, ref):
    """g * 2^-126 where 1 + exp(-g) > 2^126"""
    return torch.where(1.0 + torch.exp(-g) > FLUSH_DIVISOR, g * 2.0**-126, ref)


def _flush_to_neg_zero(g, ref):
    """mxfx.kernels.common.silu.silu_fp32: -0 for finite g <= SILU_FLUSH_GATE"""
    return silu_fp32(g)


EXPECTED = {"fast, clamp 2^126": _clamp_126, "module": _flush_to_neg_zero}


def check():
    out = torch.empty(CHUNK, dtype=torch.float32, device="cuda")
    bad = {v: 0 for v in VARIANTS}
    nan_for_inf = {v: 0 for v in VARIANTS}
    documented = {name: 0 for name in EXPECTED}  # mismatches against the documented difference
    span = {v: [] for v in VARIANTS}  # g of the mismatches that are not NaN-for-Inf: (min, max) per chunk
    for base in range(-(1 << 31), 1 << 31, CHUNK):
        bits = torch.arange(base, base + CHUNK, dtype=torch.int32, device="cuda")
        g = bits.view(torch.float32)
        ref = F.silu(g)
        for v, name in enumerate(VARIANTS):
            _silu_all[(CHUNK // (64 * 32),)](out, base, V=v, BR=64, num_warps=2)
            miss = ~((out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan()))
            nfi = miss & out.isnan() & ref.isinf()
            bad[name] += int(miss.sum())
            nan_for_inf[name] += int(nfi.sum())
            gm = g[miss & ~nfi]
            if gm.numel():
                span[name].append((float(gm.min()), float(gm.max())))
            if name in EXPECTED:  # against F.silu with the candidate's documented difference
                want = EXPECTED[name](g, ref)
                off = ~((out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan()))
                documented[name] += int((off & ~(out.isnan() & want.isinf())).sum())
        del bits, ref
    print(
        "| variant | fp32 inputs differing from F.silu | of which NaN where F.silu gives +-Inf "
        "| g range of the others |"
    )
    print("|---|---|---|---|")
    for name in VARIANTS:
        lo = min((a for a, _ in span[name]), default=None)
        hi = max((b for _, b in span[name]), default=None)
        print(
            f"| {name} | {bad[name]} | {nan_for_inf[name]} | {'-' if lo is None else f'[{lo!r}, {hi!r}]'} |", flush=True
        )
    for name, n in documented.items():
        print(
            f"{name}: {n} inputs differ from F.silu with its documented difference ({EXPECTED[name].__doc__}), "
            "NaN-for-Inf aside",
            flush=True,
        )


POINTS = (
    -87.0,
    -87.34,
    -87.5,
    -88.0,
    -88.8,
    -90.0,
    -100.0,
    -1e10,
    -1e38,
    float("-inf"),
    -0.0,
    0.0,
    1e-40,
    -1e-40,
    100.0,
    float("inf"),
    float("nan"),
)


def points():
    """Each variant's SiLU at a few gates around the flush threshold, with its fp32 bits, against F.silu."""
    g = torch.tensor(POINTS + (0.0,) * (32 - len(POINTS) % 32), device="cuda").reshape(-1, 32)
    out = torch.empty_like(g)
    print("| variant | " + " | ".join(f"{p!r}" for p in POINTS) + " |")
    print("|---|" + "---|" * len(POINTS))
    rows = [("F.silu", F.silu(g))]
    for v, name in enumerate(VARIANTS):
        _silu_points[(g.shape[0],)](g, out, g.shape[0], V=v)
        rows.append((name, out.clone()))
    for name, t in rows:
        vals = t.flatten()[: len(POINTS)]
        cells = [f"{float(x):.3g} ({int(b) & 0xFFFFFFFF:#010x})" for x, b in zip(vals, vals.view(torch.int32))]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


@triton.jit
def _rcp_raw(d_ptr, out_ptr):
    i = tl.arange(0, 32)
    tl.store(out_ptr + i, rcp_approx_ftz(tl.load(d_ptr + i)))


def _disassemble(cubin: bytes) -> str:
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass():
    """The raw MUFU reciprocal of divisors around 2^126 (bits: the sign of its flushed zero), and the SASS
    of each variant's SiLU as this Triton compiles it."""
    d = torch.tensor([2.0**126, 1.0001 * 2.0**126, 1e38, 3.4e38, float("inf"), -1e38] + [1.0] * 26, device="cuda")
    out = torch.empty_like(d)
    _rcp_raw[(1,)](d, out)
    print(
        "rcp.approx.ftz:",
        [(float(a), f"{int(b) & 0xFFFFFFFF:#010x}") for a, b in zip(d[:6], out[:6].view(torch.int32))],
    )
    g = torch.zeros(1, 32, device="cuda")
    for v, name in enumerate(VARIANTS):
        k = _silu_points[(1,)](g, out, 1, V=v)
        text = _disassemble(k.asm["cubin"])
        body = [ln.split(";")[0].split("*/")[-1].strip() for ln in text.splitlines() if "/*0" in ln]
        body = [b for b in body if b and not b.startswith("NOP")]
        print(f"--- {name}: {len(body)} instructions", *body, sep="\n", flush=True)


def time_rows(copy_gbs):
    print("| variant | shape | tile | % of copy |\n|---|---|---|---|")
    for m, k in SHAPES:
        gu, (q, s, h, gq, gs, uq, us), layouts, nbytes, save_bytes = swiglu_setup(m, k, copy_gbs)
        nblk = m * k // 32
        for layout, args in layouts:
            a, b, rpr, sa, sb = args
            for save in (False, True):
                for v in TIMED:
                    for br, warps in ((16, 1), (32, 2)):
                        even = swiglu.STREAM_EVEN and rpr == 1 and nblk % br == 0  # the module's masks and forms
                        convert = conversion_bits(swiglu.CONVERSION_FORMS["wide" if save else "quantize"])

                        def fn():
                            return _swiglu_v[(triton.cdiv(nblk, br),)](
                                a,
                                b,
                                q,
                                s,
                                h,
                                gq,
                                gs,
                                uq,
                                us,
                                nblk,
                                rpr,
                                sa,
                                sb,
                                V=v,
                                SAVE=save,
                                BR=br,
                                EVEN=even,
                                CONVERT=convert,
                                num_warps=warps,
                            )

                        pct = 100 * (save_bytes if save else nbytes) / median_ms(fn) / 1e6 / copy_gbs
                        print(
                            f"| probe swiglu {layout} save={save} {VARIANTS[v]} | {m}x{k} | ({br}, {warps}) | "
                            f"{pct:.1f}% |",
                            flush=True,
                        )
        ref = device_path.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil")
        want = device_path.quantize_lastdim(silu_fp32(gu[:, :k]) * gu[:, k:].float(), "rceil")
        print(
            f"module swiglu equals quantize(silu_fp32(g) * u) at {m}x{k}: "
            f"{[torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ref, want)]}",
            flush=True,
        )
        gu = layouts = q = s = h = gq = gs = uq = us = None  # freed before the next shape
        torch.cuda.empty_cache()


SECTIONS = ("check", "points", "time", "sass")


def main():
    sections = sys.argv[1:] or ["check", "points", "time"]
    unknown = [n for n in sections if n not in SECTIONS]
    if unknown:
        sys.exit(f"silu_exhaustive: unknown section(s) {unknown}; choose from {SECTIONS}")
    if not torch.cuda.is_available():
        sys.exit("silu_exhaustive: needs a CUDA GPU (it compares Triton kernels with torch's CUDA F.silu)")
    copy_gbs = copy_bandwidth() if "time" in sections else None
    if copy_gbs:
        print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    for name in sections:
        {"check": check, "points": points, "time": lambda: time_rows(copy_gbs), "sass": sass}[name]()


if __name__ == "__main__":
    main()
