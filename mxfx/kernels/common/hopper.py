"""What mxfx's warp-specialized Gluon kernels for Hopper (sm90) share: the Triton releases they were checked with,
the TMA copies under their names in those releases, the registers a math warpgroup and the producer warp take,
and the shared memory one program may use. Importing it needs a Triton with Gluon's Hopper API (ImportError
otherwise: callers then take their Triton kernels)."""

from __future__ import annotations

import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

TESTED_TRITON = ("3.6", "3.9")
"""Triton releases (major.minor) the Gluon kernels were compiled and checked with; others take the Triton kernels."""

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
"""TMA global -> shared copy completing on an mbarrier (renamed ``async_load`` after Triton 3.6)."""
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
"""TMA shared -> global copy (renamed ``async_store`` after Triton 3.6)."""

MATH_REGS = gl.constexpr(232)
"""Registers per thread of a math warpgroup (``setmaxnreg``)."""
LOAD_REGS = gl.constexpr(40)
"""Registers per thread of the producer warp."""
MAXNREG = (2 * MATH_REGS.value + LOAD_REGS.value) // 3
"""The launch's ``maxnreg`` for two math warpgroups and one producer warp (the mean ptxas allocates before
``setmaxnreg`` redistributes)."""
SHARED_BYTES = 227 * 1024
"""Shared memory one sm90 program may take."""


def triton_tested() -> bool:
    """Whether the installed Triton is one the Gluon kernels were checked with (:data:`TESTED_TRITON`)."""
    return ".".join(triton.__version__.split(".")[:2]) in TESTED_TRITON
