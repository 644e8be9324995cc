"""Movement-only variants of the MX kernels' access patterns: the ceiling each kernel is rated against.

A movement-only variant issues the loads and stores of a kernel's access pattern with no MX arithmetic: its
"encode" is each value's high byte, its scales zeros. What it reaches, as % of a 2 GiB copy, is the most the
pattern can move in Triton on this GPU; ``bench/mx_kernels.py`` times it in the same run as the kernel and prints
both (goal: each kernel within 2 points of its own ceiling). Two patterns:

* :func:`stream`: flat streams, each input byte read once, H 16-bit and Q byte outputs of the same length
  (the row-wise, blocked, dequantize, SwiGLU, route-weight and source-layout passes).
* :func:`tiles`: the dual passes' tiles (``mxfx.kernels.mx.dual``): a ``[BM, BK]`` bf16 tile read, its rowwise bytes
  stored, and the x^T tile re-read and stored transposed ``[K, M]`` (or, ``transposed=False``, in the source layout);
  ``row=False`` is the columnwise pass alone.

Each returns ``(fn, bytes)``: a callable running the best tile of a few is chosen by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxfx.kernels.mx.dual import _store_tile
from mxfx.kernels.mx.blocks import CONVERT_ALL, load_tile, tile_origin

STREAM_TILES = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]  # (values per program, warps)
TRANSPOSED_TILES = [(32, 64, 1, 96), (64, 64, 2, None), (128, 64, 4, None)]  # (BM, BK, warps, register cap)
COLUMNWISE_TILES = [(32, 128, 1, None), (32, 64, 1, None), (64, 64, 2, None)]
SOURCE_TILES = [(32, 64, 1, None), (32, 128, 2, None)]
CONVERT = tl.constexpr(CONVERT_ALL)  # the conversion forms of the module's transposed pass


@triton.jit
def _stream(x_ptr, h0, h1, q0, q1, q2, H: tl.constexpr, Q: tl.constexpr, BLOCK: tl.constexpr):
    """Read ``x`` once; write H 16-bit and Q byte outputs of the same length (a value's bf16 and its high byte)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs).to(tl.float32)
    if H >= 1:
        tl.store(h0 + offs, v.to(tl.bfloat16))
    if H >= 2:
        tl.store(h1 + offs, (-v).to(tl.bfloat16))
    q = (v.to(tl.int32, bitcast=True) >> 24).to(tl.uint8)
    if Q >= 1:
        tl.store(q0 + offs, q)
    if Q >= 2:
        tl.store(q1 + offs, q ^ 1)
    if Q >= 3:
        tl.store(q2 + offs, q ^ 2)


@triton.jit
def _tiles(
    x_ptr,
    qr_ptr,
    sr_ptr,
    qc_ptr,
    sc_ptr,
    M,
    K,
    n_k_tiles,
    TRANSPOSED: tl.constexpr,
    ROW: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Contiguous bf16 ``x [M, K]``, tiles dividing it; the dual pass's stores with high bytes and zero scales."""
    b, m0, k0 = tile_origin(n_k_tiles, BM, BK)
    b = b * 0
    if ROW:
        v = load_tile(x_ptr, b, m0, k0, M, K, 0, K, 1, BM, BK, True, False, CONVERT)
        _store_tile(qr_ptr, (v.to(tl.int32, bitcast=True) >> 24).to(tl.uint8), b, m0, k0, M, K, False, True, BM, BK)
        _store_tile(sr_ptr, tl.zeros([BM, BK // 32], tl.uint8), b, m0, k0 // 32, M, K // 32, True, True, BM, BK // 32)
    if TRANSPOSED:
        vt = load_tile(x_ptr, b, k0, m0, K, M, 0, 1, K, BK, BM, True, False, CONVERT)
        _store_tile(qc_ptr, (vt.to(tl.int32, bitcast=True) >> 24).to(tl.uint8), b, k0, m0, K, M, False, True, BK, BM)
        _store_tile(sc_ptr, tl.zeros([BK, BM // 32], tl.uint8), b, k0, m0 // 32, K, M // 32, True, True, BK, BM // 32)
    else:
        q = (v.to(tl.int32, bitcast=True) >> 24).to(tl.uint8)
        _store_tile(qc_ptr, q, b, m0, k0, M, K, False, True, BM, BK)
        _store_tile(sc_ptr, tl.zeros([BM // 32, BK], tl.uint8), b, m0 // 32, k0, M // 32, K, False, True, BM // 32, BK)


def stream(n: int, in_dtype: torch.dtype, h: int, q: int):
    """Movement-only flat stream of ``n`` values: ``[(fn, bytes)]`` per tile of :data:`STREAM_TILES`."""
    x = (
        torch.randn(n, device="cuda").to(in_dtype)
        if in_dtype.is_floating_point
        else torch.randint(0, 255, (n,), device="cuda", dtype=in_dtype)
    )
    hs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(h)]
    qs = [torch.empty(n, device="cuda", dtype=torch.uint8) for _ in range(q)]
    outs = (hs + [x] * 2)[:2] + (qs + [x] * 3)[:3]  # absent outputs: the input as a placeholder pointer
    nbytes = n * (x.element_size() + 2 * h + q)
    return [
        (lambda b=block, w=warps: _stream[(n // b,)](x, *outs, H=h, Q=q, BLOCK=b, num_warps=w), nbytes)
        for block, warps in STREAM_TILES
        if n % block == 0
    ]


def _launcher(maxnreg, warps):
    if maxnreg is None:
        return _tiles, {"num_warps": warps}
    return triton.autotune([triton.Config({}, num_warps=warps, maxnreg=maxnreg)], key=[])(_tiles), {}


def tiles(m: int, k: int, *, transposed: bool, row: bool = True):
    """Movement-only dual tiles over a bf16 ``[m, k]``: ``[(fn, bytes)]`` per tile of the pattern's list."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q_row = torch.empty(m, k, dtype=torch.uint8, device="cuda")
    s_row = torch.empty(k // 32, m, dtype=torch.uint8, device="cuda")
    q_col = torch.empty((k, m) if transposed else (m, k), dtype=torch.uint8, device="cuda")
    s_col = torch.empty(m // 32, k, dtype=torch.uint8, device="cuda")
    nbytes = 2 * m * k + (2 if row else 1) * m * k * 33 / 32
    options = TRANSPOSED_TILES if transposed and row else COLUMNWISE_TILES if transposed else SOURCE_TILES
    out = []
    for bm, bk, warps, maxnreg in options:
        if m % bm or k % bk:
            continue
        kernel, kw = _launcher(maxnreg, warps)
        out.append(
            (
                lambda kernel=kernel, kw=kw, bm=bm, bk=bk: kernel[((m // bm) * (k // bk),)](
                    x, q_row, s_row, q_col, s_col, m, k, k // bk, TRANSPOSED=transposed, ROW=row, BM=bm, BK=bk, **kw
                ),
                nbytes,
            )
        )
    return out


def check(m: int = 256, k: int = 128) -> None:
    """The movement variants write what they claim (the high byte of every value), on a GPU or under
    ``TRITON_INTERPRET=1``: a variant that moved fewer bytes would flatter the ceiling."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    hi = (x.view(torch.int16) >> 8).to(torch.uint8)
    q_row, q_col = torch.empty(m, k, dtype=torch.uint8, device=dev), torch.empty(k, m, dtype=torch.uint8, device=dev)
    s_row, s_col = (
        torch.empty(k // 32, m, dtype=torch.uint8, device=dev),
        torch.empty(m // 32, k, dtype=torch.uint8, device=dev),
    )
    _tiles[((m // 32) * (k // 64),)](
        x, q_row, s_row, q_col, s_col, m, k, k // 64, TRANSPOSED=True, ROW=True, BM=32, BK=64
    )
    assert torch.equal(q_row, hi) and torch.equal(q_col, hi.t()), "movement tiles: wrong bytes"
    h0, q0 = torch.empty(m * k, dtype=torch.bfloat16, device=dev), torch.empty(m * k, dtype=torch.uint8, device=dev)
    _stream[(m * k // 2048,)](x.reshape(-1), h0, h0, q0, q0, q0, H=1, Q=1, BLOCK=2048)
    assert torch.equal(h0, x.reshape(-1)) and torch.equal(q0, hi.reshape(-1)), "movement stream: wrong bytes"
