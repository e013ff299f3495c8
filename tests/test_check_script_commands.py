"""``grad-check run`` takes the commands real trainers take, and fails in words a user can
act on, without running a command: placeholder arithmetic and escapes, k derived from
the micro and global batch, launchers at the command's head, the flags that say who
starts the ranks, the program's name, the failing frame's file:line, which rank is
blamed, what a hang names, and the guard every process of a split runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from harness.errors import UsageError, error_file
from harness.grad_check.script import guard, pids, wire
from harness.grad_check.script.failures import (
    SplitFailure,
    first_failure,
    hang,
    launched_failure,
    lost_a_peer,
    missing_ranks,
    progress,
)
from harness.grad_check.script.grad_check_run import main, program_name
from harness.grad_check.script.launchers import adapted, check_launcher, launcher_of
from harness.grad_check.script.processes import CommandLauncher, sweep
from harness.grad_check.script.script_config import ScriptConfig
from harness.grad_check.script.splits import Split, check_placeholders, substituted
from tests.test_check_script import refused

SCRIPT = str(Path(__file__).resolve().parent / "script_program.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node={nproc}", SCRIPT, "--batch-size", "{batch}",
            "--grad-accum", "{accum}"]


# ---------------------------------------------------------------- placeholders
def test_placeholders_take_integer_arithmetic_over_their_names():
    command = ["t.py", "--gradient_accumulation_steps={nproc*accum}",
               "--total_batch_size", "{global_batch*1024}", "--half", "{ (global_batch - 2) // 3 }",
               "--tokens={batch*64}"]
    assert substituted(command, Split(2, 4), 32) == [
        "t.py", "--gradient_accumulation_steps=8", "--total_batch_size", "32768", "--half",
        "10", "--tokens=256"]


def test_doubled_braces_are_literal_and_an_arguments_own_braces_are_kept():
    values = Split(1, 2).values(8)
    assert substituted(["print(f'{{step}}: {{loss:.3f}}')"], Split(1, 2), 8) == [
        "print(f'{step}: {loss:.3f}')"]
    assert substituted(['{"a": {"b": {"accum": {accum}}}}', "{0}", "{HOME}"],
                       Split(1, 2), 8) == ['{"a": {"b": {"accum": 2}}}', "{0}", "{HOME}"]
    assert values["accum"] == 2


@pytest.mark.parametrize(("argument", "named"), [
    ("{global_batch/3}", "{global_batch/3} is 8/3 = 2.66667, not a whole number"),
    ("{nproc*}", "{nproc*} is not an expression"),
    ("{accum//(nproc-1)}", "divides by 0 at accum=1, nproc=1"),
    ("{step}", "write {{step}} for a literal {step}"),
])
def test_a_placeholder_that_is_not_a_whole_number_at_every_split_is_refused(argument, named):
    with pytest.raises(UsageError, match=None) as refusal:
        check_placeholders(["t.py", "--batch-size", "{batch}", "--accum", "{accum}", argument],
                           [Split(1, 1), Split(2, 1)], 8)
    assert named in str(refusal.value)


def test_k_may_follow_from_the_micro_batch_and_the_global_batch():
    splits = [Split(1, 1), Split(1, 4), Split(2, 2)]
    # llm.c: the total batch in tokens; LitGPT: the global batch; k follows.
    check_placeholders(["t.py", "--batch_size", "{batch}", "--total_batch_size",
                        "{global_batch*64}"], splits, 8)
    check_placeholders(["t.py", "--micro_batch_size", "{batch}", "--global_batch_size",
                        "{global_batch}"], splits, 8)
    with pytest.raises(UsageError, match=r"split 1x4 accumulates 4 micro-steps but the command "
                                         r"has no \{accum\}.*\{batch\} and \{global_batch\}"):
        check_placeholders(["t.py", "--batch_size", "{batch}"], splits, 8)


# ---------------------------------------------------------------- launchers
@pytest.mark.parametrize(("command", "name"), [
    (["torchrun", "--nproc_per_node=2", "t.py"], "torchrun"),
    (["/usr/bin/python3.11", "-m", "torch.distributed.run", "t.py"],
     "python -m torch.distributed.run"),
    (["accelerate", "launch", "t.py"], "accelerate launch"),
    (["python", "-m", "accelerate.commands.launch", "t.py"], "accelerate launch"),
    (["deepspeed", "--num_gpus", "2", "t.py"], "deepspeed"),
    (["trl", "sft", "--model_name_or_path", "m"], "trl sft"),
    (["env", "ACCELERATE_USE_CPU=true", "accelerate", "launch", "t.py"], "accelerate launch"),
    (["/usr/bin/env", "-u", "RANK", "--chdir=/tmp", "-i", "torchrun", "t.py"], "torchrun"),
    (["env", "OMP_NUM_THREADS=1", "python", "-m", "torch.distributed.run", "t.py"],
     "python -m torch.distributed.run"),
    (["env", "-S", "torchrun t.py"], None),
    (["env", "A=1", "python", "t.py"], None),
    (["python", "t.py"], None),
    (["accelerate", "config"], None),
    (["trl", "env"], None),
    (["tune", "run", "--nproc_per_node", "{nproc}", "full_finetune_distributed", "--config",
      "llama3_2/1B_full"], "tune run"),
    (["python", "-m", "torchtune._cli.tune", "run", "--nproc-per-node={nproc}", "recipe.py",
      "--config", "c.yaml"], "tune run"),
    (["tune", "run", "--standalone", "full_finetune_distributed", "--config", "c"],
     "tune run"),
    # No torchrun option before the recipe: tune runs it in its own process, a plain one.
    (["tune", "run", "lora_finetune_single_device", "--config", "c", "--nproc_per_node", "2"],
     None),
    (["python", "-m", "torchtune._cli.tune", "run", "recipe.py", "--config", "c.yaml"], None),
    (["tune", "ls"], None),
])
def test_a_launcher_at_the_head_of_the_command_is_recognised(command, name):
    found = launcher_of(command)
    assert (found.name if found else None) == name


@pytest.mark.parametrize(("command", "named"), [
    (["torchrun", "--nproc_per_node=2", "t.py"],
     "torchrun --nproc_per_node 2 starts the same processes at every split, but split 1x1 "
     "needs 1; allowed: --nproc_per_node {nproc}"),
    (["torchrun", "t.py"], "torchrun without --nproc_per_node (1) starts the same processes "
                           "at every split, but split 2x1 needs 2"),
    (["torchrun", "--nnodes=2", "--nproc_per_node={nproc}", "t.py"],
     "torchrun --nnodes 2 spans machines; allowed: one machine"),
    (["accelerate", "launch", "--num_machines", "2", "--num_processes", "{nproc}", "t.py"],
     "accelerate launch --num_machines 2 spans machines"),
    (["trl", "sft", "--model_name_or_path", "m"], "trl sft without --num_processes"),
    (["tune", "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "c"],
     "tune run --nproc_per_node 2 starts the same processes at every split, but split 1x1 "
     "needs 1; allowed: --nproc_per_node {nproc}"),
    (["tune", "run", "--standalone", "full_finetune_distributed", "--config", "c"],
     "tune run without --nproc_per_node (1) starts the same processes at every split, but "
     "split 2x1 needs 2"),
    (["tune", "run", "--nnodes", "2", "--nproc_per_node", "{nproc}", "r", "--config", "c"],
     "tune run --nnodes 2 spans machines"),
])
def test_a_launcher_that_cannot_run_the_splits_is_refused_by_name(command, named):
    with pytest.raises(UsageError) as refusal:
        check_launcher(launcher_of(command), command, [Split(1, 1), Split(2, 1)])
    assert named in str(refusal.value)


def test_a_launcher_given_nproc_is_run_as_it_is():
    for command in (["torchrun", "--nproc-per-node", "{nproc}", "t.py"],
                    ["deepspeed", "--num_gpus={nproc}", "t.py"],
                    ["trl", "sft", "--num_processes", "{nproc}"]):
        check_launcher(launcher_of(command), command, [Split(1, 1), Split(2, 1)])


def test_tune_run_s_own_options_are_torchrun_s_before_the_recipe():
    """tune run passes torchrun's options (those before the recipe, a name or a path) to
    torchrun; what follows the recipe is the recipe's, whatever it looks like."""
    command = ["tune", "run", "--rdzv_backend", "c10d", "--standalone", "--nproc_per_node",
               "{nproc}", "full_finetune_distributed", "--config", "c", "--nnodes", "2",
               "--nproc_per_node", "2"]
    head = launcher_of(command)
    check_launcher(head, command, [Split(1, 1), Split(2, 1)])
    assert adapted(head, command, Split(2, 1), gpus=0) == (command, {})
    module = [sys.executable, "-m", "torchtune._cli.tune", "run", "--nproc_per_node",
              "{nproc}", "r", "--config", "c.yaml", "batch_size={batch}"]
    assert config(*module).launched_by == "tune run"
    assert config(*module[:4], *module[6:]).launched_by is None  # the recipe in its process


