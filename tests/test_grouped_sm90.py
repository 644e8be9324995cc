"""The warp-specialized sm90 grouped fp8_block GEMM (``mxfx.kernels.fp8_block.grouped_gemm_sm90``).

CPU: the kernel compiles for sm90 without a GPU, to FP8 ``wgmma`` (QGMMA), register reallocation between its
partitions (``setmaxnreg``), TMA loads and stores, and no spills. GPU (skips without an sm90 GPU): forward and
dgrad against the reference decode for equal, skewed, empty and unaligned groups and rows past ``offs[-1]``, both
kernels (the sm90 one and the Triton one), and which of them :func:`grouped_mm` picks.

Bound: as tests/test_block_gpu.py: the tensor cores' narrower accumulator inside each 128-K step and the FP32
summation order, ``2^-10 * (|A| @ |B|^T)``, plus half a bf16 ulp of the result for the output cast.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from mxfx.numerics import block as bf
from mxfx.kernels.fp8_block import gemm as block_gemm

from tests.helpers import SM90_GPU, gluon_sm90

triton = pytest.importorskip("triton")
sass = pytest.importorskip("tests.sass")

_TRITON = tuple(int(v) for v in triton.__version__.split(".")[:2])
_GPU = SM90_GPU


def _sm90():
    return gluon_sm90(block_gemm._sm90_kernel)


def _spills_in_k_loops(sass_text: str) -> list[str]:
    """Local-memory loads and stores (register spills) between the first and last FP8 ``wgmma`` of each math
    partition's K loop (runs of QGMMA lines, fewer than 300 SASS lines apart, taken as one loop)."""
    lines = sass_text.splitlines()
    mma = [i for i, line in enumerate(lines) if "QGMMA" in line]
    loops, start = [], mma[0]
    for prev, i in zip(mma, mma[1:] + [None]):
        if i is None or i - prev >= 300:
            loops.append((start, prev))
            start = i
    return [lines[i].strip() for a, b in loops for i in range(a, b) if "LDL" in lines[i] or "STL" in lines[i]]


WIDE = {"BLOCK_N": 256}
"""The 256-wide tile (two weight blocks a tile)."""
WIDE_TWO_BUFFERS = {"BLOCK_N": 256, "EPI_BUFS": 2}
"""The 256-wide tile with an output buffer per half (a stage fewer in the ring)."""


