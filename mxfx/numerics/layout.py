"""Blocked ("swizzled") E8M0 scale layout consumed by block-scaled GEMMs.

Follows the cuBLAS "1D block scaling factors layout" (cuBLAS docs,
§ "1D Block Scaling Factors Layout", also used by CUTLASS for sm100 MX GEMMs):
a ``[rows, cols]`` scale matrix (rows = M or N of the GEMM operand, cols = K / 32)
is cut into tiles of 128 rows x 4 columns. Tiles are stored one after another,
row-tile major (all column tiles of rows 0..127 first), 512 bytes each. Inside a
tile, scale ``(r, c)`` with ``r = 32 * g + i`` (row group ``g`` in 0..3, ``i`` in
0..31) sits at byte::

    i * 16 + g * 4 + c

i.e. the tile is read as 32 lines of 16 bytes, line ``i`` holding rows
``i, i + 32, i + 64, i + 96`` with their 4 scales each. Rows are padded to a
multiple of 128 and columns to a multiple of 4; padding bytes are zero.

Also the other layout helpers: :func:`is_blocked` (are these scales in the blocked layout),
:func:`group_padding` (token groups padded to whole 32-row blocks, with their ends :func:`padded_group_ends`) and
:func:`column_major` (a scale matrix with the strides cuBLAS reads).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mxfx.numerics.mx import BLOCK_SIZE

TILE_ROWS = 128
"""Rows of scales per tile (four groups of 32)."""

TILE_COLS = 4
"""Scale columns per tile (4 x 32 = 128 values of K)."""

ROW_GROUP = 32
"""Rows per group inside a tile; group g of a tile holds rows 32g .. 32g+31."""


def column_major(t: torch.Tensor) -> torch.Tensor:
    """2D ``t`` with column-major strides ``(1, rows)`` (how cuBLAS reads 1x128 scales): ``t`` itself where its
    strides are known to be those already (a quantize kernel writes its scales so), else ``t.t().contiguous().t()``.
    The strides are compared without a guard on a symbolic size, and a traced ``t`` that is column-major adds no
    node to the graph."""
    if statically_known_true(t.stride(0) == 1) and statically_known_true(t.stride(1) == t.shape[0]):
        return t
    return t.t().contiguous().t()


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def blocked_numel(rows: int, cols: int) -> int:
    """Bytes of the blocked layout of a ``[rows, cols]`` scale matrix (padding included)."""
    return _ceil_to(rows, TILE_ROWS) * _ceil_to(cols, TILE_COLS)


def new_blocked_scales(rows, cols, lead: tuple = (), device=None) -> torch.Tensor:
    """Output buffer for kernels that write a ``[rows, cols]`` scale matrix (per leading index) straight into
    the blocked layout of this module (the scale layout of Blackwell block-scaled GEMMs; padding bytes zero).

    Kernels write only the scales, so the padding bytes must be zero: the buffer is zero-filled (one memset
    pass over it) where the layout pads, i.e. rows not a multiple of 128 or cols not a multiple of 4, and left
    uninitialized where every byte is a scale. Symbolic sizes (traced with dynamic shapes) always get zeros,
    so no guard on them is installed.

    Args:
        rows, cols: the scale matrix's shape (cols = K / 32), ints or SymInts, >= 0.
        lead: leading dims (e.g. ``(B,)`` for one matrix per batch).
        device: where to allocate.

    Returns:
        uint8 tensor ``[*lead, blocked_numel(rows, cols)]``.
    """
    numel = blocked_numel(rows, cols)
    unpadded = isinstance(rows * cols, int) and numel == rows * cols
    return (torch.empty if unpadded else torch.zeros)((*lead, numel), dtype=torch.uint8, device=device)


def blocked_offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Byte offset of scale ``(r, c)`` in the blocked layout of a matrix with ``cols`` columns.

    ``r``, ``c``: integer tensors (broadcastable). Used by the tests and mirrored by the
    Triton kernels that write scales straight into this layout.
    """
    col_tiles = _ceil_to(cols, TILE_COLS) // TILE_COLS
    tile = (r // TILE_ROWS) * col_tiles + c // TILE_COLS
    inner = (r % ROW_GROUP) * (ROW_GROUP // 2) + ((r % TILE_ROWS) // ROW_GROUP) * TILE_COLS + c % TILE_COLS
    return tile * (TILE_ROWS * TILE_COLS) + inner


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Rearrange a ``[rows, cols]`` scale matrix into the blocked layout.

    Args:
        scales: 2D ``uint8`` (E8M0 bytes) or ``float8_e8m0fnu`` tensor ``[rows, cols]``,
            any strides; cols is K / 32 of the operand it scales.

    Returns:
        1D tensor of ``scales.dtype`` with ``ceil(rows/128)*128 * ceil(cols/4)*4`` bytes,
        tiles in the order described in the module docstring, padding zero.

    Raises:
        ValueError: ``scales`` is not 2D.
        TypeError: ``scales`` is not uint8 / float8_e8m0fnu.
    """
    if scales.dim() != 2:
        raise ValueError(
            f"mxfx.numerics.layout.to_blocked: expected a 2D [rows, cols] scale matrix, "
            f"got shape {tuple(scales.shape)}; flatten leading dims first (scales.reshape(-1, scales.shape[-1]))"
        )
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(
            f"mxfx.numerics.layout.to_blocked: scales of shape {tuple(scales.shape)} have dtype {scales.dtype}; "
            f"expected uint8 E8M0 bytes or torch.float8_e8m0fnu"
        )
    rows, cols = scales.shape
    prows, pcols = _ceil_to(rows, TILE_ROWS), _ceil_to(cols, TILE_COLS)
    raw = scales.view(torch.uint8)
    padded = raw.new_zeros(prows, pcols)
    padded[:rows, :cols] = raw
    # [row tile, group g, line i, col tile, c] -> [row tile, col tile, line i, group g, c]
    tiles = padded.view(prows // TILE_ROWS, TILE_ROWS // ROW_GROUP, ROW_GROUP, pcols // TILE_COLS, TILE_COLS)
    out = tiles.permute(0, 3, 2, 1, 4).reshape(-1)
    return out.view(scales.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: recover the ``[rows, cols]`` scale matrix.

    Args:
        blocked: tensor of ``blocked_numel(rows, cols)`` uint8 / float8_e8m0fnu bytes, any
            shape (it is flattened).
        rows, cols: the logical scale-matrix shape; padding is dropped.

    Returns:
        contiguous ``[rows, cols]`` tensor of ``blocked.dtype``.

    Raises:
        TypeError: ``blocked`` is not of a 1-byte dtype (E8M0 scales are bytes).
        ValueError: negative ``rows`` or ``cols``, or ``blocked`` does not hold exactly
            ``blocked_numel(rows, cols)`` bytes.
    """
    if blocked.element_size() != 1:
        raise TypeError(
            f"mxfx.numerics.layout.from_blocked: blocked scales must be bytes (uint8 or float8_e8m0fnu), got "
            f"{blocked.dtype} of shape {tuple(blocked.shape)}"
        )
    if rows < 0 or cols < 0:
        raise ValueError(f"mxfx.numerics.layout.from_blocked: rows and cols must be >= 0, got [{rows}, {cols}]")
    prows, pcols = _ceil_to(rows, TILE_ROWS), _ceil_to(cols, TILE_COLS)
    if blocked.numel() != prows * pcols:
        raise ValueError(
            f"mxfx.numerics.layout.from_blocked: blocked scales of shape {tuple(blocked.shape)} hold {blocked.numel()} "
            f"bytes; a [{rows}, {cols}] matrix needs {prows} x {pcols} = {prows * pcols} (rows padded to "
            f"{TILE_ROWS}, cols to {TILE_COLS})"
        )
    raw = blocked.reshape(-1).view(torch.uint8)
    tiles = raw.view(prows // TILE_ROWS, pcols // TILE_COLS, ROW_GROUP, TILE_ROWS // ROW_GROUP, TILE_COLS)
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(prows, pcols)
    return padded[:rows, :cols].contiguous().view(blocked.dtype)


def is_blocked(qdata: torch.Tensor, scales: torch.Tensor) -> bool:
    """True when ``scales`` of the 2D ``qdata [R, K]`` are already in the blocked layout: 1D with
    ``blocked_numel(R, K/32)`` bytes, as ``mxfx.kernels.mx.device_path.quantize_dual_blocked`` writes them."""
    return (
        scales.dim() == 1
        and qdata.dim() == 2
        and scales.numel() == blocked_numel(qdata.shape[0], qdata.shape[1] // BLOCK_SIZE)
    )


def padded_group_ends(offs: torch.Tensor) -> torch.Tensor:
    """int64 cumulative group ends after padding every group of ``offs`` (int32 cumulative ends) to a multiple of
    32 rows: the group ends of :func:`group_padding`'s padded buffer."""
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.cumsum((sizes + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE, 0)


def group_padding(offs: torch.Tensor, rows: int):
    """Row map that pads every group of rows to a multiple of 32 rows (an MX block never mixes two groups).

    Args:
        offs: int32 ``[E]`` cumulative group ends; rows: S, the number of input rows.

    Returns:
        ``(dest, padded_offs, capacity)``: ``dest [S]`` int64 destination row of each
        input row (rows past ``offs[-1]`` go to a trailing scratch block no group
        reads), ``padded_offs [E]`` int32 group ends in the padded buffer, and the
        static buffer size ``capacity = S + 31 E + 32`` rounded up to 32.
    """
    e = offs.shape[0]
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_ends = padded_group_ends(offs)
    padded = torch.diff(padded_ends, prepend=padded_ends.new_zeros(1))
    capacity = (rows + (BLOCK_SIZE - 1) * e + BLOCK_SIZE + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    r = torch.arange(rows, device=offs.device)
    gid = torch.searchsorted(ends, r, right=True)
    valid = gid < e
    gid = gid.clamp(max=e - 1)
    dest = r - (ends - sizes)[gid] + (padded_ends - padded)[gid]
    dest = torch.where(valid, dest, capacity - BLOCK_SIZE + (r % BLOCK_SIZE))
    return dest, padded_ends.to(torch.int32), capacity


def check_group_ends(ends: list[int], rows: int, op: str, operand: str = "x") -> None:
    """Raise ValueError naming ``op`` unless the cumulative group ends ``ends`` (``offs`` read on the host, as
    ``torch._grouped_mm`` takes them) are non-negative, non-decreasing and at most ``rows``, the rows of the
    grouped ``operand`` (its name in the message)."""
    if any(b < a for a, b in zip([0] + ends, ends)) or (ends and ends[-1] > rows):
        raise ValueError(
            f"{op}: offs {ends} must be non-decreasing cumulative group ends of at most the {rows} rows "
            f"of {operand}, as torch._grouped_mm takes them"
        )
