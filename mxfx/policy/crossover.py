"""Measured crossover tables of BF16 against each low-precision format, read by ``Policy(min_size="auto")``.

``bench/crossover.py --format F`` times, on one GPU, BF16 ``F.linear`` against mxfx's
``mx_linear`` in format F (activation quantization included, weight from its cache) for a
few projection families ``K -> N`` and token counts M, forward and
forward+backward, and writes ``mxfx/policy/crossover_<F>_sm<major><minor>.json`` (``mx_*``: the format's op,
``mxdq_*``: the same with ``keep_dequantized_weights``, for formats with dequantized weight forms):

.. code-block:: json

    {"capability": [9, 0], "device": "NVIDIA H200", "torch": "2.11.0", "format": "mxfp8",
     "families": [{"name": "4096->4096", "K": 4096, "N": 4096,
                   "points": [{"M": 128, "bf16_fwd_ms": 0.01, "mx_fwd_ms": 0.02,
                               "bf16_fwdbwd_ms": 0.03, "mx_fwdbwd_ms": 0.06,
                               "mxdq_fwd_ms": 0.02, "mxdq_fwdbwd_ms": 0.05}, ...]}]}

:func:`prefers_low_precision` answers for a format and a GEMM ``(M, N, K)``: take the format's table for the
current device, its measured family nearest in ``(log2 N, log2 K)``, then its point nearest in ``log2 M``, and
compare forward+backward times (training is what the backend rewrites for). Each format has its own table: one
format's crossover says nothing of another's quantize and GEMM costs. If the format has no table for the current
device, it warns once and answers True (every eligible GEMM is rewritten, as with ``min_size=0``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from functools import lru_cache

import torch

DATA_DIR = os.path.dirname(os.path.abspath(__file__))
"""Where the tables live (``crossover_mxfp8_sm90.json``, ...): beside this module, in the policy package."""

_warned: set = set()


def _capability() -> tuple[int, int] | None:
    """Capability of the current CUDA device, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def table_name(capability: tuple[int, int], format_name: str) -> str:
    """File name of a format's table for a capability: ``(9, 0), "mxfp8"`` -> ``crossover_mxfp8_sm90.json``."""
    return f"crossover_{format_name}_sm{capability[0]}{capability[1]}.json"


@lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    with open(path) as f:
        table = json.load(f)
    for fam in table.get("families", ()):
        if not {"K", "N", "points"} <= set(fam) or not fam["points"]:
            raise ValueError(f"mxfx.policy.crossover: family {fam.get('name')!r} in {path} needs K, N and points")
    return table


def load_table(format_name: str, capability: tuple[int, int] | None = None) -> dict | None:
    """The crossover table of ``format_name`` for ``capability`` (default: the current device), or None if there is
    none.

    Raises:
        ValueError: a table file exists but lacks the fields above.
    """
    capability = capability if capability is not None else _capability()
    if capability is None:
        return None
    path = os.path.join(DATA_DIR, table_name(capability, format_name))
    if not os.path.exists(path):
        return None
    return _load(path, os.path.getmtime(path))


def _nearest(items, key):
    return min(items, key=key)


def lookup(table: dict, m: int, n: int, k: int) -> dict:
    """The measured point used for a GEMM ``(M, N, K)``: nearest family in (log2 N, log2 K), then nearest M.

    Returns the point dict with ``family`` (its name) added.
    """
    lg = lambda v: math.log2(max(int(v), 1))  # noqa: E731
    fam = _nearest(table["families"], lambda f: abs(lg(f["N"]) - lg(n)) + abs(lg(f["K"]) - lg(k)))
    point = _nearest(fam["points"], lambda p: abs(lg(p["M"]) - lg(m)))
    return {**point, "family": fam.get("name", f"{fam['K']}->{fam['N']}")}


def prefers_low_precision(format_name: str, m: int, n: int, k: int, keep_dequantized: bool = False) -> tuple[bool, str]:
    """Whether the measured table of ``format_name`` says that format beats BF16 for a training GEMM
    ``x[M, K] . W[N, K]^T``.

    ``keep_dequantized`` compares the ``mxdq_*`` times (``keep_dequantized_weights``)
    where the table has them. Returns ``(answer, reason)``; the reason names the
    measured point used. With no table of the format for the current device: warns once per
    format and device and returns True.
    """
    cap = _capability()
    table = load_table(format_name, cap)
    if table is None:
        where = "CPU" if cap is None else f"sm{cap[0]}{cap[1]}"
        if (format_name, where) not in _warned:
            _warned.add((format_name, where))
            name = table_name(cap, format_name) if cap else f"crossover_{format_name}_sm<cc>.json"
            warnings.warn(
                f"mxfx: min_size='auto' found no {format_name} crossover table for this device ({where}; looked for "
                f"{os.path.join(DATA_DIR, name)}); rewriting every eligible GEMM. Measure one with: "
                f"python bench/crossover.py --format {format_name}",
                stacklevel=3,
            )
        return True, f"no {format_name} crossover table"
    p = lookup(table, m, n, k)
    arm = "mxdq" if keep_dequantized and "mxdq_fwdbwd_ms" in p else "mx"
    bf16, lp = p["bf16_fwdbwd_ms"], p[f"{arm}_fwdbwd_ms"]
    ratio = bf16 / lp if lp > 0 else 0.0
    label = format_name if arm == "mx" else f"{format_name}, dequantized weights"
    return ratio > 1.0, f"crossover table: {p['family']} M={p['M']} {label} {ratio:.2f}x bf16 (fwd+bwd)"
