"""Test helpers: capture the final forward/backward graphs an inner compiler receives."""

from __future__ import annotations

import sys

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


SM90_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
"""Whether an sm90 (Hopper) GPU is here: the GPU cases of the warp-specialized Gluon kernels run only there."""


def gluon_sm90(loader):
    """The Gluon sm90 kernel module ``loader()`` gives, or skip the test where it gives None (this Triton has no
    Gluon Hopper API)."""
    module = loader()
    if module is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    return module


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


def sorted_routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """The order that sorts a random routing's flat (token, slot) pairs by expert (``top_k`` distinct experts a
    token), as HF transformers makes it: a permutation of ``range(tokens * top_k)``."""
    g = torch.Generator().manual_seed(seed)
    expert_ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    return torch.sort(expert_ids).indices


def row_scatter_adds(graphs) -> int:
    """Scatter-adds into a 2D tensor in ``graphs`` (AOTAutograd's): ``index_put`` accumulating, ``index_add``,
    ``scatter_add``: a row sum written as a scatter, or a row gather's gradient. (A 1D gather's gradient, such as
    the route weights', is a scatter-add of a value a row and not counted.)"""
    aten = torch.ops.aten

    def rows(n):
        if n.target in (aten.index_put.default, aten.index_put_.default):
            return len(n.args) > 3 and n.args[3] and n.args[0].meta["val"].dim() == 2
        return n.target in (aten.index_add.default, aten.scatter_add.default) and n.args[0].meta["val"].dim() == 2

    return sum(1 for gm in graphs for n in gm.graph.nodes if rows(n))


def count_calls(graphs, target) -> int:
    """How many call_function nodes with ``target`` the graphs hold."""
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target == target)


