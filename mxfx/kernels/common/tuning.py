"""Autotuning results kept across processes and call sites: a Triton kernel's best config per launch key, on disk.

Triton's own disk cache of autotuning results (``triton.autotune(cache_results=True)``) skips every kernel whose
configs carry a pre-hook, and mxfx's grouped FP8 GEMM needs one (its TMA descriptors' block shapes follow the
config's tile), so each new process benchmarked every config again, compiling each first on a node whose Triton
cache is empty. Here a launch looks its key up first and runs the recorded config; only a key seen nowhere before
is benchmarked, and its winner recorded.

Where: ``$MXFX_TUNING_DIR/tuning.json``; unset, ``$XDG_CACHE_HOME/mxfx`` or ``~/.cache/mxfx``;
``MXFX_TUNING_DIR=off`` keeps results in the process only. A record belongs to one kernel source (Triton's
``JITFunction.cache_key``), Triton version and device name, so a changed kernel, Triton or GPU tunes again; a
record naming a config the kernel no longer has is ignored. Delete the file to tune again (a record made on a busy
GPU may not be the best). The file is rewritten whole through a temporary file and ``os.replace``: processes that
tune at once each keep a whole file; the last writer's other keys are re-tuned when next seen.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import triton

ENV = "MXFX_TUNING_DIR"
FILE = "tuning.json"

_memory: dict[str, dict] = {}
_hits: dict[tuple, triton.Config] = {}  # (kernel, key) -> the config object, the per-launch fast path
_loaded_from: Path | None = None
_warned = False


def tuning_dir() -> Path | None:
    """The folder of :data:`FILE` (module docstring), or None when ``MXFX_TUNING_DIR`` is off/0/false/no."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mxfx"


def kernel_id(fn, device_name: str) -> str:
    """The part of a record's key that names the kernel: its name, source hash, Triton version and device name.

    ``fn``: the ``triton.jit`` function (an ``Autotuner``'s ``.fn``, unwrapped to the JIT function)."""
    while not isinstance(fn, triton.runtime.JITFunction):
        fn = fn.fn
    return f"{fn.__name__}|{fn.cache_key}|triton {triton.__version__}|{device_name}"


def _entry(kernel: str, key: tuple) -> str:
    return f"{kernel}|{json.dumps([str(k) for k in key])}"


def _describe(config: triton.Config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"mxfx.kernels.common.tuning: {message}; tuning results stay in this process", stacklevel=3)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once(f"cannot read {path} ({type(e).__name__}: {e}); delete it to start a new one")
        return {}
    return data if isinstance(data, dict) else {}


def _load() -> None:
    """Read the file once per folder (a changed ``MXFX_TUNING_DIR`` reads the new one)."""
    global _loaded_from
    folder = tuning_dir()
    if folder is not None and folder != _loaded_from:
        _loaded_from = folder
        for k, v in _read(folder / FILE).items():
            _memory.setdefault(k, v)


def lookup(kernel: str, key: tuple, configs: list[triton.Config]) -> triton.Config | None:
    """The config recorded for ``(kernel, key)`` (``kernel``: :func:`kernel_id`; ``key``: the launch's values
    that decide the best config), as the object of ``configs`` it names; None when none is recorded or the record
    names no config of ``configs``."""
    hit = _hits.get((kernel, key))
    if hit is not None:
        return hit
    _load()
    described = _memory.get(_entry(kernel, key))
    found = next((c for c in configs if _describe(c) == described), None) if described is not None else None
    if found is not None:
        _hits[(kernel, key)] = found
    return found


def record(kernel: str, key: tuple, config: triton.Config) -> None:
    """Keep ``config`` as the best of ``(kernel, key)``: in this process, and in the file unless tuning results are
    kept in the process only. A folder that cannot be written warns once and is left alone."""
    entry, described = _entry(kernel, key), _describe(config)
    _memory[entry] = described
    _hits[(kernel, key)] = config
    folder = tuning_dir()
    if folder is None:
        return
    path = folder / FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        merged = _read(path)
        merged[entry] = described
        tmp = path.with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        _warn_once(f"cannot write {path} ({type(e).__name__}: {e})")


def forget() -> None:
    """Drop what this process holds (the file stays): the next lookup reads the file again."""
    global _loaded_from
    _memory.clear()
    _hits.clear()
    _loaded_from = None
