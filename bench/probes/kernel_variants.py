"""Probe: where the SwiGLU and transposed-dual kernels lose bandwidth (H200), one variant per row.

Usage: ``python bench/probes/kernel_variants.py [swiglu] [halves] [dual] [blocked] [layouts]`` (the first three by default).
Prints % of a 2 GiB copy for:

* ``swiglu``: SwiGLU read as streams of blocks (separate gate/up and gate_up halves), per tile, with the
  exact SiLU (libdevice expf + IEEE division, what mxfx computes), libdevice expf with Triton's
  approximate division (Inductor's default), Triton's fast ``sigmoid``, and no SiLU at all: what the
  exact arithmetic costs against the memory bound; also how many E4M3 bytes the division changes;
* ``halves``: the module's SwiGLU on gate_up halves of 2H- and (2H + 64)-wide rows, on halves of two
  tensors, and on separate tensors: whether the halves gap is the row stride or the shared tensor;
* ``dual``: the transposed dual quantize (rowwise + columnwise stored [K, M]) and the columnwise pair
  alone: transposed three ways, with the column scales stored or left out; with NSUB 32-row tiles per program whose column scales are joined in registers (NSUB bytes per
  K row), and with the column scales written in the source layout and transposed by a second kernel;
* ``blocked``: the transposed column scales written straight into the blocked layout of native MX GEMMs;
* ``layouts``: the dual pass (transposed and source layout) and the columnwise pair alone, each scale tensor
  stored in its plain layout, in the layout of the other orientation (a transpose view of a contiguous
  tensor, so that one program writes whole 32-byte sectors), or left out.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from kernels import SHAPES, copy_bandwidth, median_ms  # noqa: E402
from mxfx.kernels import device_path  # noqa: E402
from mxfx.kernels.dual import _store_tile  # noqa: E402
from mxfx.kernels.mx_block import blocked_offset, encode_blocks, load_blocks, load_tile, store_dequantized  # noqa: E402
from mxfx.kernels.swiglu import _store_mx  # noqa: E402


@triton.jit(do_not_specialize=["R"])
def _swiglu_probe(g_ptr, u_ptr, q_ptr, s_ptr, h_ptr, gq_ptr, gs_ptr, uq_ptr, us_ptr, R, RPR, sgr, sur,
                  MATH: tl.constexpr, SAVE: tl.constexpr, BR: tl.constexpr):
    r0, b = tl.program_id(0) * BR, tl.program_id(1)
    g = load_blocks(g_ptr, r0, R, RPR, sgr, BR)
    u = load_blocks(u_ptr, r0, R, RPR, sur, BR)
    if MATH == 0:  # eager CUDA F.silu: libdevice expf, IEEE division
        v = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
    elif MATH == 1:  # Inductor's default silu: libdevice expf, div.full.f32
        v = g / (1.0 + libdevice.exp(-g)) * u
    elif MATH == 2:
        v = g * tl.sigmoid(g) * u
    else:
        v = g * u
    qbits, sbyte = _store_mx(q_ptr, s_ptr, v, b, r0, 0, R, 32, True, BR, 32)
    if SAVE:
        store_dequantized(h_ptr, qbits, sbyte, b, r0, 0, R, 32, BR, 32)
        _store_mx(gq_ptr, gs_ptr, g, b, r0, 0, R, 32, True, BR, 32)
        _store_mx(uq_ptr, us_ptr, u, b, r0, 0, R, 32, True, BR, 32)


MATHS = ("div_rn", "div_full", "fast", "none")


def swiglu_setup(m, k, copy_gbs):
    """Print the module's three SwiGLU rows at [m, k], and return what the probe kernels take there:
    ``(gu, outs, layouts, nbytes, save_bytes)``, outs = (q, s, h, gq, gs, uq, us) buffers, layouts =
    [(name, (gate, up, RPR, gate row stride, up row stride))] for separate gate/up and gate_up halves,
    and the bytes moved by the MX-only and the values + saved-pairs passes."""
    gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    g, u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, gq, uq = (torch.empty(m, k, dtype=torch.uint8, device="cuda") for _ in range(3))
    s, gs, us = (torch.empty(m, k // 32, dtype=torch.uint8, device="cuda") for _ in range(3))
    h = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    nbytes = 4 * m * k + m * k * 33 / 32
    save_bytes = nbytes + 2 * m * k + 2 * m * k * 33 / 32
    for name, fn, nb in (
            ("module, separate", lambda: dispatch.swiglu_quantize(g, u, "rceil"), nbytes),
            ("module, halves", lambda: dispatch.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil"), nbytes),
            ("module, halves + values + saved", lambda: dispatch.swiglu_quantize(
                gu[:, :k], gu[:, k:], "rceil", torch.bfloat16, save_inputs=True), save_bytes)):
        print(f"| {name} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |", flush=True)
    layouts = [("separate", (g, u, 1, 32, 32)), ("halves", (gu[:, :k], gu[:, k:], k // 32, 2 * k, 2 * k))]
    return gu, (q, s, h, gq, gs, uq, us), layouts, nbytes, save_bytes


def swiglu_rows(copy_gbs):
    for m, k in SHAPES:
        gu, (q, s, h, gq, gs, uq, us), layouts, nbytes, save_bytes = swiglu_setup(m, k, copy_gbs)
        nblk = m * k // 32
        for layout, args in layouts:
            a, b, rpr, sa, sb = args
            for save in (False, True):
                for math in ((0, 1, 2) if not save else (0, 1)):
                    for br, warps in ((16, 1), (8, 1), (32, 2), (16, 2), (64, 4), (32, 4)):
                        fn = lambda: _swiglu_probe[(triton.cdiv(nblk, br),)](
                            a, b, q, s, h, gq, gs, uq, us, nblk, rpr, sa, sb, MATH=math, SAVE=save,
                            BR=br, num_warps=warps)
                        pct = 100 * (save_bytes if save else nbytes) / median_ms(fn) / 1e6 / copy_gbs
                        print(f"| swiglu {layout} save={save} math={MATHS[math]} | {m}x{k} | ({br}, {warps}) | "
                              f"{pct:.1f}% |", flush=True)
        # the probe's exact variant must equal the module bit for bit (halves, saved)
        _swiglu_probe[(triton.cdiv(nblk, 16),)](gu[:, :k], gu[:, k:], q, s, h, gq, gs, uq, us, nblk, k // 32, 2 * k,
                                                2 * k, MATH=0, SAVE=True, BR=16, num_warps=1)
        ref = dispatch.swiglu_quantize(gu[:, :k], gu[:, k:], "rceil", torch.bfloat16, save_inputs=True)
        same = [torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip((q, s, h, gq, gs, uq, us), ref)]
        print(f"probe swiglu equals the module at {m}x{k}: {same}", flush=True)
        # div.full against div_rn: how many E4M3 bytes and scales move
        _swiglu_probe[(triton.cdiv(nblk, 16),)](gu[:, :k], gu[:, k:], q, s, h, gq, gs, uq, us, nblk, k // 32, 2 * k,
                                                2 * k, MATH=1, SAVE=False, BR=16, num_warps=1)
        print(f"div_full vs div_rn at {m}x{k}: {int((q != ref[0].view(torch.uint8)).sum())} bytes, "
              f"{int((s != ref[1]).sum())} scales of {q.numel()} / {s.numel()}", flush=True)
        inductor = torch.compile(lambda a, b: torch.nn.functional.silu(a.float()) * b.float())
        vi = inductor(gu[:, :k], gu[:, k:])
        qi, si = dispatch.quantize_lastdim(vi, "rceil")
        print(f"div_full vs Inductor silu at {m}x{k}: {int((q != qi.view(torch.uint8)).sum())} bytes, "
              f"{int((s != si).sum())} scales", flush=True)
        del gu, layouts, q, s, h, gq, gs, uq, us
        torch.cuda.empty_cache()


@triton.jit
def _dual_t_probe(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sxm, sxk, n_k_tiles, ROW: tl.constexpr,
                  TRANS: tl.constexpr, CS: tl.constexpr, BK: tl.constexpr):
    """TRANS 0: column blocks encoded in the loaded layout, qdata stored through transposed offsets;
    1: the fp32 tile transposed (tl.trans) first, column blocks then encoded as rows; 2: the raw 16-bit
    tile transposed. CS 0: column scales stored transposed [K, M/32]; 1: in the source layout [M/32, K]
    (the host transposes them after); 2: not stored."""
    pid, b = tl.program_id(0), tl.program_id(1)
    m0 = (pid // n_k_tiles) * 32
    k0 = (pid % n_k_tiles) * BK
    am = tl.arange(0, 32)
    ak = tl.arange(0, BK)
    mask = ((m0 + am) < M)[:, None] & ((k0 + ak) < K)[None, :]
    raw = tl.load(x_ptr + (m0 + am)[:, None].to(tl.int64) * sxm + (k0 + ak)[None, :] * sxk, mask=mask, other=0.0)
    v = raw.to(tl.float32)
    if ROW:
        q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
        _store_tile(qr_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, False, 32, BK)
        _store_tile(sr_ptr, s, b, m0, k0 // 32, M, K // 32, False, 32, BK // 32)
    if TRANS == 0:
        q, s = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
        _store_tile(qc_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, True, 32, BK)
        s = tl.reshape(s, [BK])
    else:
        vt = tl.trans(v) if TRANS == 1 else tl.trans(raw).to(tl.float32)  # [BK, 32]
        q, s = encode_blocks(tl.reshape(vt, [BK, 1, 32]), 2, True)
        qt = tl.reshape(q, [BK, 32])
        maskt = ((k0 + ak) < K)[:, None] & ((m0 + am) < M)[None, :]
        tl.store(qc_ptr + (k0 + ak)[:, None].to(tl.int64) * M + m0 + am[None, :], qt, mask=maskt)
        s = tl.reshape(s, [BK])
    if CS == 0:
        tl.store(sc_ptr + (k0 + ak).to(tl.int64) * (M // 32) + m0 // 32, s, mask=(k0 + ak) < K)
    elif CS == 1:
        tl.store(sc_ptr + (m0 // 32).to(tl.int64) * K + k0 + ak, s, mask=(k0 + ak) < K)
    elif CS == 3:  # the blocked layout of the [K, M/32] scale matrix, what a native MX GEMM reads
        tl.store(sc_ptr + blocked_offset(k0 + ak, m0 // 32, M // 32), s, mask=(k0 + ak) < K)


@triton.jit
def _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, m0, k0, M, K, sxm, sxk, ROW: tl.constexpr, BK: tl.constexpr):
    """One 32-row tile: rowwise pair stored, column qdata stored transposed; returns the column scales [BK]."""
    v = load_tile(x_ptr, b, m0, k0, M, K, 0, sxm, sxk, 32, BK)
    if ROW:
        q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
        _store_tile(qr_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, False, 32, BK)
        _store_tile(sr_ptr, s, b, m0, k0 // 32, M, K // 32, False, 32, BK // 32)
    q, s = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
    _store_tile(qc_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, True, 32, BK)
    return tl.reshape(s, [BK])


@triton.jit
def _dual_join_probe(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sxm, sxk, n_k_tiles, ROW: tl.constexpr,
                     NSUB: tl.constexpr, BK: tl.constexpr):
    """NSUB 32-row tiles per program; their column scales joined in registers into [BK, NSUB] and stored
    as NSUB contiguous bytes per K row of the transposed [K, M/32] scales."""
    pid, b = tl.program_id(0), tl.program_id(1)
    mb = (pid // n_k_tiles) * (32 * NSUB)
    k0 = (pid % n_k_tiles) * BK
    s0 = _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, mb, k0, M, K, sxm, sxk, ROW, BK)
    if NSUB == 1:
        sc = tl.reshape(s0, [BK, 1])
    elif NSUB == 2:
        s1 = _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, mb + 32, k0, M, K, sxm, sxk, ROW, BK)
        sc = tl.join(s0, s1)
    else:
        s1 = _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, mb + 32, k0, M, K, sxm, sxk, ROW, BK)
        s2 = _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, mb + 64, k0, M, K, sxm, sxk, ROW, BK)
        s3 = _col_part(x_ptr, qr_ptr, sr_ptr, qc_ptr, b, mb + 96, k0, M, K, sxm, sxk, ROW, BK)
        sc = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), [BK, 4])
    ak = tl.arange(0, BK)
    sub = tl.arange(0, NSUB)
    mask = ((k0 + ak) < K)[:, None] & ((mb // 32 + sub) < M // 32)[None, :]
    tl.store(sc_ptr + (k0 + ak)[:, None].to(tl.int64) * (M // 32) + mb // 32 + sub[None, :], sc, mask=mask)


@triton.jit
def _transpose_u8(src_ptr, dst_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """dst [C, R] = src [R, C].t(), uint8."""
    pid = tl.program_id(0)
    n_c = tl.cdiv(C, BC)
    r0 = (pid // n_c) * BR
    c0 = (pid % n_c) * BC
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    mask = ((r0 + ar) < R)[:, None] & ((c0 + ac) < C)[None, :]
    t = tl.load(src_ptr + (r0 + ar)[:, None].to(tl.int64) * C + c0 + ac[None, :], mask=mask)
    tl.store(dst_ptr + (c0 + ac)[None, :].to(tl.int64) * R + r0 + ar[:, None], t, mask=mask)


def _dual_buffers(m, k):
    """Input ``x [m, k]`` bf16, rowwise ``qr, sr`` and transposed column ``qc`` byte buffers, and the bytes
    moved by the columnwise pair alone (``one``) and by both pairs (``two``)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    qr = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    sr = torch.empty(m, k // 32, dtype=torch.uint8, device="cuda")
    qc = torch.empty(k, m, dtype=torch.uint8, device="cuda")
    return x, qr, sr, qc, 2 * m * k + m * k * 33 / 32, 2 * m * k + 2 * m * k * 33 / 32


def dual_rows(copy_gbs):
    for m, k in SHAPES:
        x, qr, sr, qc, one, two = _dual_buffers(m, k)
        sc = torch.empty(k, m // 32, dtype=torch.uint8, device="cuda")
        sc_src = torch.empty(m // 32, k, dtype=torch.uint8, device="cuda")
        for name, fn, nb in (("module dual transposed", lambda: dispatch.quantize_dual(x, "rceil"), two),
                             ("module columnwise x.t()", lambda: dispatch.quantize_lastdim(x.t(), "rceil"), one)):
            print(f"| {name} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |", flush=True)
        ref = dispatch.quantize_dual(x, "rceil")

        def check(row):
            same = torch.equal(qc, ref[2].view(torch.uint8)) and torch.equal(sc, ref[3])
            same = same and (not row or (torch.equal(qr, ref[0].view(torch.uint8)) and torch.equal(sr, ref[1])))
            return "exact" if same else "DIFFERS"

        for row in (True, False):  # the transpose done three ways, column scales stored or left out
            for trans in (0, 1, 2):
                for cs in (0, 2):
                    for bk, warps in ((128, 2), (64, 1)):
                        n_k = triton.cdiv(k, bk)
                        fn = lambda: _dual_t_probe[(triton.cdiv(m, 32) * n_k,)](
                            x, qr, sr, qc, sc, m, k, *x.stride(), n_k, ROW=row, TRANS=trans, CS=cs, BK=bk,
                            num_warps=warps)
                        pct = 100 * (two if row else one) / median_ms(fn) / 1e6 / copy_gbs
                        print(f"| dual_t row={row} trans={trans} col scales {'stored' if cs == 0 else 'left out'} | "
                              f"{m}x{k} | ({bk}, {warps}) | {pct:.1f}% | {check(row) if cs == 0 else '-'} |", flush=True)
        for row in (True, False):
            for nsub in (1, 2, 4):
                for bk, warps in ((128, 2), (64, 1), (128, 1), (256, 2)):
                    n_k = triton.cdiv(k, bk)
                    fn = lambda: _dual_join_probe[(triton.cdiv(m, 32 * nsub) * n_k,)](
                        x, qr, sr, qc, sc, m, k, *x.stride(), n_k, ROW=row, NSUB=nsub, BK=bk, num_warps=warps)
                    sc.zero_()
                    try:
                        pct = 100 * (two if row else one) / median_ms(fn) / 1e6 / copy_gbs
                    except Exception as e:  # a variant that does not compile is reported, not fatal
                        print(f"| dual_join row={row} nsub={nsub} | ({bk}, {warps}) | failed: {str(e)[-300:]} |")
                        continue
                    print(f"| dual_join row={row} nsub={nsub} | {m}x{k} | ({bk}, {warps}) | {pct:.1f}% | {check(row)} |",
                          flush=True)
            for tbr, tbc, tw in ((64, 64, 4), (128, 128, 4), (64, 256, 4), (32, 128, 2)):
                def fn(tbr=tbr, tbc=tbc, tw=tw):
                    n_k = triton.cdiv(k, 128)
                    _dual_t_probe[(triton.cdiv(m, 32) * n_k,)](x, qr, sr, qc, sc_src, m, k, *x.stride(), n_k, ROW=row,
                                                               TRANS=0, CS=1, BK=128, num_warps=2)
                    _transpose_u8[(triton.cdiv(m // 32, tbr) * triton.cdiv(k, tbc),)](sc_src, sc, m // 32, k, BR=tbr,
                                                                                      BC=tbc, num_warps=tw)
                sc.zero_()
                pct = 100 * (two if row else one) / median_ms(fn) / 1e6 / copy_gbs
                print(f"| two-stage row={row} (source scales + transpose kernel) | {m}x{k} | ({tbr}, {tbc}, {tw}) | "
                      f"{pct:.1f}% | {check(row)} |", flush=True)
                tr = lambda: _transpose_u8[(triton.cdiv(m // 32, tbr) * triton.cdiv(k, tbc),)](  # noqa: E731
                    sc_src, sc, m // 32, k, BR=tbr, BC=tbc, num_warps=tw)
                print(f"| scale transpose kernel alone | {m}x{k} | ({tbr}, {tbc}, {tw}) | "
                      f"{100 * 2 * sc.numel() / median_ms(tr) / 1e6 / copy_gbs:.1f}% |", flush=True)
        del x, qr, sr, qc, sc, sc_src
        torch.cuda.empty_cache()


def blocked_rows(copy_gbs):
    """The transposed column scales written straight into the blocked layout (CS=3) against the module."""
    from mxfx.layout import blocked_numel, to_blocked

    for m, k in SHAPES:
        x, qr, sr, qc, one, two = _dual_buffers(m, k)
        sb = torch.zeros(blocked_numel(k, m // 32), dtype=torch.uint8, device="cuda")
        ref = dispatch.quantize_dual(x, "rceil")
        ref_b = to_blocked(ref[3])
        for name, fn, nb in (("module dual transposed", lambda: dispatch.quantize_dual(x, "rceil"), two),
                             ("module dual transposed + to_blocked(col scales)",
                              lambda: to_blocked(dispatch.quantize_dual(x, "rceil")[3]), two),
                             ("module columnwise x.t()", lambda: dispatch.quantize_lastdim(x.t(), "rceil"), one)):
            print(f"| {name} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |", flush=True)
        for row in (True, False):
            for trans in (0, 1):
                for bk, warps in ((128, 2), (64, 1), (128, 1), (256, 2)):
                    n_k = triton.cdiv(k, bk)
                    fn = lambda: _dual_t_probe[(triton.cdiv(m, 32) * n_k,)](
                        x, qr, sr, qc, sb, m, k, *x.stride(), n_k, ROW=row, TRANS=trans, CS=3, BK=bk, num_warps=warps)
                    pct = 100 * (two if row else one) / median_ms(fn) / 1e6 / copy_gbs
                    same = torch.equal(qc, ref[2].view(torch.uint8)) and torch.equal(sb, ref_b)
                    print(f"| dual_t blocked col scales row={row} trans={trans} | {m}x{k} | ({bk}, {warps}) | {pct:.1f}% | "
                          f"{'exact' if same else 'DIFFERS'} |", flush=True)
        del x, qr, sr, qc, sb
        torch.cuda.empty_cache()


@triton.jit
def _layout_probe(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, sxm, sxk, n_k_tiles, ROW: tl.constexpr,
                  QC_T: tl.constexpr, SR_T: tl.constexpr, SC_T: tl.constexpr, BK: tl.constexpr):
    """One [32, BK] tile per program, K tiles fastest. q_row [M, K]; s_row: SR_T 0 at [M, K/32], 1 at
    [K/32, M] storage, 2 not stored. q_col: QC_T 1 at [K, M] storage, 0 at [M, K]. s_col: SC_T 1 at
    [K, M/32] storage, 0 at [M/32, K], 2 not stored."""
    pid, b = tl.program_id(0), tl.program_id(1)
    m0 = (pid // n_k_tiles) * 32
    k0 = (pid % n_k_tiles) * BK
    v = load_tile(x_ptr, b, m0, k0, M, K, 0, sxm, sxk, 32, BK)
    am = tl.arange(0, 32)
    ak = tl.arange(0, BK)
    if ROW:
        q, s = encode_blocks(tl.reshape(v, [32, BK // 32, 32]), 2, True)
        _store_tile(qr_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, False, 32, BK)
        if SR_T < 2:
            _store_tile(sr_ptr, s, b, m0, k0 // 32, M, K // 32, SR_T == 1, 32, BK // 32)
    q, s = encode_blocks(tl.reshape(v, [1, 32, BK]), 1, True)
    _store_tile(qc_ptr, tl.reshape(q, [32, BK]), b, m0, k0, M, K, QC_T == 1, 32, BK)
    s = tl.reshape(s, [BK])
    if SC_T == 1:
        tl.store(sc_ptr + (k0 + ak).to(tl.int64) * (M // 32) + m0 // 32, s, mask=(k0 + ak) < K)
    elif SC_T == 0:
        tl.store(sc_ptr + (m0 // 32).to(tl.int64) * K + k0 + ak, s, mask=(k0 + ak) < K)


def layout_rows(copy_gbs):
    """Where each scale tensor is stored, against the module's passes; exactness checked per variant."""
    for m, k in SHAPES:
        x, qr, sr, qc, one, two = _dual_buffers(m, k)
        qs = torch.empty(m, k, dtype=torch.uint8, device="cuda")
        bufs = {("sr", 0): torch.empty(m, k // 32, dtype=torch.uint8, device="cuda"),
                ("sr", 1): torch.empty(k // 32, m, dtype=torch.uint8, device="cuda"),
                ("sc", 1): torch.empty(k, m // 32, dtype=torch.uint8, device="cuda"),
                ("sc", 0): torch.empty(m // 32, k, dtype=torch.uint8, device="cuda")}
        ref = dispatch.quantize_dual(x, "rceil")
        want = {("sr", 0): ref[1], ("sr", 1): ref[1].t(), ("sc", 1): ref[3], ("sc", 0): ref[3].t()}
        for name, fn, nb in (("module dual transposed", lambda: dispatch.quantize_dual(x, "rceil"), two),
                             ("module dual source", lambda: dispatch.quantize_dual_source(x, "rceil"), two),
                             ("module columnwise x.t()", lambda: dispatch.quantize_lastdim(x.t(), "rceil"), one)):
            print(f"| {name} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |", flush=True)
        variants = [(False, 1, 2, sc) for sc in (1, 0, 2)]  # columnwise pair alone, transposed
        variants += [(True, 1, sr, sc) for sr, sc in ((0, 1), (1, 1), (0, 0), (1, 0), (2, 2))]  # dual transposed
        variants += [(True, 0, sr, 0) for sr in (0, 1, 2)] + [(True, 0, 2, 2)]  # dual source
        for row, qc_t, sr_t, sc_t in variants:
            q_col = qc if qc_t else qs
            for bk, warps in ((64, 1), (128, 2), (128, 1)):
                n_k = triton.cdiv(k, bk)
                srb, scb = bufs.get(("sr", sr_t), sr), bufs.get(("sc", sc_t), qs)
                fn = lambda: _layout_probe[(triton.cdiv(m, 32) * n_k, 1)](  # noqa: E731
                    x, qr, srb, q_col, scb, m, k, *x.stride(), n_k, ROW=row, QC_T=qc_t, SR_T=sr_t, SC_T=sc_t,
                    BK=bk, num_warps=warps)
                pct = 100 * (two if row else one) / median_ms(fn) / 1e6 / copy_gbs
                same = torch.equal(q_col, ref[2].view(torch.uint8) if qc_t else ref[2].view(torch.uint8).t())
                same = same and (sc_t == 2 or torch.equal(scb, want[("sc", sc_t)]))
                if row:
                    same = same and torch.equal(qr, ref[0].view(torch.uint8))
                    same = same and (sr_t == 2 or torch.equal(srb, want[("sr", sr_t)]))
                lay = {0: "plain", 1: "transposed", 2: "left out"}
                print(f"| layouts row={row} q_col {'[K, M]' if qc_t else '[M, K]'} s_row {lay[sr_t] if row else '-'} "
                      f"s_col {'[K, M/32]' if sc_t == 1 else '[M/32, K]' if sc_t == 0 else 'left out'} | {m}x{k} | "
                      f"({bk}, {warps}) | {pct:.1f}% | {'exact' if same else 'DIFFERS'} |", flush=True)
        del x, qr, sr, qc, qs, bufs
        torch.cuda.empty_cache()


def halves_rows(copy_gbs):
    """The gate_up halves gap: module SwiGLU with gate/up halves of rows 2H wide, 2H + 64 wide, and separate."""
    for m, k in SHAPES:
        nbytes = 4 * m * k + m * k * 33 / 32
        gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        gp = torch.randn(m, 2 * k + 64, device="cuda", dtype=torch.bfloat16)
        g2, u2 = (torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        g, u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for name, a, b in (("separate", g, u), ("halves 2H", gu[:, :k], gu[:, k:]),
                           ("halves 2H+64", gp[:, :k], gp[:, k:2 * k]),
                           ("left halves of two tensors", g2[:, :k], u2[:, :k]),
                           ("halves, up first", gu[:, k:], gu[:, :k])):
            for save in (False, True):
                fn = lambda: dispatch.swiglu_quantize(a, b, "rceil", torch.bfloat16 if save else None, save_inputs=save)
                nb = nbytes + (2 * m * k + 2 * m * k * 33 / 32 if save else 0)
                print(f"| module swiglu {name} save={save} | {m}x{k} | - | {100 * nb / median_ms(fn) / 1e6 / copy_gbs:.1f}% |",
                      flush=True)
        del gu, gp, g2, u2, g, u
        torch.cuda.empty_cache()


def main():
    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s\n| variant | shape | tile | % of copy |\n|---|---|---|---|", flush=True)
    sections = sys.argv[1:] or ["swiglu", "halves", "dual"]
    for name in sections:
        {"swiglu": swiglu_rows, "halves": halves_rows, "dual": dual_rows, "blocked": blocked_rows,
         "layouts": layout_rows}[name](copy_gbs)


if __name__ == "__main__":
    main()
