"""How mxfx's Triton kernels turn fp32 into E4M3 bytes, whatever the format's scales (MX blocks of 32, fp8_block
tiles of 128): by the hardware conversion where the kernel is compiled, by an explicit form under Triton's
interpreter."""

from __future__ import annotations

import triton.language as tl

from mxfx.kernels.common.launch import INTERPRETED

E4M3_NAN_BYTE = tl.constexpr(0x7F)
"""The E4M3 byte every value of a block or tile with a NaN or an infinity takes (OCP MX v1.0 §6.3)."""

HW_E4M3_CONVERSION = tl.constexpr(not INTERPRETED)
"""Compiled kernels convert fp32 to E4M3 with the hardware's ``cvt.rn.satfinite.e4m3x2.f32`` (sm89+, the only targets
with Triton fp8e4nv), which rounds to nearest even, saturates at +-448 and turns NaN into the NaN byte 0x7F: the clamp
and the per-value NaN select are then left out (a nonfinite block gets a NaN inverse scale instead), about a third fewer
instructions per value in kernels that are otherwise issue-bound. Triton's interpreter converts with its own code, which
neither saturates nor maps NaN so, and keeps the explicit form; its rounding to E4M3 is not exact either
(values near a power of two can come out a factor 2 off), so interpreter tests use exactly representable data. Read at
import, as Triton reads it."""