@pytest.mark.skipif(bool(sass.missing()), reason=sass.missing())
@pytest.mark.parametrize("block_n, epi_bufs", [(128, 1), (256, 1), (256, 2)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_kernel_compiles_for_sm90_to_fp8_wgmma_without_spills(out_dtype, block_n, epi_bufs):
    """Both tiles compile to FP8 wgmma with register reallocation and TMA; the 128-wide one spills nothing. The
    256-wide one (192 accumulator registers) spills nothing inside its K loops on Triton 3.6 (a BF16 output a few
    registers around each tile's epilogue); Triton 3.9 spills inside them, so there it is only compiled."""
    sm90 = _sm90()
    s, g, n, k = 1024, 4, 512, 1024
    a = torch.empty(s, k, dtype=torch.float8_e4m3fn)
    sa = torch.empty(k // 128, s).t()
    b = torch.empty(g, n, k, dtype=torch.float8_e4m3fn)
    sb = torch.empty(g, n // 128, k // 128)
    offs = torch.arange(1, g + 1, dtype=torch.int32) * (s // g)
    out = torch.empty(s, n, dtype=out_dtype)
    config = dict(sm90.CONFIG, BLOCK_N=block_n, EPI_BUFS=epi_bufs)
    (grid, args, kwargs), _ = sm90.launch_args(a, sa, b, sb, offs, out, config)
    assert kwargs["STAGES"] >= 2 if out_dtype == torch.float32 and epi_bufs == 2 else kwargs["STAGES"] >= 3
    c = sass.compile_sm90(sass.Launch(sm90._grouped_kernel, grid, args, kwargs))
    counts = c.counts
    # a TMA store per block of each warpgroup; with a buffer per half the wait before each store leaves the latest
    # store running ("all but one done"), else it waits for every store
    assert counts.get("UTMASTG", 0) == 2 * (block_n // 128), dict(counts)
    store_waits = re.findall(r"\bDEPBAR\.LE SB0, 0x(\d)", c.sass)
    assert store_waits.count("1") == (2 * (block_n // 128) if epi_bufs == 2 else 0), store_waits
    halves = block_n // 128
    # 4 K=32 instructions per 128-K step and 128 columns, in both math warpgroups
    assert counts.get("QGMMA", 0) >= 8 * halves, dict(counts)
    assert counts.get("HGMMA", 0) == 0 and counts.get("HMMA", 0) == 0, dict(counts)
    # one wait per 128-K step and half, not one per instruction: ptxas serializes wgmma it cannot prove safe
    assert c.sass.count("WARPGROUP.DEPBAR") * 4 <= counts["QGMMA"], "wgmma serialized"
    assert counts.get("USETMAXREG", 0) + counts.get("SETMAXNREG", 0) > 0, "no register reallocation"
    assert counts.get("UTMALDG", 0) >= 3 and counts.get("UTMASTG", 0) >= 1, dict(counts)
    if block_n == 256 and _TRITON >= (3, 7):
        return
    assert not _spills_in_k_loops(c.sass), _spills_in_k_loops(c.sass)
    if block_n == 128 or out_dtype == torch.float32:
        assert counts.get("LDL", 0) == 0 and counts.get("STL", 0) == 0, "registers spilled to local memory"
    assert c.shared <= 227 * 1024


def test_the_wide_tile_is_taken_where_it_compiles_without_spills(monkeypatch):
    """The default launch takes the 256-wide tile for GEMMs of at least 256 output columns on a Triton whose build of
    it keeps its K loops free of spills (3.6, checked by the compile test above), the 128-wide one otherwise."""
    sm90 = _sm90()
    for version, n, width in (("3.6.0", 2048, 256), ("3.6.0", 256, 256), ("3.6.0", 128, 128), ("3.9.0", 2048, 128)):
        monkeypatch.setattr(sm90.triton, "__version__", version)
        assert sm90.config_for(n) == dict(sm90.CONFIG, BLOCK_N=width), (version, n)
    assert sm90.CONFIG["BLOCK_N"] == 128  # the base configuration is left as it is


def test_forward_and_dgrad_scale_layouts_share_one_compile():
    """The forward's activation scales are column-major ``[S, K/128]`` (stride 1 along rows), the dgrad's the same
    layout of dY's and its weight scales the transposed grid: one specialization serves every layout and group count
    (each extra one is a Gluon compile, about half a second, in the first step)."""
    sass = pytest.importorskip("tests.sass")
    sm90 = _sm90()
    s, k = 1024, 1024
    a = torch.empty(s, k, dtype=torch.float8_e4m3fn)
    keys = []
    for g, n, scales_a, weight_scales in (
        (4, 512, torch.empty(k // 128, s).t(), torch.empty(4, 512 // 128, k // 128)),  # forward
        (8, 256, torch.empty(s, k // 128), torch.empty(8, k // 128, 256 // 128).transpose(1, 2)),
    ):  # other strides
        b = torch.empty(g, n, k, dtype=torch.float8_e4m3fn)
        offs = torch.arange(1, g + 1, dtype=torch.int32) * (s // g)
        (grid, args, kwargs), _ = sm90.launch_args(
            a, scales_a, b, weight_scales, offs, torch.empty(s, n, dtype=torch.bfloat16)
        )
        signature, constexprs, attrs = sass.specialize(sm90._grouped_kernel, args, kwargs)
        names = sm90._grouped_kernel.arg_names
        keep = [i for i, name in enumerate(names) if name not in ("a_desc", "b_desc", "c_desc", "N", "s_cm")]
        keys.append(
            (
                {k: v for k, v in signature.items() if k in [names[i] for i in keep]},
                {k: v for k, v in attrs.items() if k[0] in keep},
                str(constexprs),
            )
        )
    assert keys[0] == keys[1]


def schedule_reference(sizes, s, n, block_m, block_n, band, max_tiles):
    """The schedule's table in plain Python: per tile (group, first row, first column, group end), group by group
    (the tail past the last group as group G), inside a group in bands of ``band`` row blocks, row blocks fastest;
    entries past the last tile have group -1."""
    rows, start = [], 0
    ends = [min(e, s) for e in torch.tensor(sizes).cumsum(0).tolist()] + [s]
    tiles_n = -(-n // block_n)
    for g, end in enumerate(ends):
        end = max(end, start)
        tiles_m = -(-(end - start) // block_m)
        for t in range(tiles_m * tiles_n):
            b, r = divmod(t, band * tiles_n)
            height = min(tiles_m - b * band, band)
            rows.append((g, start + (b * band + r % height) * block_m, (r // height) * block_n, end))
        start = end
    assert len(rows) <= max_tiles
    return rows + [(-1,) for _ in range(max_tiles - len(rows))]


SCHEDULE_CASES = [([300, 0, 129, 7, 0, 1000], 1500, 384), ([0, 0], 40, 128), ([4096] * 3, 12288, 1024)]


def _schedule_matches(device):
    """Run the schedule kernel on ``device`` for each case and compare with :func:`schedule_reference`."""
    sm90 = block_gemm._sm90_kernel()
    for sizes, s, n in SCHEDULE_CASES:
        k = 256
        a = torch.zeros(s, k, dtype=torch.float8_e4m3fn, device=device)
        b = torch.zeros(len(sizes), n, k, dtype=torch.float8_e4m3fn, device=device)
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        out = torch.empty(s, n, dtype=torch.bfloat16, device=device)
        _, (grid, args, kwargs) = sm90.launch_args(a, a, b, b, offs, out)
        sm90._schedule_kernel[grid](*args, **kwargs)
        table, max_tiles = args[1].cpu(), args[5]
        want = schedule_reference(sizes, s, n, kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["BAND"], max_tiles)
        for t, row in enumerate(want):
            got = tuple(table[t].tolist()[: len(row)])
            assert got == row, (sizes, t, got, row)


def test_schedule_matches_its_reference_in_the_interpreter():
    from tests.helpers import run_interpreter_checks

    _sm90()
    run_interpreter_checks(__file__)


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
def test_schedule_matches_its_reference_on_the_gpu():
    _sm90()
    _schedule_matches("cuda")


def _check(out, a, sa, b, sb, offs_list):
    """Each group's rows within the bound of the reference decode; rows past the last group exactly zero."""
    start = 0
    for e, end in enumerate(offs_list):
        if end > start:
            x = bf.dequantize_values(a[start:end].cpu(), sa[start:end].cpu(), (-1,))
            w = bf.dequantize_values(b[e].cpu(), sb[e].cpu(), (-2, -1))
            ref = x @ w.t()
            bound = 2.0**-10 * (x.abs() @ w.abs().t()) + ref.abs() * 2.0**-8
            err = (out[start:end].float().cpu() - ref).abs()
            assert (err <= bound).all(), f"group {e}: max excess {(err - bound).max().item():.3e}"
        start = end
    assert (out[start:] == 0).all(), "rows past offs[-1] must be zeros"


CASES = {
    "equal": ([512] * 8, 1024, 1024),
    "skewed, empty, unaligned": ([1000, 0, 129, 7, 0, 300, 2048, 1], 1024, 768),
    "one group, tail rows": ([777], 2048, 256),
    "many tiles per program": ([1024] * 16, 512, 2048),
    "K not a multiple of 128": ([300, 200, 0, 64], 336, 384),
}


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", ["sm90", "sm90-wide", "sm90-wide-two-buffers", "triton"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_forward_and_dgrad_match_the_reference(case, kernel, out_dtype):
    from mxfx.kernels.fp8_block import grouped_gemm_triton

    sizes, k, n = CASES[case]
    launch = {
        "sm90": _sm90().grouped_mm,
        "sm90-wide": functools.partial(_sm90().grouped_mm, config=dict(_sm90().CONFIG, **WIDE)),
        "sm90-wide-two-buffers": functools.partial(_sm90().grouped_mm, config=dict(_sm90().CONFIG, **WIDE_TWO_BUFFERS)),
        "triton": grouped_gemm_triton.grouped_mm,
    }[kernel]
    gen = torch.Generator().manual_seed(len(sizes) * k + n)
    s = sum(sizes) + 37  # rows past offs[-1]
    offs_list = torch.tensor(sizes).cumsum(0).tolist()
    offs = torch.tensor(offs_list, dtype=torch.int32, device="cuda")
    x = torch.randn(s, k, generator=gen) * 3
    w = torch.randn(len(sizes), n, k, generator=gen) * 0.05
    a, sa = bf.quantize_1x128(x.cuda())
    b, sb = bf.quantize_128x128(w.cuda())
    torch.full((s, max(n, k)), float("nan"), device="cuda", dtype=out_dtype)  # freed: the output reuses it
    _check(launch(a, sa, b, sb, offs, out_dtype), a, sa, b, sb, offs_list)
    dy = torch.randn(s, n, generator=gen)
    a2, sa2 = bf.quantize_1x128(dy.cuda())
    bt, sbt = b.transpose(1, 2).contiguous(), sb.transpose(1, 2).contiguous()  # the dgrad copy of the weight
    _check(launch(a2, sa2, bt, sbt, offs, out_dtype), a2, sa2, bt, sbt, offs_list)


def test_formats_name_their_grouped_kernels(monkeypatch):
    """fp8_block names the kernel its grouped GEMM runs (the precision map's note); a format with one kernel
    names none."""
    from mxfx import formats

    fp8 = formats.get("fp8_block")
    assert fp8.grouped_kernel(torch.device("cpu"), 1024, 1024, torch.bfloat16) == "reference"
    assert formats.get("mxfp8").grouped_kernel(torch.device("cpu"), 1024, 1024, torch.bfloat16) == ""
    if _GPU:
        cuda = torch.device("cuda")
        monkeypatch.delenv(block_gemm.SM90_ENV, raising=False)
        assert fp8.grouped_kernel(cuda, 2048, 1024, torch.bfloat16) == "sm90 warp-specialized"
        assert fp8.grouped_kernel(cuda, 7168, 1024, torch.bfloat16) == "Triton"  # above SM90_MAX_K
        assert fp8.grouped_kernel(cuda, 2056, 1028, torch.bfloat16) == "Triton"  # output rows not whole 16 bytes
        monkeypatch.setenv(block_gemm.SM90_ENV, "1")
        assert fp8.grouped_kernel(cuda, 7168, 1024, torch.bfloat16) == "sm90 warp-specialized"


@pytest.mark.skipif(not _GPU, reason="needs an sm90 GPU")
def test_grouped_mm_picks_the_kernel_by_k_or_the_switch_and_falls_back_where_it_cannot(monkeypatch):
    sm90 = _sm90()
    a, sa = bf.quantize_1x128(torch.randn(256, 512, device="cuda"))
    b, sb = bf.quantize_128x128(torch.randn(2, 256, 512, device="cuda"))
    assert sm90.supported(a, b, torch.bfloat16)
    monkeypatch.delenv(block_gemm.SM90_ENV, raising=False)
    assert block_gemm.grouped_kernel_name(a, b, torch.bfloat16) == "sm90 warp-specialized"  # K 512: the default
    monkeypatch.setattr(block_gemm, "SM90_MAX_K", 256)
    assert block_gemm.grouped_kernel_name(a, b, torch.bfloat16) == "Triton"  # K above the default's limit
    monkeypatch.setenv(block_gemm.SM90_ENV, "1")
    assert block_gemm.grouped_kernel_name(a, b, torch.bfloat16) == "sm90 warp-specialized"
    monkeypatch.setenv(block_gemm.SM90_ENV, "0")
    assert block_gemm.grouped_kernel_name(a, b, torch.bfloat16) == "Triton"
    monkeypatch.setenv(block_gemm.SM90_ENV, "1")
    w = torch.randn(2, 512, 256, device="cuda").transpose(1, 2)  # [G, N, K] as a strided view: no TMA box reads it
    bt, sbt = bf.quantize_128x128(w)
    bt = bt.transpose(1, 2).contiguous().transpose(1, 2)
    assert not bt.is_contiguous()
    assert block_gemm.grouped_kernel_name(a, bt, torch.bfloat16) == "Triton"
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    _check(block_gemm.grouped_mm(a, sa, bt, sbt, offs), a, sa, bt, sbt, [100, 256])  # the fallback's product
    monkeypatch.setenv(block_gemm.SM90_ENV, "yes please")
    with pytest.raises(ValueError, match="MXFX_GROUPED_SM90"):
        block_gemm.grouped_kernel_name(a, b, torch.bfloat16)


if __name__ == "__main__" and "--interpret" in __import__("sys").argv:  # run_interpreter_checks' subprocess
    _schedule_matches("cpu")
    print("schedule: interpreter checks passed")
