"""Probe: the transposed dual quantize with its columnwise E4M3 tile packed into 32-bit words before the transpose.

Usage:
* ``python bench/probes/dual_packed.py`` on a GPU: % of a 2 GiB copy for the module's ``quantize_dual`` and
  for this variant per tile, each checked byte for byte against the module;
* ``python bench/probes/dual_packed.py sass`` anywhere: the variant's sm90 SASS against the module's
  (``sass_sm90.py``);
* ``TRITON_INTERPRET=1 python bench/probes/dual_packed.py check`` on CPU: the variant's bytes against the
  CPU reference under Triton's interpreter, on exactly representable data.

Why: the module's transposed pass stores ``q_col [K, M]`` through transposed offsets, and Triton moves
the byte tile through shared memory 2 bytes at a time (about 66 shared accesses per thread at
(32, 64, 1), ``sass_sm90.py``). Here four consecutive M rows of each column are first packed into one
little-endian 32-bit word (a sum of disjoint byte fields), so the tile that crosses threads is a quarter
as many elements, each 4 bytes wide. Same values, same scales.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mxfx.kernels import device_path  # noqa: E402
from mxfx.kernels.mx_block import encode_blocks  # noqa: E402


@triton.jit
def _dual_packed(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sxm, sxk, n_k_tiles, PERM: tl.constexpr,
                 BK: tl.constexpr):
    """One [32, BK] tile per program: q_row [M, K], s_row MN-major (storage [K/32, M]), q_col [K, M] written
    as uint32 words of 4 M-consecutive bytes, s_col MN-major (storage [M/32, K]), as ``quantize_dual``.

    PERM False: tile row p is row m0 + p, and the words come from reshaping the 32 rows as [8, 4]. PERM True:
    tile row p is row m0 + 8 (p % 4) + p // 4, so that where Triton gives each thread every fourth tile row
    (threads [4, 8] over a [32, BK] tile of one warp) a thread holds 8 consecutive rows, and the four rows
    of a word sit in one thread; the column amax does not care about row order, and the row outputs are
    stored through the same permutation. (Its SASS still has more shuffles than the module's, 86 against
    52 per thread at (64, 1): ``python bench/probes/dual_packed.py sass``.)
    """
    pid = tl.program_id(0)
    m0 = (pid // n_k_tiles) * 32
    k0 = (pid % n_k_tiles) * BK
    ap = tl.arange(0, 32)
    rows = m0 + ((ap % 4) * 8 + ap // 4 if PERM else ap)
    ak = tl.arange(0, BK)
    kmask = (k0 + ak) < K
    mask = (rows < M)[:, None] & kmask[None, :]
    v = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + (k0 + ak)[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
    tl.store(qr_ptr + rows[:, None].to(tl.int64) * K + (k0 + ak)[None, :], tl.reshape(q, [32, BK]), mask=mask)
    an = tl.arange(0, BK // 32)
    tl.store(sr_ptr + (k0 // 32 + an)[None, :].to(tl.int64) * M + rows[:, None], s,
             mask=(rows < M)[:, None] & ((k0 // 32 + an) < K // 32)[None, :])
    qc, sc = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
    if PERM:  # tile row p = 4 j + a holds row 8 a + j; j = 4 jh + jl
        fields = tl.reshape(qc, [2, 4, 4, BK]).to(tl.uint32) << (tl.arange(0, 4) * 8).to(tl.uint32)[None, :, None, None]
        words = tl.sum(fields, axis=1)  # [jh, a, BK]: rows 8 a + 4 jh .. + 3, the word at M offset 8 a + 4 jh
        w = (tl.arange(0, 2)[:, None, None] + 2 * tl.arange(0, 4)[None, :, None])
        offs = (k0 + ak)[None, None, :].to(tl.int64) * (M // 4) + m0 // 4 + w
        tl.store(qc_ptr.to(tl.pointer_type(tl.uint32)) + offs, words, mask=kmask[None, None, :])
    else:
        fields = tl.reshape(qc, [8, 4, BK]).to(tl.uint32) << (tl.arange(0, 4) * 8).to(tl.uint32)[None, :, None]
        words = tl.sum(fields, axis=1)  # [8, BK]: word i holds rows 4i .. 4i + 3 of each column, row 4i lowest
        offs = (k0 + ak)[None, :].to(tl.int64) * (M // 4) + m0 // 4 + tl.arange(0, 8)[:, None]
        tl.store(qc_ptr.to(tl.pointer_type(tl.uint32)) + offs, words, mask=kmask[None, :])
    tl.store(sc_ptr + (m0 // 32).to(tl.int64) * K + k0 + ak, tl.reshape(sc, [BK]), mask=kmask)


def run(x, bk=64, warps=1, perm=True):
    """``quantize_dual(x)``'s four outputs (uint8 views) from the packed variant; x [M, K], M, K multiples of 32."""
    m, k = x.shape
    if m % 32 or k % 32:  # the packed store writes whole 32-row tiles of words
        raise ValueError(f"dual_packed.run: x of shape {tuple(x.shape)} needs M and K multiples of 32")
    qr = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    sr = torch.empty(k // 32, m, dtype=torch.uint8, device=x.device)
    qc = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    sc = torch.empty(m // 32, k, dtype=torch.uint8, device=x.device)
    n_k = triton.cdiv(k, bk)
    _dual_packed[(triton.cdiv(m, 32) * n_k, 1)](x, qr, sr, qc, sc, m, k, *x.stride(), n_k, PERM=perm, BK=bk, num_warps=warps)
    return qr, sr.t(), qc, sc.t()


def _same(got, ref) -> bool:
    return all(torch.equal(g.cpu(), r.view(torch.uint8).cpu()) for g, r in zip(got, ref))


def check():
    """Interpreter (CPU) or GPU: bytes of the variant against ``dispatch.quantize_dual`` on data whose
    products with every power-of-two scale are exact (the interpreter's E4M3 rounding is not)."""
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
    g = torch.Generator().manual_seed(3)
    for m, k in ((64, 128), (96, 64), (128, 192)):
        x = (torch.randint(-16, 17, (m, k), generator=g).float() / 8).to(torch.bfloat16).to(dev)
        ref = dispatch.quantize_dual(x.cpu() if dev == "cpu" else x, "rceil")
        for perm in (False, True):
            for bk, warps in ((64, 1), (128, 2)):
                same = _same(run(x, bk, warps, perm), ref)
                print(f"packed dual perm={perm} at {m}x{k}, ({bk}, {warps}): {'exact' if same else 'DIFFERS'}", flush=True)


def sass():
    import sass_sm90
    from mxfx.kernels import dual

    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    (module,) = sass_sm90.captured_launches([dual], dual.quantize_dual, x, "rceil")
    m, k = x.shape
    bufs = (torch.empty(m, k, dtype=torch.uint8), torch.empty(k // 32, m, dtype=torch.uint8),
            torch.empty(k, m, dtype=torch.uint8), torch.empty(m // 32, k, dtype=torch.uint8))
    packed = [sass_sm90.Launch(_dual_packed, None, (x, *bufs, m, k, *x.stride(), k // bk), {"PERM": perm, "BK": bk, "num_warps": w})
              for perm in (False, True) for bk, w in ((64, 1), (128, 2))]
    for name, launch in (("module quantize_dual", module), *((f"packed perm={p.kwargs['PERM']} ({p.kwargs['BK']}, "
                                                                f"{p.kwargs['num_warps']})", p) for p in packed)):
        c = sass_sm90.compile_sm90(launch)
        mem = ", ".join(f"{n} {op}" for op, n in sorted(c.memory.items()))
        print(f"| {name} | {c.total} | {c.counts['SHFL']} SHFL, {mem} | {c.shared} |", flush=True)


def time_rows():
    from kernels import SHAPES, copy_bandwidth, median_ms

    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s\n| variant | shape | tile | % of copy | bytes |\n|---|---|---|---|---|")
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nb = 2 * m * k + 2 * m * k * 33 / 32
        ref = dispatch.quantize_dual(x, "rceil")
        print(f"| module quantize_dual | {m}x{k} | - | {100 * nb / median_ms(lambda: dispatch.quantize_dual(x, 'rceil')) / 1e6 / copy_gbs:.1f}% | - |")
        for perm in (True, False):
            for bk, warps in ((64, 1), (128, 2), (128, 1), (64, 2), (256, 2)):
                pct = 100 * nb / median_ms(lambda: run(x, bk, warps, perm)) / 1e6 / copy_gbs
                same = _same(run(x, bk, warps, perm), ref)
                print(f"| packed perm={perm} | {m}x{k} | ({bk}, {warps}) | {pct:.1f}% | {'exact' if same else 'DIFFERS'} |",
                      flush=True)
        del x, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {"check": check, "sass": sass, "time": time_rows}[sys.argv[1] if len(sys.argv) > 1 else "time"]()
