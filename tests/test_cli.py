"""Bad input: one line naming the bad value and what is allowed, exit code 2, no files."""

import pytest
import torch

import harness.errors as errors
from harness.grad_study import main

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}

BAD_INPUT = [
    # (flags, text the one line must contain)
    (["--world-sizes", "3"], "3 is larger than the launch's 2 ranks"),
    (["--world-sizes", "0"], "0 is not allowed; allowed: integers >= 1"),
    (["--world-sizes", "1,x"], "'x' is not an integer"),
    (["--world-sizes", "1,1"], "repeats a value"),
    (["--world-sizes", "-1"], "-1 is not allowed"),
    (["--studies", "redution"], "'redution' is unknown; allowed: reduction"),
    (["--studies", ""], "--studies is empty"),
    (["--studies", "reduction,reduction"], "repeats a study"),
    (["--strategies", "fsdp9"], "'fsdp9' is unknown; allowed: local, ddp"),
    (["--dtype", "float16"], "'float16' is unknown; allowed: float64, float32"),
    (["--backend", "mpi"], "'mpi' is unknown; allowed: auto, gloo, nccl"),
    (["--device", "tpu"], "'tpu' is unknown; allowed: auto, cpu, cuda"),
    (["--matrix", "huge"], "'huge' is unknown; allowed: default, full"),
    (["--shard-size", "0"], "--shard-size 0 is not allowed"),
    (["--shard-size", "two"], "--shard-size 'two' is not an integer"),
    (["--accum-steps", "0,2"], "--accum-steps: 0 is not allowed"),
    (["--epochs", "0"], "--epochs 0 is not allowed"),
    (["--timeout", "0"], "--timeout 0 is not allowed; allowed: 0 < seconds <= 86400 (a day)"),
    (["--timeout", "1e15"], "--timeout 1e+15 is not allowed; allowed: 0 < seconds <= 86400"),
    (["--timeout", "inf"], "--timeout inf is not allowed"),
    (["--timeout", "nan"], "--timeout nan is not allowed"),
    (["--timeout", "soon"], "--timeout 'soon' is not a number"),
    (["--seed", "-3"], "--seed -3 is not allowed"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--studies", "reduction,,seed001"], "has an empty item"),
    (["--strategies", "ddp,"], "has an empty item"),
    (["--studies", "reduction", "--epochs", "3"],
     "--epochs belongs to the training study, which --studies does not select"),
    (["--accum-steps", "100"], "--accum-steps: 100 is not allowed; allowed: 1..64"),
    (["--epochs", "1000"], "--epochs 1000 is not allowed; allowed: 1..100"),
    (["--shard-size", "99999"], "--shard-size 99999 is not allowed; allowed: 1..4096"),
]

CUDA_ONLY_BAD_INPUT = [
    (["--backend", "nccl"], "--backend nccl needs CUDA devices"),
    (["--device", "cuda"], "--device cuda needs a CUDA device"),
]


def run_main(argv, env, monkeypatch, capsys, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code = main([*argv, "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured, out


@pytest.mark.parametrize("flags, message", BAD_INPUT + (
    [] if torch.cuda.is_available() else CUDA_ONLY_BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_no_files(flags, message, monkeypatch, capsys,
                                                   tmp_path):
    code, captured, out = run_main(flags, TORCHRUN_ENV, monkeypatch, capsys, tmp_path)
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("study.py: error: ")
    assert message in lines[0]
    assert not out.exists()


def test_without_torchrun_says_how_to_launch(monkeypatch, capsys, tmp_path):
    code, captured, out = run_main([], {}, monkeypatch, capsys, tmp_path)
    assert code == 2
    assert "needs --nproc N or torchrun to start its ranks" in captured.err
    assert "python scripts/study.py --nproc 4" in captured.err
    assert "torchrun --standalone --nproc_per_node=4 scripts/study.py" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert not out.exists()


def test_every_study_flag_is_documented_with_its_dataclass_default(capsys):
    from harness.studies import STUDIES

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for study in STUDIES.values():
        for field in study.Options.flags():
            default = field.default
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
            assert f"{field.metadata['help']} (default: {shown})" in text


def test_only_rank_0_speaks(monkeypatch, capsys, tmp_path):
    # Rank 1 would wait for rank 0's line to get out under torchrun: there is none here.
    monkeypatch.setattr(errors, "QUIET_RANK_EXIT_DELAY_S", 0)
    env = {**TORCHRUN_ENV, "RANK": "1", "LOCAL_RANK": "1"}
    code, captured, _ = run_main(["--dtype", "float16"], env, monkeypatch, capsys, tmp_path)
    assert code == 2 and captured.err == "" and captured.out == ""


def test_out_that_is_a_file_is_refused(monkeypatch, capsys, tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert main(["--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_out_that_cannot_be_created_is_refused_before_anything_runs(monkeypatch, capsys,
                                                                    tmp_path):
    inside_a_file = tmp_path / "file.txt"
    inside_a_file.write_text("keep me")
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert main(["--out", str(inside_a_file / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"study.py: error: --out '{inside_a_file / 'results'}' cannot be created or "
                   f"written: Not a directory in '{inside_a_file}'; allowed: a folder you can "
                   "write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"], "the probe is gone"


def test_list_names_every_study(capsys):
    from harness.studies import STUDIES

    assert main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(STUDIES)


def test_help_explains_every_flag_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--studies", "--world-sizes", "--strategies", "--backend", "--device",
                 "--dtype", "--out", "--seed", "--shard-size", "--accum-steps", "--matrix",
                 "--epochs", "--timeout", "--resume", "--quiet", "--no-report", "--list"):
        assert flag in text
    assert "torchrun --standalone --nproc_per_node=4 scripts/study.py --studies reduction" in text
