"""Byte-level text data for the MoE example: train/held-out splits and seeded random windows.

By default the corpus is text that ships with every Python interpreter, so the
example needs no download:

* Python code: ``.py`` files of the standard library, an evenly spaced sample in
  sorted path order, ``code_bytes`` in all (installed packages, tests, codec
  tables and ``pydoc_data`` are skipped, so the set depends only on the Python
  version);
* English: the help topics of ``pydoc_data.topics`` (the Python reference
  manual in plain text), in sorted key order.

Each source is split on its own: its last ``val_frac`` bytes are held out and
never trained on, so the held-out set has both code and English. ``--data FILE``
replaces both with one UTF-8 text file, split the same way.

Tokens are bytes (vocabulary 256): ``uint8`` on disk, ``int64`` in batches.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256
# installed packages, test suites, generated codec tables (encodings/) and the English source below
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings", "pydoc_data", "__pycache__"}


def stdlib_code(max_bytes: int) -> bytes:
    """Standard-library ``.py`` sources, up to ``max_bytes``: every n-th file in sorted path order.

    Taking every n-th file (n = total size / ``max_bytes``, rounded up) rather than the first
    files keeps the sample spread over the whole alphabet of modules, so the held-out tail is
    ordinary hand-written code (``urllib``, ``xml``, ``zipfile``, ...), not one package.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    stride = max(1, math.ceil(sum(p.stat().st_size for p in files) / max_bytes))
    chunks, total = [], 0
    for path in files[::stride]:
        chunks.append(b"# file: " + path.relative_to(root).as_posix().encode() + b"\n" + path.read_bytes() + b"\n")
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def pydoc_topics() -> bytes:
    """The English help topics of the Python reference manual, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def split(data: bytes, val_frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of ``data`` as (train, held-out): the held-out part is the last ``val_frac`` (both empty for
    empty ``data``)."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    n_val = max(1, int(len(tokens) * val_frac))
    return tokens[:-n_val].clone(), tokens[-n_val:].clone()


def load_splits(path: str | None = None, val_frac: float = 0.1, code_bytes: int = 4_000_000):
    """(train, held-out) uint8 token tensors, from ``path`` or from the interpreter's own text."""
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")  # fail loudly on non-UTF-8 input
        return split(text.encode("utf-8"), val_frac)
    parts = [split(stdlib_code(code_bytes), val_frac), split(pydoc_topics(), val_frac)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def get_batch(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device: str = "cpu"):
    """``batch`` random contiguous windows of ``tokens``: inputs and next-byte targets, int64."""
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
    window = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()]).long()
    return window[:, :-1].to(device), window[:, 1:].to(device)
