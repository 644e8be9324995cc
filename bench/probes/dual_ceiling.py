"""Probe: what the dual pass's memory traffic alone reaches, with the MX arithmetic taken out.

Usage: ``python bench/probes/dual_ceiling.py`` on a GPU; ``python bench/probes/dual_ceiling.py sass`` (no GPU) counts
each variant's sm90 SASS instructions and registers.

Each variant moves the bytes the module's dual pass moves, through the same loads, stores and layouts
(``dual._store_tile`` / ``load_tile``, the same tiles, ``num_warps`` and register cap), but its "encode" is the high
byte of each bf16 value and its scales are zeros: no amax, no rounding. Side by side with the module's pass in one run,
at the benchmark shapes, as % of a 2 GiB copy with the same byte count (bf16 read once, two MX pairs written):

* ``transposed``: the columnwise pair stored [K, M], the x^T tile read a second time (``quantize_dual``);
* ``source``: the columnwise pair in the source layout (``quantize_dual_source``);
* ``columnwise alone``: the transposed columnwise pair without the row pass, against ``quantize_lastdim(x.t())``.

If the transposed movement alone sits near the module's figure, the pass is bound by its access pattern, not by
its arithmetic, and a faster encode cannot close the gap to the goal.
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

from mxfx.kernels import dual, quantize  # noqa: E402
from mxfx.kernels.dual import _store_tile  # noqa: E402
from mxfx.kernels.mx_block import CVT_ALL, encode_blocks, load_tile, tile_origin, to_f32  # noqa: E402
from variant_table import probe_main, same_bytes, time_variants, use_tma_scratch  # noqa: E402

CVT = tl.constexpr(CVT_ALL)  # the module's transposed pass's conversion forms (dual.CVT)


@triton.jit
def _move(v, q_ptr, s_ptr, b, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr, MATH: tl.constexpr,
          TMA: tl.constexpr):
    """Store the fp32 tile ``v [BR, BC]`` (bf16 values, row blocks along C) as ``dual._encode_rows`` does. MATH: its
    real E4M3 bytes and scales (rceil); else the high byte of each value and zero scales. TMA: the qdata go out through a
    tensor-descriptor store (the TMA unit writes the [BR, BC] box from shared memory)."""
    if MATH:
        q3, s = encode_blocks(tl.reshape(v, [BR, BC // 32, 32]), 2, True, CVT)
        q = tl.reshape(q3, [BR, BC])
    else:
        q = (v.to(tl.int32, bitcast=True) >> 24).to(tl.uint8)  # the bf16's high byte
        s = tl.zeros([BR, BC // 32], tl.uint8)
    if TMA:
        desc = tl.make_tensor_descriptor(q_ptr, shape=[R, C], strides=[C, 1], block_shape=[BR, BC])
        desc.store([r0, c0], q)
    else:
        _store_tile(q_ptr, q, b, r0, c0, R, C, False, True, BR, BC)
    _store_tile(s_ptr, s, b, r0, c0 // 32, R, C // 32, True, True, BR, BC // 32)


@triton.jit
def _dual_move(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, n_k_tiles, TRANSPOSED: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr, MATH: tl.constexpr = False, TMA: tl.constexpr = False, ROW: tl.constexpr = True,
               TRANS: tl.constexpr = False):
    """Contiguous bf16 ``x [M, K]``, tiles dividing it; outputs shaped as the module's pass writes them. ROW False
    (with TRANSPOSED): the columnwise pair alone, what ``quantize_lastdim(x.t())`` moves. TRANS: the x^T tile is
    ``tl.trans`` of the bf16 tile already loaded (the compiler transposes it through shared memory), not a re-read."""
    b, m0, k0 = tile_origin(n_k_tiles, BM, BK)
    b = b * 0
    if TRANS:
        raw16 = tl.load(x_ptr + (m0 + tl.arange(0, BM)[:, None]).to(tl.int64) * K + k0 + tl.arange(0, BK)[None, :])
        raw = to_f32(raw16, CVT)
    if ROW:
        if not TRANS:
            raw = load_tile(x_ptr, b, m0, k0, M, K, 0, K, 1, BM, BK, True, False, CVT)
        _move(raw, qr_ptr, sr_ptr, b, m0, k0, M, K, BM, BK, MATH, TMA)
    if TRANSPOSED:
        if TRANS:
            rt = to_f32(tl.trans(raw16), CVT)
        else:
            rt = load_tile(x_ptr, b, k0, m0, K, M, 0, 1, K, BK, BM, True, False, CVT)
        _move(rt, qc_ptr, sc_ptr, b, k0, m0, K, M, BK, BM, MATH, TMA)
    else:
        q = (raw.to(tl.int32, bitcast=True) >> 24).to(tl.uint8)
        _store_tile(qc_ptr, q, b, m0, k0, M, K, False, True, BM, BK)
        _store_tile(sc_ptr, tl.zeros([BM // 32, BK], tl.uint8), b, m0 // 32, k0, M // 32, K, False, True, BM // 32, BK)


VARIANTS = [  # (name, transposed, (BM, BK, warps), maxnreg, math, tma[, trans])
    ("movement only, transposed (32, 64, 1) cap 96", True, (32, 64, 1), 96, False, False),
    ("movement only, transposed (64, 64, 2)", True, (64, 64, 2), None, False, False),
    ("movement only, transposed (128, 64, 4)", True, (128, 64, 4), None, False, False),
    ("movement only, transposed (32, 64, 1) cap 96, TMA stores", True, (32, 64, 1), 96, False, True),
    ("movement only, transposed (64, 64, 2), TMA stores", True, (64, 64, 2), None, False, True),
    ("movement only, transposed (128, 64, 4), TMA stores", True, (128, 64, 4), None, False, True),
    ("movement only, source (32, 64, 1)", False, (32, 64, 1), None, False, False),
    ("movement only, source (32, 64, 1), TMA stores", False, (32, 64, 1), None, False, True),
    ("MX, transposed (32, 64, 1) cap 96", True, (32, 64, 1), 96, True, False),
    ("MX, transposed (32, 64, 1) cap 96, TMA stores", True, (32, 64, 1), 96, True, True),
    ("MX, transposed (32, 64, 1), TMA stores", True, (32, 64, 1), None, True, True),
    ("movement only, transposed (32, 64, 1) cap 96, trans", True, (32, 64, 1), 96, False, False, True),
    ("movement only, transposed (32, 64, 1), trans", True, (32, 64, 1), None, False, False, True),
    ("MX, transposed (32, 64, 1) cap 96, trans", True, (32, 64, 1), 96, True, False, True),
    ("MX, transposed (32, 64, 1) cap 128, trans", True, (32, 64, 1), 128, True, False, True),
]


COLUMNWISE_TILES = [(32, 128, 1), (32, 64, 1), (64, 64, 2)]  # (BM, BK, warps); the module's is (32, 128, 1)


def _kernel(maxnreg, warps):
    if maxnreg is None:
        return _dual_move, {"num_warps": warps}
    return triton.autotune([triton.Config({}, num_warps=warps, maxnreg=maxnreg)], key=[])(_dual_move), {}


def run(x, transposed, cfg, maxnreg, math, tma, trans=False, row=True):
    """``(q_row, s_row, q_col, s_col)`` shaped as ``dual.quantize_dual`` (or ``_source``) returns them."""
    M, K = x.shape
    bm, bk, warps = cfg
    dev = x.device
    q_row = torch.empty(M, K, dtype=torch.uint8, device=dev)
    s_row = torch.empty(K // 32, M, dtype=torch.uint8, device=dev)
    q_col = torch.empty((K, M) if transposed else (M, K), dtype=torch.uint8, device=dev)
    s_col = torch.empty(M // 32, K, dtype=torch.uint8, device=dev)
    if tma:
        use_tma_scratch()
    kernel, kw = _kernel(maxnreg, warps)
    kernel[((M // bm) * (K // bk),)](x, q_row, s_row, q_col, s_col, M, K, K // bk, TRANSPOSED=transposed, BM=bm,
                                     BK=bk, MATH=math, TMA=tma, ROW=row, TRANS=trans, **kw)
    return q_row, s_row.t(), q_col if transposed else q_col.t(), s_col.t()


def sass():
    import sass_sm90

    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    out = torch.empty(256, 2048, dtype=torch.uint8)
    for name, transposed, (bm, bk, warps), maxnreg, math, tma, *trans in VARIANTS:
        launch = sass_sm90.Launch(_dual_move, (1,), (x, out, out, out, out, 256, 2048, 2048 // bk),
                                  {"TRANSPOSED": transposed, "BM": bm, "BK": bk, "MATH": math, "TMA": tma, "ROW": True,
                                   "TRANS": bool(trans and trans[0]), "num_warps": warps, "maxnreg": maxnreg})
        c = sass_sm90.compile_sm90(launch)
        mem = ", ".join(f"{n} {op}" for op, n in sorted(c.memory.items()))
        print(f"{name}: {c.total} instructions, {c.registers} registers, {c.counts.get('UTMASTG', 0)} TMA stores; "
              f"{mem}", flush=True)


def time_all():
    def check(got, ref):
        """MX variants: byte-equal to the module's transposed pass. Movement only: the high byte of every bf16
        value in both qdata outputs (columnwise compared in its logical [K, M] orientation)."""
        x, math, out = got
        if math:
            return same_bytes(out, ref)
        hi = (x.view(torch.int16) >> 8).to(torch.uint8)
        return torch.equal(out[0], hi) and torch.equal(out[2], hi.t())

    time_variants("module source", lambda x: dual.quantize_dual_source(x, "rceil"), [], check)
    time_variants("module transposed", lambda x: dual.quantize_dual(x, "rceil"),
                  [(name, lambda x, v=v: (x, v[3], run(x, *v))) for name, *v in VARIANTS], check)

    def check_col(got, _ref):
        x, out = got
        return torch.equal(out[2], (x.view(torch.int16) >> 8).to(torch.uint8).t())

    time_variants("module columnwise (x.t())", lambda x: quantize.quantize_lastdim(x.t(), "rceil"),
                  [(f"movement only, columnwise alone {cfg}", lambda x, cfg=cfg: (x, run(x, True, cfg, None, False,
                                                                                       False, row=False)))
                   for cfg in COLUMNWISE_TILES], check_col, per_elem=2 + 33 / 32)


if __name__ == "__main__":
    probe_main("dual_ceiling", time_all, sass=sass)
