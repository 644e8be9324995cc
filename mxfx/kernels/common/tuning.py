"""Autotuning results kept across processes and call sites: a Triton kernel's best config per launch key, on disk.

Triton's own disk cache of autotuning results (``triton.autotune(cache_results=True)``) skips every kernel whose
configs carry a pre-hook, and mxfx's grouped FP8 GEMM needs one (its TMA descriptors' block shapes follow the
config's tile), so each new process benchmarked every config again, compiling each first on a node whose Triton
cache is empty. Here a launch looks its key up first and runs the recorded config; only a key seen nowhere before
is benchmarked, and its winner recorded.

Where: ``$MXFX_TUNING_DIR/tuning.json`` (a relative folder is taken from the working directory of each call);
unset, ``$XDG_CACHE_HOME/mxfx`` or ``~/.cache/mxfx``; ``MXFX_TUNING_DIR=off`` keeps results in the process only. A
record belongs to one kernel source (Triton's ``JITFunction.cache_key``), Triton version and device name, so a
changed kernel, Triton or GPU tunes again; a record naming a config the kernel no longer has is ignored. Delete the
file to tune again (a record made on a busy GPU may not be the best). A write merges the file under an exclusive
lock on ``tuning.json.lock`` (POSIX ``flock``; ranks and threads tuning at once keep every key) and replaces it
through a temporary file of its own, so a reader always sees a whole file. A file that is not a JSON object is
warned about and replaced by the next write.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

import triton

try:
    import fcntl
except ImportError:  # not POSIX: writes are not locked against other processes
    fcntl = None

ENV = "MXFX_TUNING_DIR"
FILE = "tuning.json"

_memory: dict[str, dict] = {}
_hits: dict[tuple, triton.Config] = {}  # (kernel, key) -> the config object, the per-launch fast path
_loaded_from: Path | None = None
_warned: set[str] = set()  # the kinds of problem warned about ("read", "write"): once each per process
_thread_lock = threading.Lock()


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


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"mxfx.kernels.common.tuning: {message}", stacklevel=3)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict):
        what = f"{type(data).__name__}: {data}" if isinstance(data, Exception) else f"a JSON {type(data).__name__}"
        _warn_once(
            "read",
            f"{path} is not a tuning file ({what}); its records are ignored and the next tuning result replaces it",
        )
        return {}
    return data


@contextlib.contextmanager
def _locked(folder: Path):
    """This process's threads one at a time, and other processes through an exclusive ``flock``."""
    with _thread_lock, open(folder / f"{FILE}.lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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
        with _locked(folder):
            merged = _read(path)
            merged[entry] = described
            fd, tmp = tempfile.mkstemp(prefix=f"{FILE}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError as e:
        _warn_once("write", f"cannot write {path} ({type(e).__name__}: {e}); tuning results stay in this process")


def forget() -> None:
    """Drop what this process holds (the file stays): the next lookup reads the file again."""
    global _loaded_from
    _memory.clear()
    _hits.clear()
    _loaded_from = None
