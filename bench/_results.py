"""Where benchmark scripts put their tables: stdout always, and ``$MXFX_BENCH_OUT/<name>`` when set."""

import os


def emit(name: str, table: str) -> None:
    """Print ``table`` and, if ``MXFX_BENCH_OUT`` names a directory, also write it there as ``name``."""
    print(table)
    out = os.environ.get("MXFX_BENCH_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            f.write(table + "\n")
