"""Run by tests/test_harness.py under pytest-xdist (not collected by the suite itself: not ``test_*.py``): one
session job read by several tests, beside tests reading nothing."""

import os

import pytest


def _once(environ):
    with open(environ["MXFX_PROBE_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return "ran"


BACKGROUND_JOBS = {"once": _once}


@pytest.mark.parametrize("i", range(4))
def test_reads_the_job(session_job, i):
    assert session_job("xdist_probe:once") == "ran"


@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    assert i >= 0
