"""When the warnings about compiled graphs are given: each subject (a policy's rules, a model's coverage) is judged
once, over every graph compiled for it by then.

A subject is judged when a graph that is the whole forward of the module being called compiles (the caller asks,
:func:`mxfx.names.whole_forward`), else at the next optimizer step (a global step post-hook: every graph of a
training step has compiled by then), or at process exit when neither comes (per-block inference). Graphs compiled
after the judgment (a later recompile) change nothing.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_lock = threading.RLock()
_all: list["Judgments"] = []
_hook_handle = None


class Judgments:
    """The subjects of one kind of judgment: observed and not judged yet, or judged (each once, by ``judge``).

    ``weak``: judged subjects are held weakly (a subject that dies cannot be observed again); else strongly, for
    subjects that compare by value (an equal policy built anew is the same subject).
    """

    def __init__(self, judge: Callable[[object], None], weak: bool = False):
        self._judge = judge
        self._pending: dict = {}  # subject -> None, in the order observed
        self._judged = weakref.WeakSet() if weak else set()
        with _lock:
            _all.append(self)

    def observe(self, subject, record: Callable[[], None] | None = None) -> bool:
        """Run ``record`` (what one graph showed about ``subject``) under the lock and keep ``subject`` pending;
        False, recording nothing, when ``subject`` was judged already."""
        global _hook_handle
        with _lock:
            if subject in self._judged:
                return False
            if record is not None:
                record()
            self._pending.setdefault(subject, None)
            if _hook_handle is None:
                _hook_handle = register_optimizer_step_post_hook(_on_step)
                atexit.register(judge_all)
        return True

    def judge(self, subject=None) -> None:
        """Judge ``subject`` (every pending subject when None), once each."""
        with _lock:
            subjects = [s for s in self._pending if subject is None or s == subject]
            for s in subjects:
                del self._pending[s]
                self._judged.add(s)
        for s in subjects:
            self._judge(s)

    def judged(self, subject) -> bool:
        """Whether ``subject`` was judged."""
        with _lock:
            return subject in self._judged


def judge_all() -> None:
    """Judge every pending subject of every kind."""
    with _lock:
        kinds = list(_all)
    for judgments in kinds:
        judgments.judge()


def _on_step(optimizer, args, kwargs) -> None:
    judge_all()


_on_step = torch.compiler.disable(_on_step, recursive=True)
