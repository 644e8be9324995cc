"""Test helpers: capture the final forward/backward graphs an inner compiler receives."""

from __future__ import annotations

import sys

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


class GraphCapture:
    """An ``inner`` compiler (aot_autograd) that records the forward and backward ATen graphs it runs."""

    def __init__(self):
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

        def fw(gm, example_inputs):
            self.forward.append(gm)
            return make_boxed_func(gm.forward)

        def bw(gm, example_inputs):
            self.backward.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)


def count_calls(graphs, target) -> int:
    """How many call_function nodes with ``target`` the graphs hold."""
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target == target)


def launch(script: str, case: str, world: int, timeout_s: float = 150.0) -> str:
    """Run ``python script CASE RANK WORLD PORT`` as ``world`` processes on a free port; returns their output.

    Fails (showing every rank's output) when a rank exits non-zero or the launch runs past ``timeout_s``.
    """
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, script, case, str(rank), str(world), str(port)],
                         env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[timed out after {timeout_s} s]"
        outputs.append(out)
        codes.append(p.returncode)
    log = "\n".join(f"----- rank {r} (rc {c}) -----\n{o}" for r, (o, c) in enumerate(zip(outputs, codes)))
    assert all(c == 0 for c in codes), log
    return log


def exit_worker() -> None:
    """End a worker process of :func:`launch` at once, after its output is flushed.

    Its process group is destroyed by then; skipping interpreter teardown avoids an abort
    ("terminate called without an active exception", rc -6) seen now and then when a
    Python-wrapped gloo group's threads are destroyed during finalization."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_interpreter_checks(test_file: str) -> None:
    """Run ``test_file --interpret`` in a fresh interpreter under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter
    is chosen at import time, so it needs its own process); raises CalledProcessError if the checks fail."""
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, os.path.abspath(test_file), "--interpret"], check=True, env=env, cwd=root)
