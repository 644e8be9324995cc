"""Low-precision formats: one :class:`~mxfx.formats.base.Format` object per format, one module each.

* :mod:`mxfx.formats.mxfp8`: MXFP8, E4M3 + one E8M0 scale per 32 values (OCP MX v1.0), native on Blackwell.
* :mod:`mxfx.formats.fp8_block`: E4M3 + FP32 scales per 1x128 tile / 128x128 weight block, native on Hopper.
* :mod:`mxfx.formats.bf16_gemm`: BF16 GEMMs from BF16 copies of the FP32 main weights cached once per step (the
  BF16 baseline at the same recipe; ``precision="bf16"`` instead leaves an op as the model wrote it).

:func:`get` turns a policy's ``format`` value into the object (``"auto"``: the first low-precision format native
on the device, else MXFP8). A further format (NVFP4, say) is one new module here plus its kernels (a folder of
:mod:`mxfx.kernels`).
"""

from __future__ import annotations

import torch

from mxfx.formats import mxfp8  # registered first: the default format
from mxfx.formats import fp8_block  # noqa: F401 (registers the format)
from mxfx.formats import bf16_gemm  # noqa: F401 (registers the format)
from mxfx.formats.base import Format, ScaleRule, registered
from mxfx import device as _device

AUTO = "auto"
"""The ``format`` value that picks, per compile, the low-precision format with native GEMMs on the current device."""

DEFAULT = mxfp8.FORMAT
"""The format of a policy that names none, and of ``"auto"`` where no format runs natively (CPU)."""

NAMES: tuple[str, ...] = tuple(registered())
"""Names of the registered formats, as policies spell them."""

CHOICES: tuple[str, ...] = (*NAMES, AUTO)
"""Values a policy's ``format`` field takes."""

SCALE_RULES: tuple[str, ...] = tuple(dict.fromkeys(r.value for f in registered().values() for r in f.scale_rules))
"""Every scale rule some format takes (which format takes which: its ``scale_rules``)."""


def get(fmt: "str | Format", device: torch.device | None = None) -> Format:
    """The format object of a policy value: a format's name, ``"auto"`` (the first low-precision format native on
    ``device``, default the current CUDA device, else CPU; else :data:`DEFAULT`) or a :class:`Format` (returned as
    is).

    Raises:
        ValueError: an unknown name, listing :data:`CHOICES`.
    """
    if isinstance(fmt, Format):
        return fmt
    if fmt == AUTO:
        arch = _device.arch_of(_device.capability(device or _device.current_device()))
        return next((f for f in registered().values() if f.low_precision and arch in f.native_archs), DEFAULT)
    found = registered().get(fmt)
    if found is None:
        raise ValueError(f"mxfx: format={fmt!r} is not valid; choose one of {', '.join(map(repr, CHOICES))}")
    return found


def rules_of(fmt: str) -> tuple[str, ...]:
    """Scale rules a policy value of ``format`` takes: its format's (every rule for a format without scales), or for
    ``"auto"`` those of every format it may resolve to (the low-precision ones that run natively somewhere, and the
    default)."""
    if fmt == AUTO:
        candidates = [f for f in registered().values() if f.low_precision and f.native_archs] + [DEFAULT]
        return tuple(r for r in rules_of(DEFAULT.name) if all(r in rules_of(f.name) for f in candidates))
    found = get(fmt)
    return tuple(r.value for r in (found.scale_rules or ScaleRule))


__all__ = ["AUTO", "CHOICES", "DEFAULT", "Format", "NAMES", "SCALE_RULES", "ScaleRule", "get", "rules_of"]
