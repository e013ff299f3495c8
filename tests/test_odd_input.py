"""Empty and odd values given to any of the commands are refused in one line (exit 2)
before anything is written: a flag given empty is never read as its default, a number is
ASCII digits (Python's int() also takes '１２' and '1_0'), a value that starts with a minus
is the flag's value, not an unknown option, and a global batch is bounded by what a
run can hold."""

from __future__ import annotations

import pytest

from harness.errors import USAGE_EXIT
from harness.grad_check.cli import main as grad_check
from harness.grad_study import main as grad_study
from harness.options import parse_float, parse_int, parse_int_list, parse_out, strict_int

SETUP = "examples.readme_check:make_setup"
#: A command grad-check run never gets to start: every case below is refused first.
COMMAND = ["--", "python", "train.py", "{batch}", "{accum}"]


def refused(capsys, command, argv: list[str]) -> str:
    """The one line ``command(argv)`` printed, having exited 2."""
    assert command(argv) == USAGE_EXIT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("text", ["", " ", "１２", "٣", "1_0", "0x10", "4.0", "--1"])
def test_an_integer_is_ascii_digits_with_an_optional_sign(text):
    with pytest.raises(ValueError):
        strict_int(text)
    with pytest.raises(Exception, match="is not an integer; allowed: ASCII digits"):
        parse_int(text, "--seed")


def test_what_an_integer_and_a_number_may_be_written_as():
    assert [strict_int(text) for text in ("4", " 4 ", "+4", "-4", "007")] == [4, 4, 4, -4, 7]
    assert parse_float("1e-3", "--timeout") == 1e-3 and parse_float(".5", "--timeout") == 0.5
    for text in ("", "１.５", "1_0.5", "1e", "0x1p3"):
        with pytest.raises(Exception, match="is not a number; allowed: an ASCII decimal"):
            parse_float(text, "--timeout")


def test_an_empty_list_or_folder_is_refused_naming_the_flag():
    with pytest.raises(Exception, match="^--world-sizes is empty; allowed: comma-separated"):
        parse_int_list(" ", "--world-sizes")
    with pytest.raises(Exception, match="^--out is empty; allowed: a folder's name"):
        parse_out("")


@pytest.mark.parametrize("argv, said", [
    (["--out", ""], "--out is empty"),
    (["--world-sizes", ""], "--world-sizes is empty"),
    (["--world-sizes", "１,2"], "'１' is not an integer"),
    (["--seed", "1_0"], "--seed '1_0' is not an integer"),
    (["--studies", "accumulation", "--accum-steps", ""], "--accum-steps is empty"),
])
def test_grad_study_refuses_empty_and_odd_values(argv, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, grad_study, ["--nproc", "2", *argv])
    assert said in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written, in the current folder least


@pytest.mark.parametrize("argv, said", [
    (["--out", ""], "--out is empty"),
    (["--world-sizes", ""], "--world-sizes is empty"),
    (["--frameworks", ""], "--frameworks is empty"),
    (["--accum-steps", "１"], "'１' is not an integer"),
])
def test_grad_check_refuses_empty_and_odd_values(argv, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, grad_check, ["--nproc", "2", SETUP, *argv])
    assert said in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, said", [
    (["--out", ""], "--out is empty"),
    (["--splits", "１x2"], "'１x2' is not a split"),
    (["--splits", "1x1,2x２"], "'2x２' is not a split"),
    # Once read as an unknown option ("expected one argument").
    (["--splits", "-1x1"], "'-1x1' is not a split"),
    (["--reference", "-2x1"], "'-2x1' is not a split"),
    (["--splits", "257x1"], "1 <= N <= 256"),
    (["--global-batch", str(2**64)], f"--global-batch {2**64} is not allowed; allowed: 1.."),
    (["--global-batch", "１６"], "--global-batch '１６' is not an integer"),
    (["--steps", ""], "--steps '' is not an integer"),
])
def test_grad_check_run_refuses_empty_and_odd_values(argv, said, capsys, tmp_path,
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = {"--global-batch": "8", "--splits": "1x2", "--out": "out"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        options[flag] = value
    line = refused(capsys, grad_check,
                   ["run", *[part for pair in options.items() for part in pair], *COMMAND])
    assert said in line, line
    assert list(tmp_path.iterdir()) == []