def launch(
    script: str,
    case: str,
    world: int,
    timeout_s: float = 150.0,
    check: bool = True,
    started: list | None = None,
    environ: dict | None = None,
) -> str:
    """Run ``python script CASES RANK WORLD RENDEZVOUS`` as ``world`` processes; returns their output.

    ``case`` names one worker case or several, comma-separated: :func:`run_worker` runs them in order in the
    same processes (one start and one import of torch per rank for all of them), each case on a port of its own
    that rank 0 finds free as the case starts and leaves in the ``RENDEZVOUS`` folder for the others (a process
    group's store outlives its group while FSDP or a device mesh still holds it, and a second group on its port
    would meet the first one's keys; a port chosen long before could be taken meanwhile by a launch running beside
    this one). With ``check`` (the default)
    fails, showing every rank's output, when a rank exits non-zero; either way a launch running past
    ``timeout_s`` prints every rank's stacks and is killed, with a note in the output. The processes are appended
    to ``started`` (when given) as they start, for a caller that may have to stop them; they get ``environ``
    (default: this process's).
    """
    import os
    import shutil
    import signal
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    rendezvous = tempfile.mkdtemp(prefix="mxfx-launch-")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ if environ is None else environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, script, case, str(rank), str(world), rendezvous],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    if started is not None:
        started.extend(procs)
    deadline = time.monotonic() + timeout_s
    outputs, codes = [], []
    timed_out = False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=None if timed_out else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:  # every rank's stacks (run_worker's faulthandler), then the end
                if q.poll() is None:
                    q.send_signal(signal.SIGUSR1)
            time.sleep(3.0)
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[timed out after {timeout_s} s: the stacks above are each rank's at that moment]"
        outputs.append(out)
        codes.append(p.returncode)
    shutil.rmtree(rendezvous, ignore_errors=True)
    log = "\n".join(f"----- rank {r} (rc {c}) -----\n{o}" for r, (o, c) in enumerate(zip(outputs, codes)))
    assert not check or all(c == 0 for c in codes), log
    return log


CASE_TIMEOUT_S = 240
"""A worker case running longer than this prints every thread's stack and ends its process (a hang, not a test)."""


def run_worker(workers: dict) -> None:
    """The worker side of :func:`launch`: ``sys.argv`` is ``script CASES RANK WORLD RENDEZVOUS``; runs each case
    ``workers[name](rank, world)`` in order, with ``MASTER_PORT`` its port (:func:`_case_port`), then ends the process
    (:func:`exit_worker`). A case named ``module:name`` is ``WORKERS[name]`` of ``tests/module.py``, so one launch
    can carry the cases of several test files.

    Each case starts from a fresh Dynamo (no compiled code or recompile count carried over) and Dynamo's
    config as it found it, and sets up and destroys its own process group. A case that raises prints its
    traceback and ``CASE <name> FAILED`` and destroys its process group, which fails its peers' pending
    collectives at once, so every rank goes on to the next case together; the process then exits with status 1.
    A test reads the line its case prints on success; every case's time is printed too (``case NAME: S s``).
    """
    import faulthandler
    import importlib
    import os
    import signal
    import time
    import traceback
    import warnings

    import torch.distributed as dist

    def worker(name):
        if ":" in name:
            module, name = name.split(":")
            return importlib.import_module(f"tests.{module}").WORKERS[name]
        return workers[name]

    names, rank, world, rendezvous = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = [worker(name) for name in names]  # KeyError: an unknown case, before any starts
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launch() asks for the stacks of a launch past its limit
    config = torch._dynamo.config.save_config()
    failed = False
    for index, (name, case) in enumerate(zip(names, cases, strict=True)):
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_case_port(rendezvous, index, rank)))
        torch._dynamo.reset()
        with warnings.catch_warnings():  # restoring deprecated keys warns
            warnings.simplefilter("ignore")
            torch._dynamo.config.load_config(config)
        start = time.perf_counter()
        try:
            case(rank, world)
        except Exception:
            failed = True
            traceback.print_exc()
            print(f"CASE {name} FAILED", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            faulthandler.cancel_dump_traceback_later()
            print(f"case {name}: {time.perf_counter() - start:.1f} s", flush=True)
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    exit_worker()


class SessionJobs:
    """Work that the collected tests take from other processes. The jobs, by test file (the order the tests need
    them in):

    * ``stem:name`` for each entry of a collected test file's module-level ``BACKGROUND_JOBS`` (name -> function of
      the environment its processes get): the function's return value, or the exception it raised;
    * the launches of the worker cases that test files list under ``TWO_RANKS`` and ``FOUR_RANKS`` (2 and 4
      processes, :func:`launch`), for the files with a selected test taking the ``two_ranks`` (``four_ranks``)
      fixture: the launch's output, from which each test reads its case's line.

    In a plain run (``lazy=False``) the jobs start when collection ends and run one after the other in a background
    thread, beside the tests before them (a pytest process keeps about one core busy; the jobs' processes use the
    other), and each launch carries the cases of every file declaring it (``TWO_RANKS``, ``FOUR_RANKS``), so its
    processes start and import torch once. Under pytest-xdist (``lazy=True``) every worker collects every test, so
    nothing starts at collection: a job runs on the worker that asks for it first, in that test, and each file has
    launches of its own (``stem:TWO_RANKS``), so that the files' launches run in parallel on several workers; the
    controller sends every test reading one job (:meth:`group_of`) to one worker (tests/conftest.py, ``JobScheduling``).

    The jobs' processes get the environment as it was when collection ended: a test running meanwhile may set a
    variable for itself (``monkeypatch.setenv("MXFX_POLICY", ...)``) that must not reach them. A test waits for
    its job with :meth:`result`; a launch that outlives its limit prints its processes' stacks and is killed
    (:func:`launch`). Under pytest-timeout (``--timeout T``) a lazy launch's limit is ``T`` less a margin, so the
    test fails with the processes' output rather than with the timeout's.
    """

    WORLDS = {"TWO_RANKS": 2, "FOUR_RANKS": 4}

    def __init__(self, session, lazy: bool = False):
        import os
        import threading

        self.environ = dict(os.environ)
        self.lazy = lazy
        self.procs: list = []
        timeout = getattr(session.config.option, "timeout", None)  # pytest-timeout's, when installed
        self.test_timeout_s = float(timeout) if timeout else None
        modules, needs = {}, {attr: set() for attr in self.WORLDS}
        for item in session.items:
            module = getattr(item, "module", None)
            if module is not None:
                stem = _stem(module)
                modules[stem] = module
                for attr in self.WORLDS:  # a selected test that takes the launch's fixture
                    if getattr(module, attr, None) and attr.lower() in item.fixturenames:
                        needs[attr].add(stem)
        self.jobs = {}
        for stem, module in sorted(modules.items()):
            for attr, world in self.WORLDS.items():
                if stem in needs[attr]:
                    if lazy:
                        self.jobs[f"{stem}:{attr}"] = self._launch(world, {stem: module}, attr)
                    elif attr not in self.jobs:
                        self.jobs[attr] = self._launch(world, {s: modules[s] for s in sorted(needs[attr])}, attr)
            for name, fn in getattr(module, "BACKGROUND_JOBS", {}).items():
                self.jobs[f"{stem}:{name}"] = lambda fn=fn: fn(self.environ)
        self.results: dict = {}
        self.lock = threading.Lock()
        self.done = {name: threading.Event() for name in self.jobs}
        if self.jobs and not lazy:
            threading.Thread(target=self._run, name="session jobs", daemon=True).start()

    @classmethod
    def group_of(cls, item) -> str | None:
        """The job group of a test reading a job: ``stem:TWO_RANKS`` / ``stem:FOUR_RANKS`` for the launch
        fixtures, ``stem:jobs`` for ``session_job``; ``None`` for any other test."""
        module = getattr(item, "module", None)
        if module is None:
            return None
        for attr in cls.WORLDS:
            if attr.lower() in item.fixturenames:
                return f"{_stem(module)}:{attr}"
        return f"{_stem(module)}:jobs" if "session_job" in item.fixturenames else None

    def launch_of(self, attr: str, module) -> str:
        """The job name of the ``attr`` (``TWO_RANKS``, ``FOUR_RANKS``) launch carrying ``module``'s cases."""
        return f"{_stem(module)}:{attr}" if self.lazy else attr

    def _launch(self, world: int, declared: dict, attr: str):
        cases = [f"{stem}:{case}" for stem, m in declared.items() for case in getattr(m, attr)]
        script = next(iter(declared.values())).__file__
        limit = CASE_TIMEOUT_S * len(cases) + 60
        if self.lazy and self.test_timeout_s:
            limit = min(limit, max(10.0, self.test_timeout_s - 20))
        return lambda: launch(
            script, ",".join(cases), world, timeout_s=limit, check=False, started=self.procs, environ=self.environ
        )

    def _run_one(self, name: str):
        try:
            self.results[name] = (self.jobs[name](), None)
        except BaseException as e:  # the tests of this job raise it (a skip too; under pytest-timeout, its failure)
            self.results[name] = (None, e)
        finally:
            self.done[name].set()

    def _run(self):
        for name in self.jobs:
            self._run_one(name)

    def result(self, name: str):
        """The result of job ``name`` once it has ended (its exception raised here); a lazy job runs now, once."""
        if name not in self.jobs:
            raise KeyError(f"no session job {name!r}: the collected jobs are {sorted(self.jobs)}")
        if self.lazy:
            with self.lock:
                if not self.done[name].is_set():
                    self._run_one(name)
        self.done[name].wait()
        value, error = self.results[name]
        if error is not None:
            raise error
        return value

    def stop(self):
        """Kill the processes of a launch still running (the session ended early)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def _stem(module) -> str:
    from pathlib import Path

    return Path(module.__file__).stem


def _case_port(rendezvous: str, index: int, rank: int) -> int:
    """The port of a launch's case ``index``: rank 0 asks the OS for a free one and writes it to
    ``rendezvous/index``; the other ranks wait for that file."""
    import os
    import socket
    import time

    path = os.path.join(rendezvous, str(index))
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(path + ".tmp", path)  # whole or absent
        return port
    while not os.path.exists(path):  # a hang here ends at the case's limit (run_worker's faulthandler)
        time.sleep(0.05)
    with open(path) as f:
        return int(f.read())


def exit_worker() -> None:
    """End a worker process of :func:`launch` at once, after its output is flushed.

    Its process group is destroyed by then; skipping interpreter teardown avoids an abort
    ("terminate called without an active exception", rc -6) seen now and then when a
    Python-wrapped gloo group's threads are destroyed during finalization."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_interpreter_checks(test_file: str, environ: dict | None = None) -> None:
    """Run ``test_file --interpret`` in a fresh interpreter under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter
    is chosen at import time, so it needs its own process); fails with the checks' output if they fail.

    Skips, with one line saying why, where this Triton's interpreter cannot run a loop with a tensor bound at all
    (:func:`_interpreter_loop_probe`, run first): Triton 3.6 (torch 2.11's) under NumPy 2.4+ (triton-lang/triton#9171).
    """
    import os
    import subprocess

    import pytest

    pytest.importorskip("triton")
    env = dict(os.environ if environ is None else environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    probe = subprocess.run(
        [sys.executable, "-c", "from tests.helpers import _interpreter_loop_probe as p; p()"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
    )
    if probe.returncode == _NO_TENSOR_LOOPS:
        pytest.skip(probe.stdout.strip())
    assert probe.returncode == 0, f"the Triton interpreter probe failed:\n{probe.stdout}{probe.stderr}"
    checks = subprocess.run(
        [sys.executable, os.path.abspath(test_file), "--interpret"],
        env=env,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert checks.returncode == 0, f"{test_file} --interpret failed:\n{checks.stdout[-8000:]}"


_NO_TENSOR_LOOPS = 3
"""Exit status of :func:`_interpreter_loop_probe` when the interpreter cannot take a tensor loop bound."""


def _interpreter_loop_probe() -> None:
    """Under ``TRITON_INTERPRET=1``: run ``for _ in range(0, n)`` with ``n`` a kernel argument; exit with
    :data:`_NO_TENSOR_LOOPS` (printing why) where the interpreter refuses the bound. Triton 3.6's interpreter
    turns a scalar into a loop bound with ``int()`` of a 1-element array, which NumPy 2.4 made a TypeError
    ("only 0-dimensional arrays can be converted to Python scalars"); later Triton squeezes the array first."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def count(out_ptr, n):
        acc = 0
        for _ in range(0, n):
            acc += 1
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](out, 3)
    except triton.runtime.errors.InterpreterError as e:
        if "0-dimensional" not in str(e):
            raise
        print(
            f"Triton {triton.__version__}'s interpreter cannot run a loop with a tensor bound under NumPy "
            f"{numpy.__version__} (triton-lang/triton#9171): install numpy<2.4 or a newer Triton to run these checks"
        )
        sys.exit(_NO_TENSOR_LOOPS)
    assert out.item() == 3, out


def lm_loss_and_grads(model, backend=None, options=None, *, seq: int = 32, autocast: bool = True):
    """One forward and backward of causal LM ``model`` (Hugging Face signature) on fixed random ids ``[2, seq]``
    (vocab 128): ``model`` itself with ``backend=None``, else ``torch.compile(model, backend=backend,
    options=options)``; under CPU BF16 autocast unless ``autocast=False``. Returns ``(loss fp32, {name: grad fp32})``
    and leaves the gradients cleared."""
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    fn = (
        model if backend is None else torch.compile(model, backend=backend, **({"options": options} if options else {}))
    )
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = fn(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def load_example(name: str):
    """``examples/<name>.py`` as a module, for tests of the examples themselves. ``examples/`` is a folder of
    scripts (each puts its own folder on ``sys.path`` when run), not a package: the module is loaded from its
    path, once, and kept in ``sys.modules`` as ``example_<name>``; ``sys.path`` is left as it is."""
    import importlib.util
    from pathlib import Path

    key = f"example_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before running it: dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
