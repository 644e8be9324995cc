"""Blocked scale layout (mxfx.numerics.layout) against its definition and torchao's to_blocked."""

import pytest
import torch

from mxfx.numerics.layout import blocked_numel, blocked_offset, from_blocked, to_blocked


def rand_scales(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8)


def test_one_tile_by_hand():
    s = rand_scales(128, 4)
    b = to_blocked(s)
    assert b.shape == (512,)
    # line i of the tile holds rows i, i+32, i+64, i+96, four scales each
    assert b[0:16].tolist() == s[0].tolist() + s[32].tolist() + s[64].tolist() + s[96].tolist()
    assert b[16:32].tolist() == s[1].tolist() + s[33].tolist() + s[65].tolist() + s[97].tolist()
    assert b[496:512].tolist() == s[31].tolist() + s[63].tolist() + s[95].tolist() + s[127].tolist()


def test_tile_order_is_row_tile_major():
    s = rand_scales(256, 8)
    b = to_blocked(s)
    # tiles: (rows 0-127, cols 0-3), (rows 0-127, cols 4-7), (rows 128-255, cols 0-3), ...
    assert b[512:516].tolist() == s[0, 4:8].tolist()
    assert b[1024:1028].tolist() == s[128, 0:4].tolist()
    assert b[1536 + 16 * 5 + 4 * 2 : 1536 + 16 * 5 + 4 * 3].tolist() == s[128 + 64 + 5, 4:8].tolist()


@pytest.mark.parametrize("rows,cols", [(128, 4), (1, 1), (96, 64), (300, 7), (1000, 128)])
def test_round_trip_and_offsets(rows, cols):
    s = rand_scales(rows, cols, seed=rows)
    b = to_blocked(s)
    assert b.numel() == blocked_numel(rows, cols) == -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert torch.equal(from_blocked(b, rows, cols), s)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(b[blocked_offset(r, c, cols)], s)


def test_padding_is_zero_and_never_leaks():
    s = rand_scales(100, 3)  # no zeros in the data
    b = to_blocked(s)
    assert (b == 0).sum() == b.numel() - s.numel()
    poisoned = b.clone()
    poisoned[poisoned == 0] = 0xFF  # padding bytes only
    assert torch.equal(from_blocked(poisoned, 100, 3), s)


def test_e8m0_dtype_kept():
    s = rand_scales(128, 4).view(torch.float8_e8m0fnu)
    b = to_blocked(s)
    assert b.dtype == torch.float8_e8m0fnu
    assert from_blocked(b, 128, 4).dtype == torch.float8_e8m0fnu


def test_noncontiguous_input():
    s = rand_scales(8, 256)
    assert torch.equal(to_blocked(s.t()), to_blocked(s.t().contiguous()))


@pytest.mark.parametrize("rows,cols", [(128, 4), (96, 64), (300, 7), (513, 130)])
def test_matches_torchao(rows, cols):
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    s = rand_scales(rows, cols, seed=cols)
    assert torch.equal(to_blocked(s), utils.to_blocked(s).reshape(-1))


def test_errors():
    with pytest.raises(ValueError, match=r"to_blocked.*\(2, 3, 4\)"):
        to_blocked(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"\(4, 4\).*float32"):
        to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"from_blocked.*\(100,\).*\[128, 4\].*512"):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 128, 4)
    with pytest.raises(TypeError, match=r"from_blocked.*bytes.*torch.float32 of shape \(512,\)"):
        from_blocked(torch.zeros(512), 128, 4)
    with pytest.raises(ValueError, match=r"from_blocked.*>= 0.*\[-1, 4\]"):
        from_blocked(torch.zeros(512, dtype=torch.uint8), -1, 4)


def test_column_major_adds_no_node_where_the_scales_have_its_strides():
    """``column_major`` gives a 1x128 scale matrix cuBLAS's strides ``(1, rows)``: a row-major one is copied (same
    values), one that has them is returned as it is, and traced (symbolic rows included) that adds no node to the
    graph: the quantize kernels write their scales column-major, and every traced view costs compile time."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mxfx.numerics.layout import column_major

    rows = torch.arange(15.0).reshape(5, 3)
    copied = column_major(rows)
    assert copied.stride() == (1, 5) and torch.equal(copied, rows)
    cols = rows.t().contiguous().t()
    assert column_major(cols) is cols
    for mode in ("real", "symbolic"):
        graph = make_fx(column_major, tracing_mode=mode)(cols).graph
        assert [n.op for n in graph.nodes] == ["placeholder", "output"], (mode, graph)
