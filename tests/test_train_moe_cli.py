"""The main job's command line (``examples/train_moe.py``, loaded from its path): ``--help`` gives every option a help
line and its default; a bad value ends in an argparse error naming its flag, the value and what to do (exit status
2, no traceback), before anything trains; the backend arm is named by the format it runs.

Each test parses arguments or stops before training: none compiles or trains a model.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import mxfx
from tests.helpers import load_example

_path = list(sys.path)
train_moe = load_example("train_moe")
sys.path[:] = _path  # the script puts examples/ first on sys.path for its own imports; the tests need it no longer


def cli_error(capsys, *argv: str) -> str:
    """The one-line error ``train_moe.main(argv)`` exits with (status 2), whitespace collapsed."""
    with pytest.raises(SystemExit) as exit_info:
        train_moe.main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split("error: ", 1)[1].split())


def test_help_shows_every_option_with_its_help_and_default():
    text = " ".join(train_moe.build_parser().format_help().split())  # argparse wraps lines: compare unwrapped
    for f in dataclasses.fields(train_moe.TrainConfig):
        assert f"{f.metadata['help']} (default: {f.default})" in text, f.name


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--format", "fp4"], ["argument --format", "'fp4'", "'mxfp8'", "'fp8_block'", "'auto'"]),
        (["--steps", "0"], ["argument --steps", "must be >= 1, got 0"]),
        (["--log-every", "0"], ["argument --log-every", "must be >= 1, got 0"]),
        (["--d-model", "100"], ["argument --d-model", "d_model=100", "multiple of 32", "e.g. 96"]),
        (["--topk", "9"], ["argument --topk", "top_k=9", "n_experts=8"]),
        (["--data", "/no/such/file.txt"], ["argument --data", "'/no/such/file.txt' is not a file", "leave --data out"]),
        (["--device", "gpu"], ["argument --device", "'gpu'", "trains on cpu or cuda", "use --device cpu"]),
        (["--arms", "fp32,bf16"], ["argument --arms", "'fp32,bf16'", "one reference arm"]),
        (["--arms", "mxfp8,mxfp8"], ["argument --arms", "'mxfp8,mxfp8'"]),
        (["--device", "meta"], ["argument --device", "'meta'", "trains on cpu or cuda"]),
        (["--device", "cuda:99"], ["argument --device", "'cuda:99' is not usable here", "use --device cpu"]),
        (["--device", "hpu"], ["argument --device", "'hpu'", "trains on cpu or cuda"]),
        (["--device", "mps"], ["argument --device", "'mps'", "trains on cpu or cuda"]),
        (["--tolerance", "5"], ["argument --tolerance", "must be <= 1, got 5.0"]),
        (["--lr", "nan"], ["argument --lr", "must be a finite number, got nan"]),
        (["--lr", "-1"], ["argument --lr", "must be > 0, got -1.0"]),
        (["--min-lr-frac", "1.5"], ["argument --min-lr-frac", "must be <= 1, got 1.5"]),
        (["--grad-clip", "0"], ["argument --grad-clip", "must be > 0, got 0.0"]),
        (["--tolerance", "-0.1"], ["argument --tolerance", "must be >= 0, got -0.1"]),
        (["--data-seed", str(2**64)], ["argument --data-seed", "must be <= 9223372036854775806"]),
        (["--backend-options", "[1]"], ["argument --backend-options", "must be a JSON object"]),
        (["--backend-options", '{"scale_rule": "x"}'], ["argument --backend-options", "scale_rule='x'"]),
        # fp8_block blocks are 128 wide: 96 is a multiple of the model's 32 but keeps every fp8_block GEMM as written
        (["--format", "fp8_block", "--expert-hidden", "96"], ["argument --expert-hidden", "96", "multiple of 128"]),
    ],
)
def test_bad_value_names_its_flag(capsys, argv, expected):
    message = cli_error(capsys, *argv)
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")
def test_cuda_without_cuda_names_device(capsys):
    assert "argument --device: 'cuda' is not usable here" in cli_error(capsys, "--device", "cuda")


def test_bad_data_file_names_its_flag(capsys, tmp_path):
    """Files that exist but cannot train: not UTF-8; shorter than a sequence in a split (--seq is to blame)."""
    latin1, short = tmp_path / "latin1.txt", tmp_path / "short.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1") * 100)
    short.write_text("x" * 300)  # a held-out split of 30 bytes
    out = str(tmp_path / "runs")
    assert "argument --data" in cli_error(capsys, "--data", str(latin1), "--arms", "fp32", "--out", out)
    message = cli_error(capsys, "--data", str(short), "--arms", "fp32", "--out", out)
    assert "argument --seq: 128" in message and "270 train / 30 held-out" in message, message
    short.write_text("")  # an empty file: no bytes to split
    message = cli_error(capsys, "--data", str(short), "--arms", "fp32", "--out", out)
    assert "splits into 0 train / 0 held-out" in message, message


def test_out_that_is_a_file_names_its_flag(capsys, tmp_path):
    (tmp_path / "runs").write_text("")
    assert "argument --out" in cli_error(capsys, "--arms", "fp32", "--out", str(tmp_path / "runs"))


@pytest.mark.parametrize(
    "argv, label",
    [
        ([], "mxfp8"),
        (["--format", "fp8_block"], "fp8_block"),
        (["--format", "fp8_block", "--backend-options", '{"format": "bf16_gemm"}'], "bf16_gemm"),  # options win
        (["--format", "auto"], mxfx.formats.get("auto").name),  # as the backend resolves it on this machine
    ],
)
def test_backend_arm_is_named_by_its_format(argv, label):
    cfg = train_moe.parse_args(train_moe.build_parser(), argv)
    assert train_moe.arm_label("mxfp8", cfg) == label
    assert train_moe.arm_label("fp32", cfg) == "fp32"


study = load_example("scale_rule_study")
sys.path[:] = _path


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--steps", "0"], ["argument --steps", "must be >= 1, got 0"]),
        (["--lr", "nan"], ["argument --lr", "must be a finite number, got nan"]),
        (["--grad-clip", "-1"], ["argument --grad-clip", "must be > 0, got -1.0"]),
        (["--seed", "-3"], ["argument --seed", "must be >= 0, got -3"]),
        (["--device", "mps"], ["argument --device", "'mps'", "trains on cpu or cuda"]),
        (["--d-model", "100"], ["d_model=100", "multiple of 32"]),
        (["--topk", "9"], ["top_k=9", "n_experts=8"]),
    ],
)
def test_the_scale_rule_study_refuses_bad_values_like_the_main_job(capsys, argv, expected):
    """``examples/scale_rule_study.py`` checks its options with the main job's checks: one argparse line (exit
    status 2), nothing trained."""
    with pytest.raises(SystemExit) as exit_info:
        study.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    message = " ".join(err.split("error: ", 1)[1].split())
    for part in expected:
        assert part in message, (part, message)