def test_accelerate_on_a_machine_without_gpus_is_given_what_it_needs_for_several():
    """Without GPUs accelerate launch starts one plain process whatever --num_processes
    says; --multi_gpu makes it start N (torch elastic, as with N GPUs), and
    ACCELERATE_USE_CPU makes each worker's Accelerator distributed on CPUs."""
    command = ["accelerate", "launch", "--num_processes", "2", "t.py", "--lr", "1"]
    head = launcher_of(command)
    assert adapted(head, command, Split(2, 1), gpus=0) == (
        ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "t.py", "--lr", "1"],
        {"ACCELERATE_USE_CPU": "1"})
    assert adapted(head, command, Split(1, 1), gpus=0) == (command, {"ACCELERATE_USE_CPU": "1"})
    assert adapted(head, command, Split(2, 1), gpus=2) == (command, {})
    trl = ["trl", "sft", "--num_processes", "2", "--output_dir", "o"]
    assert adapted(launcher_of(trl), trl, Split(2, 1), 0)[0][:3] == ["trl", "sft", "--multi_gpu"]
    torchrun = ["torchrun", "--nproc_per_node=2", "t.py"]
    assert adapted(launcher_of(torchrun), torchrun, Split(2, 1), 0) == (torchrun, {})


def test_a_launcher_behind_env_takes_its_arguments_after_env_and_the_launcher():
    command = ["env", "ACCELERATE_USE_CPU=true", "accelerate", "launch", "--num_processes",
               "{nproc}", "t.py", "--lr", "1"]
    head = launcher_of(command)
    check_launcher(head, command, [Split(1, 1), Split(2, 1)])
    assert adapted(head, command, Split(2, 1), gpus=0)[0] == [
        "env", "ACCELERATE_USE_CPU=true", "accelerate", "launch", "--multi_gpu",
        "--num_processes", "{nproc}", "t.py", "--lr", "1"]
    with pytest.raises(UsageError, match="torchrun without --nproc_per_node"):
        check_launcher(launcher_of(["env", "A=1", "torchrun", "t.py"]), ["env", "A=1",
                       "torchrun", "t.py"], [Split(2, 1)])


