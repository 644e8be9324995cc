"""``bench/peak_memory.py``: the replayed peak of an allocator trace, the blocks live at it by allocation site, on a
hand-built trace and, with a GPU, against the allocator's own peak."""

from __future__ import annotations

import os

import pytest
import torch

from bench.peak_memory import Site, allocation_site, live_at_peak, peak_table, record_peak

TORCH_FRAME = {"filename": os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"), "line": 1, "name": "f"}


def _alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def _free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


@pytest.fixture
def code(tmp_path):
    """A model file and a file shaped as Inductor's generated code, and a frame maker for their lines."""
    model = tmp_path / "model.py"
    model.write_text("def forward(x):\n    h = x @ w\n    y = h.relu()\n    return y\n")
    generated = tmp_path / "cgen.py"
    generated.write_text(
        "def call(args):\n"
        "    # Topologically Sorted Source Nodes: [mul_3, index_add], Original ATen: [aten.mul, aten.index_add]\n"
        "    buf0 = empty_strided_cuda((65536, 2048), (2048, 1), torch.float32)\n"
        "    buf1 = empty_strided_cuda((8192, 2048), (2048, 1), torch.bfloat16)\n"
    )

    def frame(path, line, name="forward"):
        return {"filename": str(path), "line": line, "name": name}

    return model, generated, frame


def test_replay_finds_the_peak_and_what_is_live_at_it(code):
    """Blocks count from alloc to free_requested; a block allocated before the recording and freed in it lowers
    the count; the peak's live blocks are grouped by the first frame outside torch."""
    model, generated, frame = code
    h, y, buf0 = frame(model, 2), frame(model, 3), frame(generated, 3, "call")
    events = [
        _alloc(1, 100, [TORCH_FRAME, h]),
        _alloc(2, 200, [TORCH_FRAME, y]),  # 1300: a first peak
        {"action": "free_completed", "addr": 9, "size": 7, "frames": []},  # no change of the count
        _free(1, 100),
        _alloc(3, 50, [h]),
        _free(77, 500),  # allocated before the recording
        _alloc(4, 600, [buf0]),  # 1000 + 200 + 50 - 500 + 600 = 1350: the peak
        _alloc(5, 10, [buf0]),  # 1360: higher still
        _free(4, 600),
        _alloc(6, 300, [y]),  # 1060
    ]
    peak = live_at_peak(events, baseline=1000)
    assert peak.peak == 1360 and peak.baseline == 1000
    by_line = {site.where: (size, blocks) for site, (size, blocks) in peak.sites.items()}
    assert by_line == {"model.py:3 (forward)": (200, 1), "model.py:2 (forward)": (50, 1), "cgen.py:3 (call)": (610, 2)}
    assert peak.recorded == 860
    site = next(s for s in peak.sites if s.where.startswith("cgen.py"))
    assert site.code.startswith("buf0 = empty_strided_cuda((65536, 2048)") and site.nodes == "[mul_3, index_add]"
    assert next(s for s in peak.sites if s.where == "model.py:3 (forward)").code == "y = h.relu()"


def test_a_trace_that_only_frees_peaks_at_its_baseline():
    peak = live_at_peak([_free(5, 64)], baseline=4096)
    assert peak.peak == 4096 and peak.sites == {}


def test_sites_outside_torch_and_fallbacks(code):
    model, generated, frame = code
    assert allocation_site([TORCH_FRAME]).where == "functional.py:1 (f)"  # only torch's: the innermost
    assert allocation_site([{"filename": "??", "line": 0, "name": "malloc"}]) == Site("?", "", "")  # C++ frames
    site = allocation_site([frame(generated, 4, "call")])
    assert site.nodes == "[mul_3, index_add]"  # the nearest comment above, past other buffers' lines
    assert allocation_site([frame(model, 3)]).nodes == ""  # no comment before the def


def test_the_header_adds_up_where_the_run_frees_what_was_held_before(code):
    """Half of the 1 GiB held before is freed, then 0.6 GiB allocated: the peak is 1.1 GiB = 0.5 + 0.6."""
    model, _, frame = code
    events = [_free(100, 2**29), _alloc(1, int(0.6 * 2**30), [frame(model, 1)])]
    head = peak_table(live_at_peak(events, baseline=2**30)).splitlines()[0]
    assert head.startswith("peak 1.10 GiB = 0.50 held from before the run (of 1.00) + 0.60 allocated in it")


def test_table_lists_the_largest_sites_first_and_sums_the_rest(code):
    model, _, frame = code
    events = [_alloc(i, (i + 1) * 2**20, [frame(model, i % 4 + 1)]) for i in range(4)]
    table = peak_table(live_at_peak(events, baseline=2**30), top=2)
    lines = table.splitlines()
    assert lines[0] == (
        "peak 1.01 GiB = 1.00 held from before the run (of 1.00) + 0.01 allocated in it and live at the peak; "
        "the sites listed hold 0.01 of those 0.01"
    )
    assert lines[4].startswith("| 4.0 | 1 | model.py:4 (forward) | `return y` |")
    assert lines[5].startswith("| 3.0 | 1 | model.py:3 (forward) | `y = h.relu()` |")
    assert lines[6] == "| 3.0 | 2 | 2 other sites | | |"
    assert peak_table(live_at_peak(events, baseline=0), top=3).splitlines()[-1] == "| 1.0 | 1 | 1 other site | | |"
    with pytest.raises(ValueError, match="peak_table: top=0 must be at least 1"):
        peak_table(live_at_peak(events, baseline=0), top=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recorded_peak_is_the_allocators_peak():
    """On a GPU: the replayed peak equals ``max_memory_allocated``, and the largest live site is this test's
    allocation of it."""
    held = torch.empty(2**20, device="cuda")

    def run():
        a = torch.empty(2**24, device="cuda")  # 64 MiB
        b = torch.empty(2**22, device="cuda")  # live with a at the peak
        del a
        c = torch.empty(2**10, device="cuda")
        return b, c

    peak, allocator_peak = record_peak(run)
    assert peak.peak == allocator_peak
    assert peak.baseline >= held.untyped_storage().nbytes()
    (top, (size, blocks)), *_ = sorted(peak.sites.items(), key=lambda kv: -kv[1][0])
    assert size == 2**26 and blocks == 1 and "torch.empty(2**24" in top.code
