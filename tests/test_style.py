"""The tree passes ruff: the lint rules and the formatter of pyproject.toml's ``[tool.ruff]``.

Both checks run ruff on the repository root (the directory above ``tests/``), so they see every file the
project lints, and skip where ruff is not installed (it comes with the ``test`` extra).
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff", reason="ruff is not installed: pip install -e '.[test]' brings it")

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


def test_ruff_check():
    """``ruff check .``: no lint error (pycodestyle, pyflakes, lines <= 120 characters)."""
    res = _ruff("check", ".")
    assert res.returncode == 0, (
        f"ruff check . found errors (fix them, or run ruff check --fix .):\n{res.stdout}{res.stderr}"
    )


def test_ruff_format():
    """``ruff format --check .``: every file is as ``ruff format .`` writes it."""
    res = _ruff("format", "--check", ".")
    assert res.returncode == 0, f"ruff format --check . would reformat (run ruff format .):\n{res.stdout}{res.stderr}"