def test_accelerate_told_cpu_runs_its_n_processes_on_cpus_at_every_n():
    """accelerate launch --cpu takes its simple launcher (one process) whatever
    --num_processes says, with GPUs or without: at N > 1 it runs as --multi_gpu with
    ACCELERATE_USE_CPU, the N processes on CPUs the command asks for."""
    command = ["accelerate", "launch", "--num_processes", "2", "--cpu", "t.py", "--cpu"]
    head = launcher_of(command)
    many = (["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "t.py", "--cpu"],
            {"ACCELERATE_USE_CPU": "1"})
    assert adapted(head, command, Split(2, 1), gpus=0) == many
    assert adapted(head, command, Split(2, 1), gpus=2) == many
    assert adapted(head, command, Split(1, 2), gpus=0) == (command, {"ACCELERATE_USE_CPU": "1"})
    assert adapted(head, command, Split(1, 2), gpus=2) == (command, {})


def config(*command: str, **settings) -> ScriptConfig:
    return ScriptConfig(command=tuple(command), global_batch=8,
                        splits=(Split(1, 1), Split(2, 1)), **settings)


def test_the_command_s_launcher_starts_the_ranks_unless_told_otherwise():
    assert config(*TORCHRUN).launched_by == "python -m torch.distributed.run"
    plain = [sys.executable, SCRIPT, "--batch-size", "{batch}"]
    assert config(*plain).launched_by is None
    assert config(*plain, launcher="command").launched_by == "the command"


@pytest.mark.parametrize(("argv", "named"), [
    (["--launcher", "grad-check", "--", *TORCHRUN],
     "--launcher grad-check runs the command once per rank, but python -m "
     "torch.distributed.run at its head starts ranks itself"),
    (["--torchrun-env", "--", *TORCHRUN], "--torchrun-env gives torchrun's variables"),
    (["--launcher", "nobody", "--", *TORCHRUN], "--launcher"),
    (["--", *TORCHRUN[:4], "--nproc_per_node=2", *TORCHRUN[5:]],
     "starts the same processes at every split, but split 1x1 needs 1"),
    (["--", *TORCHRUN[:5], "missing_train.py", "--batch-size", "{batch}"],
     "the script 'missing_train.py' that python -m torch.distributed.run starts is not found"),
    (["--", sys.executable, SCRIPT, "--batch-size", "{batch}", "--accum", "{accum*2/3}"],
     "{accum*2/3} is 2/3 = 0.666667, not a whole number"),
])
def test_bad_commands_and_launch_flags_are_one_line_exit_2_and_no_csv(capsys, tmp_path, argv,
                                                                        named):
    line = refused(capsys, tmp_path, "--global-batch", "8", "--splits", "1x1,2x1", *argv)
    assert named in line, line


def test_messages_use_the_name_the_user_typed(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/home/me/.venv/bin/grad-check", "run"])
    assert program_name() == "grad-check run"
    monkeypatch.setattr(sys, "argv", ["scripts/check.py", "run"])
    assert program_name() == "check.py run"
    code = main(["--global-batch", "8", "--splits", "2x", "--out", str(tmp_path / "o"),
                 "--", sys.executable, SCRIPT])
    assert code == 2
    assert capsys.readouterr().err.startswith("check.py run: error: --splits: '2x'")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: check.py run [options] -- COMMAND...")


def test_help_explains_the_new_flags_and_the_arithmetic(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grad-check", "run"])
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for phrase in ("--launcher", "--torchrun-env", "{nproc*accum}", "{{ and }}",
                   "k > 1 needs no {accum}", "torchrun", "accelerate launch", "tune run",
                   "logs/"):
        assert phrase in text, phrase


def test_rank_settings_travel_through_the_environment_and_refuse_bad_values(tmp_path):
    """What grad-check tells a split's processes is read back as it was written; a value
    no split can have is refused by name, not read as a default."""
    told = wire.RankSettings(tmp_path, 3, True, 12.5, 41, "977", 40, 2, "2x2", 4,
                             tmp_path / "reference", "torchrun")
    assert wire.RankSettings.from_environment(told.environment()) == told
    plain = replace(told, keep_going=False, micro_batch=None, against=None, launcher=None)
    assert wire.RankSettings.from_environment(plain.environment()) == plain
    assert wire.RankSettings.from_environment({"PATH": "/bin"}) is None
    for bad in ({wire.STEPS_VARIABLE: "0"}, {wire.NPROC_VARIABLE: "two"},
                {wire.TIMEOUT_VARIABLE: "-1"}):
        with pytest.raises(wire.BadSettings, match=str(tmp_path)):
            wire.RankSettings.from_environment({**told.environment(), **bad})


def test_a_launcher_gets_no_torchrun_variables_and_its_workers_are_told_n(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    launch = CommandLauncher(steps=2, keep_going=False, timeout=60, launcher="torchrun")
    environment = launch.environment(None, 2, 0, tmp_path, "run", "2x1",
                                     {"ACCELERATE_USE_CPU": "1"})
    assert "RANK" not in environment and "WORLD_SIZE" not in environment
    assert environment[wire.LAUNCHER_VARIABLE] == "command"
    assert environment[wire.NPROC_VARIABLE] == "2"
    assert environment[wire.PID_VARIABLE] == str(os.getpid())
    assert environment["ACCELERATE_USE_CPU"] == "1"
    alone = CommandLauncher(steps=2, keep_going=False, timeout=60, torchrun_env=True)
    one = alone.environment(0, 1, 29500, tmp_path, "run", "1x1")
    assert (one["RANK"], one["WORLD_SIZE"], one["MASTER_PORT"]) == ("0", "1", "29500")


# ---------------------------------------------------------------- the failing frame
def raised(code: str) -> str:
    """The line the capture records for the error ``code`` raises, in this file's folder."""
    namespace: dict = {}
    path = Path(__file__).resolve().parent / "script_program.py"
    try:
        exec(compile(code, str(path), "exec"), namespace)
    except Exception as error:  # noqa: BLE001 -- the error is what is looked at
        return guard.failed(error, error.__traceback__).line
    raise AssertionError("nothing raised")


def test_an_error_names_the_file_and_line_of_the_failing_frame(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    # A bare assert says nothing: the source line stands for its message (line 1 of the
    # compiled code is line 1 of the file named: its docstring's first line).
    assert raised("assert 1 == 2") == \
        f'AssertionError: {Path(SCRIPT).read_text().splitlines()[0]} ' \
        "(at tests/script_program.py:1)"
    assert raised("\n\nraise RuntimeError('boom. More')") == \
        "RuntimeError: boom (at tests/script_program.py:3)"
    # An error raised inside an installed package names the user's frame that called it.
    assert raised("import json\njson.loads('{')").endswith("(at tests/script_program.py:2)")
    namespace: dict = {}
    try:
        exec(compile("\nraise ValueError('no GPU. At all')", SCRIPT, "exec"), namespace)
    except ValueError as error:
        fields = guard.failed(error, error.__traceback__)
    assert (fields.type, fields.message) == ("ValueError", "no GPU")
    assert fields.at.endswith("script_program.py:2")


# ---------------------------------------------------------------- blame
def test_a_rank_that_exits_by_itself_is_blamed_not_the_peer_that_lost_it(tmp_path):
    error_file(tmp_path, 0).write_text(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [127.0.0.1]:40123 (at train.py:12)\n")
    ended = {1: time.time() + 5}  # seen to end after its peer's line was written
    failure = first_failure([1, 3], ended, tmp_path)
    assert (failure.rank, failure.exitcode) == (1, 3)
    assert str(failure) == "rank 1: exited with code 3 without saying why"
    killed = first_failure([1, -9], ended, tmp_path)
    assert str(killed) == "rank 1: killed by signal 9 (SIGKILL)"
    # Only victims: the first of them.
    assert first_failure([1, None], {}, tmp_path).rank == 0
    assert lost_a_peer("DistNetworkError: failed to recv, got 0 bytes")
    assert lost_a_peer("RuntimeError: Connection reset by peer")
    assert not lost_a_peer("RuntimeError: rank 1 lost its data shard")


def elastic_summary(rank: int, exitcode: int) -> str:
    """torch elastic's summary of a failed run, as torchrun prints it."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    failure = ProcessFailure(local_rank=rank, pid=4242, exitcode=exitcode,
                             error_file="/nonexistent")
    return ChildFailedError("train.py", {rank: failure}).format_msg()


def test_a_worker_of_a_launcher_is_named_from_its_line_or_the_launchers_summary(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("usage: train.py [-h]\ntrain.py: error: unrecognized arguments: --x\n"
                   + elastic_summary(1, 2))
    refusal = launched_failure(tmp_path, log, 2, 1, "torchrun")
    assert (refusal.rank, refusal.refused) == (1, True)
    assert str(refusal) == "rank 1: train.py: error: unrecognized arguments: --x"
    log.write_text(elastic_summary(1, -9))
    assert str(launched_failure(tmp_path, log, 2, 1, "torchrun")) == \
        "rank 1: killed by signal 9 (SIGKILL)"
    log.write_text("[launch.py:259:sigkill_handler] ['python', '-u', 't.py', '--local_rank=1'] "
                   "exits with return code = 3\n")
    assert str(launched_failure(tmp_path, log, 2, 1, "deepspeed")) == \
        "rank 1: exited with code 3 without saying why"
    # As DeepSpeed 0.19 prints it: the script's own arguments after --local_rank.
    log.write_text("usage: t.py [-h] [--stage STAGE]\nt.py: error: unrecognized arguments: "
                   "--local_rank=0\n[launch.py:259:sigkill_handler] ['python', '-u', 't.py', "
                   "'--local_rank=0', '--stage', '2'] exits with return code = 2\n")
    assert str(launched_failure(tmp_path, log, 1, 1, "deepspeed")) == \
        "rank 0: t.py: error: unrecognized arguments: --local_rank=0"
    error_file(tmp_path, 0).write_text("ValueError: bad shape (at t.py:3)\n")
    assert str(launched_failure(tmp_path, log, 2, 1, "deepspeed")) == \
        "rank 0: ValueError: bad shape (at t.py:3)"
    (tmp_path / "empty").mkdir()
    log.write_text("torchrun: error: unrecognized arguments: --nproc\n")
    assert str(launched_failure(tmp_path / "empty", log, 2, 2, "torchrun")) == \
        "torchrun torchrun: error: unrecognized arguments: --nproc"


def a_guard(folder: Path, environment: dict[str, str]) -> guard.Guard:
    """The guard a process of a split in ``folder`` installs, given ``environment``."""
    full = {wire.FOLDER_VARIABLE: str(folder), **environment}
    return guard.Guard(wire.RankSettings.from_environment(full), full)


def write_progress(folder: Path, rank: int, steps: int, forwards: int, ago: float,
                   waiting: str | None = None) -> None:
    """Rank ``rank``'s progress as its guard writes it, last changed ``ago`` seconds ago."""
    the_guard = a_guard(folder, {"RANK": str(rank)})
    the_guard.steps, the_guard.forwards, the_guard.waiting = steps, forwards, waiting
    the_guard.write_progress()
    at = time.time() - ago
    os.utime(folder / wire.PROGRESS / f"rank{rank}", (at, at))


def test_a_hang_names_the_ranks_furthest_behind(tmp_path):
    write_progress(tmp_path, 0, 1, 5, ago=20)
    write_progress(tmp_path, 1, 1, 4, ago=30)
    failure = hang(tmp_path, 2, 10, time.time() - 40)
    assert failure.hung == (1,)
    assert str(failure) == ("rank 1 hung: no progress for 30 s at step 1 after 4 forward "
                            "pass(es) (--timeout 10 s stopped the split; rank 0 at step 1 "
                            "after 5 forward pass(es): waiting for it)")
    write_progress(tmp_path, 1, 1, 5, ago=20)
    alike = hang(tmp_path, 2, 10, time.time() - 40)
    assert str(alike).startswith("ranks 0, 1 hung: no progress for 20 s at step 1 after 5")
    assert "all alike" in str(alike)
    write_progress(tmp_path, 0, 1, 9, ago=0.1)
    write_progress(tmp_path, 1, 1, 9, ago=0.1)
    slow = hang(tmp_path, 2, 10, time.time() - 40)
    assert "still making progress" in str(slow) and "raise --timeout" in str(slow)
    # A rank that never got as far as Python's start-up wrote nothing: it is behind.
    assert hang(tmp_path, 3, 10, time.time() - 40).hung == (2,)


def test_a_rank_waiting_in_grad_checks_exchange_reached_the_step_the_hung_one_did_not(
        tmp_path):
    """Rank 1 sleeps after its step-0 backward; rank 0 went on into the step and waits for
    it inside grad-check's own exchange: both ran one forward, rank 1 alone hung."""
    write_progress(tmp_path, 0, 0, 1, ago=12, waiting="the end of step 0")
    write_progress(tmp_path, 1, 0, 1, ago=13)
    failure = hang(tmp_path, 2, 20, time.time() - 20)
    assert failure.hung == (1,)
    assert str(failure) == ("rank 1 hung: no progress for 13 s at step 0 after 1 forward "
                            "pass(es) (--timeout 20 s stopped the split; rank 0 reached the "
                            "end of step 0, in grad-check's exchange: waiting for it)")


def test_still_making_progress_is_said_only_of_ranks_that_moved_near_the_timeouts_end(
        tmp_path):
    """Idle 8.4 s of a 20 s timeout is a hang, not a script that trains too long; idle 1.5 s
    (the timeout's last tenth) is the latter, and only it is told to raise --timeout."""
    for rank in (0, 1):
        write_progress(tmp_path, rank, 0, 1, ago=8.4)
    assert str(hang(tmp_path, 2, 20, time.time() - 20)).startswith(
        "ranks 0, 1 hung: no progress for 8 s")
    for rank in (0, 1):
        write_progress(tmp_path, rank, 0, 2, ago=1.5)
    slow = str(hang(tmp_path, 2, 20, time.time() - 20))
    assert slow.startswith("ranks 0, 1 still making progress") and "raise --timeout" in slow


def test_the_hung_ranks_idle_time_is_since_the_newest_move_of_any_of_them(tmp_path):
    write_progress(tmp_path, 0, 1, 5, ago=20)
    write_progress(tmp_path, 1, 1, 5, ago=30)
    assert str(hang(tmp_path, 2, 10, time.time() - 40)).startswith(
        "ranks 0, 1 hung: no progress for 20 s")


def test_a_guard_says_at_once_that_its_rank_waits_in_the_exchange_and_then_that_it_left(
        tmp_path):
    the_guard = a_guard(tmp_path, {"RANK": "1"})
    the_guard.forwards = 3
    with the_guard.waits_in_exchange("step 0's gradient comparison"):
        found = progress(tmp_path, 1)
        assert (found.steps, found.forwards, found.waiting) == (
            0, 3, "step 0's gradient comparison")
    the_guard.write_progress()  # the watch's next write
    assert progress(tmp_path, 1).waiting is None


def test_a_launcher_that_started_other_ranks_than_the_split_needs_is_named(tmp_path):
    (tmp_path / "rank0.pt").write_bytes(b"")
    failure = missing_ranks(tmp_path, 2, "accelerate launch", "2x1")
    assert failure is not None and failure.refused
    assert str(failure).startswith("accelerate launch started 1 rank(s) that stepped (rank 0) "
                                   "at split 2x1, which needs 2")
    (tmp_path / "rank1.pt").write_bytes(b"")
    assert missing_ranks(tmp_path, 2, "torchrun", "2x1") is None


# ---------------------------------------------------------------- the guard
def guard_in_child(tmp_path: Path, work, **environment: str) -> tuple[int, dict | None]:
    """``work(guard)`` in a forked child whose environment is a split's: its exit code and
    the ``fatal`` it left (None if none)."""
    variables = {wire.FOLDER_VARIABLE: str(tmp_path), wire.NPROC_VARIABLE: "2",
                 wire.SPLIT_VARIABLE: "2x1", "RANK": "0", **environment}
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work(a_guard(tmp_path, variables))
        except BaseException:  # noqa: BLE001 -- the exit code says it
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    found = tmp_path / wire.FATAL
    return os.waitstatus_to_exitcode(status), (json.loads(found.read_text())
                                               if found.exists() else None)


def test_a_second_live_process_claiming_a_rank_ends_the_split_naming_both(tmp_path):
    (tmp_path / wire.CLAIMS).mkdir()
    (tmp_path / wire.CLAIMS / "rank0").write_text(json.dumps({
        "pid": os.getpid(), "start": pids.process_start(os.getpid()),
        "command": "trl sft --model_name_or_path m"}))
    code, fatal = guard_in_child(tmp_path, lambda it: it.claim(-1))
    assert code == 1
    assert fatal["rank"] == 0
    assert fatal["line"].startswith(f"rank 0 joined the process group twice, by pid "
                                    f"{os.getpid()} (trl sft --model_name_or_path m) and pid ")
    assert "--launcher command" in fatal["line"]
    assert error_file(tmp_path, 0).read_text().strip() == fatal["line"]


def test_a_claim_its_process_left_behind_is_taken_over(tmp_path):
    (tmp_path / wire.CLAIMS).mkdir()
    (tmp_path / wire.CLAIMS / "rank1").write_text(json.dumps({
        "pid": 1, "start": "no such start", "command": "gone"}))
    code, fatal = guard_in_child(tmp_path, lambda it: it.claim(1))
    assert (code, fatal) == (0, None)
    assert json.loads((tmp_path / wire.CLAIMS / "rank1").read_text())["pid"] != 1


def test_a_launcher_that_started_another_world_size_ends_the_split(tmp_path):
    code, fatal = guard_in_child(tmp_path, lambda it: it.check_world_size(), WORLD_SIZE="1",
                                 **{wire.LAUNCHER_VARIABLE: "command",
                                    wire.LAUNCHER_NAME_VARIABLE: "torchrun"})
    assert code == 2
    assert fatal["line"].startswith("torchrun started 1 rank(s) (WORLD_SIZE=1) at split 2x1, "
                                    "which needs 2")


def test_what_a_split_left_running_is_killed_after_it(tmp_path):
    """A launcher's workers run in sessions of their own: killed, with their groups, from
    what they registered."""
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        (tmp_path / wire.PROCESSES).mkdir()
        (tmp_path / wire.PROCESSES / str(left.pid)).write_text(json.dumps({
            "pid": left.pid, "start": pids.process_start(left.pid), "pgid": left.pid,
            "rank": 0, "command": "worker"}))
        sweep(tmp_path)
        assert left.wait(timeout=10) == -9
    finally:
        left.kill()
        left.wait()


def test_failure_str_names_the_rank_unless_the_line_does():
    assert str(SplitFailure(1, 1, "RuntimeError: x")) == "rank 1: RuntimeError: x"
    assert str(SplitFailure(1, None, "rank 1 hung: no progress", (1,))) == \
        "rank 1 hung: no progress"
    assert str(SplitFailure(None, 2, "torchrun: error")) == "torchrun: error"


def test_a_plain_process_that_wanted_torchruns_variables_is_told_the_flag():
    """torch's env:// and DeepSpeed's init_distributed (which, without RANK and the rest,
    looks for MPI: the Trainer's --deepspeed at N = 1) both name --torchrun-env."""
    from harness.grad_check.script.failures import SplitFailure
    from harness.grad_check.script.processes import needs_torchrun_hint

    for line in ("ValueError: Error initializing torch.distributed using env:// rendezvous: "
                 "environment variable RANK expected, but not set",
                 "ModuleNotFoundError: No module named 'mpi4py' (at train.py:9)"):
        assert needs_torchrun_hint(SplitFailure(0, 1, line)).line.endswith(
            "--torchrun-env gives it torchrun's variables")
    other = SplitFailure(0, 1, "RuntimeError: boom")
    assert needs_torchrun_hint(other) is other
