"""Autotuning results kept across processes (mxfx.kernels.common.tuning), and the grouped FP8 GEMM reading them.

On CPU: records round-trip through the file as the kernel's own config objects, and are keyed by kernel source,
device and launch key; a record naming a config the kernel no longer has, a corrupt file and an unwritable folder
are handled without a wrong config. On CUDA: the first launch of a key autotunes and records; a fresh process
state launches the recorded config without autotuning, with the same result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from mxfx.kernels.common import tuning  # noqa: E402

CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=3) for m, w in ((64, 4), (128, 8), (128, 4))]


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "tuning"))
    monkeypatch.setattr(tuning, "_warned", set())
    tuning.forget()
    yield
    tuning.forget()


@triton.jit
def _one(x_ptr, BLOCK_M: triton.language.constexpr):
    triton.language.store(x_ptr, 1)


@triton.jit
def _two(x_ptr, BLOCK_M: triton.language.constexpr):
    triton.language.store(x_ptr, 2)


def test_a_record_is_read_back_by_a_new_process_as_the_kernels_config(tmp_path):
    kernel = tuning.kernel_id(_one, "GPU A")
    tuning.record(kernel, (2048, 1024, torch.bfloat16), CONFIGS[1])
    tuning.forget()  # what a new process holds
    assert tuning.lookup(kernel, (2048, 1024, torch.bfloat16), CONFIGS) is CONFIGS[1]
    assert tuning.lookup(kernel, (2048, 1024, torch.float32), CONFIGS) is None  # another key
    assert tuning.lookup(tuning.kernel_id(_one, "GPU B"), (2048, 1024, torch.bfloat16), CONFIGS) is None
    assert tuning.lookup(tuning.kernel_id(_two, "GPU A"), (2048, 1024, torch.bfloat16), CONFIGS) is None
    data = json.loads((tmp_path / "tuning" / tuning.FILE).read_text())
    assert list(data.values()) == [{"kwargs": {"BLOCK_M": 128}, "num_warps": 8, "num_stages": 3}]


def test_records_of_other_processes_are_kept(tmp_path):
    """Two processes tuning different keys: the file holds both (each write merges what is on disk)."""
    kernel = tuning.kernel_id(_one, "GPU A")
    tuning.record(kernel, (1,), CONFIGS[0])
    code = (
        "import triton; from mxfx.kernels.common import tuning; "
        "c = triton.Config({'BLOCK_M': 128}, num_warps=4, num_stages=3); "
        f"tuning.record({kernel!r}, (2,), c)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
    tuning.forget()
    assert tuning.lookup(kernel, (1,), CONFIGS) is CONFIGS[0]
    assert tuning.lookup(kernel, (2,), CONFIGS) is CONFIGS[2]


def test_a_json_that_is_not_an_object_is_warned_about(tmp_path):
    folder = tmp_path / "tuning"
    folder.mkdir()
    (folder / tuning.FILE).write_text("[1, 2]")
    with pytest.warns(UserWarning, match="is not a tuning file \\(a JSON list\\)"):
        assert tuning.lookup(tuning.kernel_id(_one, "GPU A"), (1,), CONFIGS) is None


def test_processes_and_threads_writing_at_once_keep_every_key(tmp_path):
    """Four processes of four threads each record 10 keys at once: the file ends with all 160, and parses."""
    code = (
        "import sys, threading, triton; from mxfx.kernels.common import tuning; "
        "c = triton.Config({'BLOCK_M': 64}, num_warps=4, num_stages=3); p = int(sys.argv[1]); "
        "ts = [threading.Thread(target=lambda t=t: [tuning.record('k', (p, t, i), c) for i in range(10)]) "
        "for t in range(4)]; [t.start() for t in ts]; [t.join() for t in ts]"
    )
    procs = [
        subprocess.Popen([sys.executable, "-W", "error", "-c", code, str(p)], env=dict(os.environ)) for p in range(4)
    ]
    assert [p.wait() for p in procs] == [0] * 4
    assert len(json.loads((tmp_path / "tuning" / tuning.FILE).read_text())) == 160


def test_a_record_naming_a_config_the_kernel_no_longer_has_is_ignored():
    kernel = tuning.kernel_id(_one, "GPU A")
    tuning.record(kernel, (1,), triton.Config({"BLOCK_M": 256}, num_warps=8, num_stages=3))
    tuning.forget()
    assert tuning.lookup(kernel, (1,), CONFIGS) is None


def test_off_keeps_results_in_the_process(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV, "off")
    kernel = tuning.kernel_id(_one, "GPU A")
    tuning.record(kernel, (1,), CONFIGS[2])
    assert tuning.lookup(kernel, (1,), CONFIGS) is CONFIGS[2]
    assert not (tmp_path / "tuning").exists()
    tuning.forget()
    assert tuning.lookup(kernel, (1,), CONFIGS) is None


def test_a_corrupt_file_warns_once_and_is_replaced(tmp_path):
    folder = tmp_path / "tuning"
    folder.mkdir()
    (folder / tuning.FILE).write_text("{not json")
    kernel = tuning.kernel_id(_one, "GPU A")
    with pytest.warns(UserWarning, match="is not a tuning file .*JSONDecodeError.*the next tuning result replaces it"):
        assert tuning.lookup(kernel, (1,), CONFIGS) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.record(kernel, (1,), CONFIGS[0])  # the warning was given once
    assert len(json.loads((folder / tuning.FILE).read_text())) == 1


def test_an_unwritable_folder_warns_and_keeps_the_result(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(tuning.ENV, str(blocker / "sub"))  # a folder under a file cannot be made
    kernel = tuning.kernel_id(_one, "GPU A")
    with pytest.warns(UserWarning, match="cannot write"):
        tuning.record(kernel, (1,), CONFIGS[1])
    assert tuning.lookup(kernel, (1,), CONFIGS) is CONFIGS[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_gemm_launches_the_recorded_config_without_autotuning(monkeypatch):
    from mxfx.kernels.fp8_block import grouped_gemm_triton

    torch.manual_seed(0)
    G, N, K, S = 4, 256, 512, 1000
    a = torch.randn(S, K, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(G, N, K, device="cuda").to(torch.float8_e4m3fn)
    a_scales = torch.rand(S, K // 128, device="cuda") + 0.5
    b_scales = torch.rand(G, N // 128, K // 128, device="cuda") + 0.5
    offs = torch.tensor([100, 400, 400, S], dtype=torch.int32, device="cuda")
    tuned = grouped_gemm_triton.grouped_mm(a, a_scales, b, b_scales, offs)
    data = json.loads((tuning.tuning_dir() / tuning.FILE).read_text())
    assert len(data) == 1 and next(iter(data)).startswith("_grouped_body|")
    tuning.forget()

    def no_autotune(*args, **kwargs):
        raise AssertionError("autotuned a key that has a record")

    monkeypatch.setattr(grouped_gemm_triton._kernel_tuned, "run", no_autotune)
    again = grouped_gemm_triton.grouped_mm(a, a_scales, b, b_scales, offs)
    assert torch.equal(again, tuned)  # the same config of the same kernel on the same data
