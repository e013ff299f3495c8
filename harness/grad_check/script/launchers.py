"""Commands that start the split's ranks themselves: a launcher at the command's head.

``torchrun``, ``python -m torch.distributed.run``, ``accelerate launch``, ``deepspeed``,
``trl <command>`` (which calls ``accelerate launch`` itself) and torchtune's ``tune run``
given any of torchrun's options before its recipe (it runs torchrun inside) each start N
worker processes with torchrun's variables. Given grad-check's environment N times over, they
would start N x N workers, or, a CLI that joins the process group itself, two processes
per rank. So such a command runs once per split, as it is (its count of processes given
``{nproc}``), without torchrun's variables; the capture reaches every worker it starts
through the environment (the startup hook on PYTHONPATH).

Refused by name, before anything runs: a launcher told to span machines, and one whose
number of processes does not follow ``{nproc}`` where a split needs more than one.

Where the machine forces it, the command is adapted, and the command shown is the one
run: ``accelerate launch`` (and ``trl``) on a machine without GPUs starts one plain
process whatever ``--num_processes`` says, so at N > 1 it is given ``--multi_gpu`` (its
torch elastic launcher, as it picks itself with N GPUs) and every run
``ACCELERATE_USE_CPU=1`` (its own variable for a run on CPUs). Its ``--cpu`` also means
one plain process, on any machine: at N > 1 it runs as ``--multi_gpu`` with
``ACCELERATE_USE_CPU=1``, the N processes on CPUs that the command asks for.

``tune run RECIPE`` without any option before the recipe runs the recipe in its own
process, as ``python recipe.py`` would: no launcher, grad-check starts it as the ranks.

A launcher behind ``env`` and its assignments (``env NAME=VALUE accelerate launch ...``)
is the launcher: ``env`` passes the environment on, the capture's included.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from harness.errors import UsageError
from harness.grad_check.script.splits import Split, expressions, names_in

#: ``--launcher``: who starts a split's N ranks.
LAUNCHER_CHOICES = ("auto", "grad-check", "command")
#: trl's subcommands that do not train (every other one launches a training script).
TRL_OTHER_COMMANDS = ("env", "vllm-serve", "-h", "--help")
#: accelerate launch's arguments that choose its launcher themselves.
ACCELERATE_CHOOSES = ("--multi_gpu", "--multi-gpu", "--config_file", "--config-file",
                      "--use_fsdp", "--use-fsdp", "--use_deepspeed", "--use-deepspeed",
                      "--cpu", "--tpu", "--use_megatron_lm", "--use-megatron-lm")


@dataclass(frozen=True)
class Kind:
    """The flags a family of launchers takes (torchrun's, Accelerate's, DeepSpeed's)."""

    #: The flags that give its number of processes, the first as messages name it.
    count_flags: tuple[str, ...]
    #: Its number of processes where the count is not given.
    default_count: str
    #: The flags that span machines, with the value that keeps it on one.
    machine_flags: tuple[str, ...] = ()
    #: It starts its workers through ``accelerate launch``.
    accelerate: bool = False
    #: Its flags that take no value, where its own arguments end at the first word that is
    #: no flag nor a flag's value (``tune run``'s recipe is a name, not a ``.py`` path);
    #: None: they end at the first ``.py`` word.
    switches: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Launcher:
    """A launcher at the head of a command."""

    #: As the user would say it: ``torchrun``, ``accelerate launch``, ``trl sft``.
    name: str
    #: Where its own arguments begin in the command (after ``accelerate launch``).
    arguments_at: int
    kind: Kind

    @property
    def count_flags(self) -> tuple[str, ...]:
        return self.kind.count_flags

    @property
    def example(self) -> str:
        return f"{self.count_flags[0]} {{nproc}}"


TORCHRUN = Kind(count_flags=("--nproc_per_node", "--nproc-per-node"), default_count="1",
                machine_flags=("--nnodes",))
ACCELERATE = Kind(count_flags=("--num_processes", "--num-processes"),
                  default_count="1 on a machine without GPUs, else one per GPU",
                  machine_flags=("--num_machines", "--num-machines"), accelerate=True)
#: torchrun's flags that take no value: ``tune run`` passes torchrun's options on.
TORCHRUN_SWITCHES = ("--standalone", "-m", "--module", "--no-python", "--no_python",
                     "--run-path", "--run_path", "--virtual-local-rank",
                     "--virtual_local_rank", "-h", "--help")
TUNE_RUN = dataclasses.replace(TORCHRUN, switches=TORCHRUN_SWITCHES)
DEEPSPEED = Kind(count_flags=("--num_gpus", "--num-gpus", "--num_accelerators"),
                 default_count="one per GPU", machine_flags=("--num_nodes", "--num-nodes"))
#: A spec's subcommand that is any word but one of trl's that do not train.
TRAINING = "<a trl command that trains>"


@dataclass(frozen=True)
class Spec:
    """How a launcher is named at a command's head: its program (``torchrun``) or the
    module ``python -m`` runs, and the subcommand that makes it one (``accelerate launch``;
    :data:`TRAINING`: any of trl's that trains)."""

    kind: Kind
    #: As messages say it; ``{subcommand}`` is the word the command gave.
    name: str
    program: str = ""
    module: str = ""
    subcommand: str = ""
    #: ``tune run``: a launcher only where its own arguments come before its recipe (it
    #: runs torchrun inside); else the recipe runs in tune's own process.
    only_with_arguments: bool = False

    def arguments_at(self, command: Sequence[str]) -> int | None:
        """Where its own arguments begin in ``command``, where ``command`` names it."""
        if self.program:
            at = 1 if command and os.path.basename(command[0]) == self.program else None
        else:
            at = (3 if len(command) > 2 and is_python(command[0]) and command[1] == "-m"
                  and command[2] == self.module else None)
        if at is None or not self.subcommand:
            return at
        word = command[at] if len(command) > at else None
        if self.subcommand == TRAINING:
            return at + 1 if word is not None and word not in TRL_OTHER_COMMANDS else None
        return at + 1 if word == self.subcommand else None

    def launcher(self, command: Sequence[str]) -> Launcher | None:
        at = self.arguments_at(command)
        if at is None:
            return None
        named = self.name.replace("{subcommand}", command[at - 1]) if self.subcommand else \
            self.name
        launcher = Launcher(named, at, self.kind)
        if self.only_with_arguments and not own_arguments(launcher, command):
            return None
        return launcher


#: Every launcher grad-check run knows at a command's head.
LAUNCHERS: tuple[Spec, ...] = (
    Spec(TORCHRUN, "torchrun", program="torchrun"),
    Spec(TORCHRUN, "python -m torch.distributed.run", module="torch.distributed.run"),
    Spec(TORCHRUN, "python -m torch.distributed.launch", module="torch.distributed.launch"),
    Spec(ACCELERATE, "accelerate launch", program="accelerate", subcommand="launch"),
    Spec(ACCELERATE, "accelerate launch", program="accelerate-launch"),
    Spec(ACCELERATE, "accelerate launch", module="accelerate.commands.launch"),
    Spec(ACCELERATE, "accelerate launch", module="accelerate.commands.accelerate_cli",
         subcommand="launch"),
    Spec(DEEPSPEED, "deepspeed", program="deepspeed"),
    Spec(DEEPSPEED, "deepspeed", module="deepspeed.launcher.runner"),
    # trl's commands that train call accelerate launch themselves.
    Spec(ACCELERATE, "trl {subcommand}", program="trl", subcommand=TRAINING),
    *(Spec(ACCELERATE, "trl {subcommand}", module=module, subcommand=TRAINING)
      for module in ("trl", "trl.cli", "trl.cli.main")),
    Spec(TUNE_RUN, "tune run", program="tune", subcommand="run", only_with_arguments=True),
    Spec(TUNE_RUN, "tune run", module="torchtune._cli.tune", subcommand="run",
         only_with_arguments=True),
)


def is_python(program: str) -> bool:
    return re.fullmatch(r"python[0-9.]*", os.path.basename(program)) is not None


#: env(1)'s options that take a value in the next word (``env -u NAME``, ``env -C DIR``).
ENV_OPTIONS_WITH_VALUE = ("-u", "--unset", "-C", "--chdir")
#: env(1)'s options that take none.
ENV_OPTIONS = ("-i", "--ignore-environment", "-")


def env_prefix(command: Sequence[str]) -> int:
    """How many words of ``command`` are ``env`` and its options and NAME=VALUE assignments
    (``env ACCELERATE_USE_CPU=true accelerate launch ...``): 0 where it does not begin with
    env, or env is given an option this does not know (then no launcher is seen behind it)."""
    if not command or os.path.basename(command[0]) != "env":
        return 0
    position = 1
    while position < len(command):
        word = command[position]
        if word in ENV_OPTIONS_WITH_VALUE:
            position += 2
        elif word in ENV_OPTIONS or word.partition("=")[0] in ("--unset", "--chdir") \
                or re.fullmatch(r"-[uC].+", word) \
                or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
            position += 1
        elif word.startswith("-"):
            return 0
        else:
            return position
    return 0


def launcher_of(command: Sequence[str]) -> Launcher | None:
    """The launcher at the head of ``command`` (behind ``env`` and its assignments), if one
    is there."""
    skipped = env_prefix(command)
    found = next(filter(None, (spec.launcher(command[skipped:]) for spec in LAUNCHERS)), None)
    if found is None or not skipped:
        return found
    return dataclasses.replace(found, arguments_at=found.arguments_at + skipped)


def own_arguments(launcher: Launcher, command: Sequence[str]) -> list[str]:
    """The launcher's own arguments: those after its name and before the script it starts
    (the first ``.py`` word, or the first word that is not a flag or its value where the
    launcher knows its flags); all of them where it names none (``trl sft``, a module)."""
    arguments = list(command[launcher.arguments_at:])
    if launcher.kind.switches is not None:
        return arguments[:first_positional(arguments, launcher.kind.switches)]
    script = next((at for at, argument in enumerate(arguments) if argument.endswith(".py")),
                  len(arguments))
    return arguments[:script]


def first_positional(arguments: Sequence[str], switches: Sequence[str]) -> int:
    """Where the first word that is neither a flag nor a flag's value is in ``arguments``
    (every flag but ``switches`` takes a value, in the next word unless given ``=``)."""
    position = 0
    while position < len(arguments) and arguments[position].startswith("-"):
        flag = arguments[position]
        position += 1 if "=" in flag or flag in switches else 2
    return min(position, len(arguments))


def flag_value(command: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value given to any of ``flags`` (``--flag value`` or ``--flag=value``), the last
    one where given twice; None where none is given."""
    found = None
    for position, argument in enumerate(command):
        name, equals, value = argument.partition("=")
        if name in flags:
            found = value if equals else (command[position + 1]
                                          if position + 1 < len(command) else "")
    return found


def check_launcher(launcher: Launcher, command: Sequence[str], splits: Sequence[Split]) -> None:
    """Refuse, by name, a launcher that cannot run the splits on this machine."""
    arguments = own_arguments(launcher, command)
    machines = flag_value(arguments, launcher.kind.machine_flags)
    if machines is not None and machines not in ("1", "1:1"):
        raise UsageError(f"{launcher.name} {launcher.kind.machine_flags[0]} {machines} spans "
                         "machines; allowed: one machine (leave it out, or 1): grad-check run "
                         "runs every split on this one")
    count = flag_value(arguments, launcher.count_flags)
    if count is not None and "nproc" in {name for expression in expressions(count)
                                         for name in names_in(expression)}:
        return
    given = (f"{launcher.count_flags[0]} {count}" if count is not None else
             f"without {launcher.count_flags[0]} ({launcher.kind.default_count})")
    needs = [split for split in splits if count is None or str(split.world_size) != count]
    if count is None:
        needs = [split for split in splits if split.world_size > 1]
    if needs:
        split = needs[0]
        raise UsageError(f"{launcher.name} {given} starts the same processes at every split, "
                         f"but split {split.label} needs {split.world_size}; allowed: "
                         f"{launcher.example}, which grad-check sets at each split")


def visible_gpus() -> int:
    """The GPUs the command's processes would see (without loading CUDA): the NVIDIA
    devices, as far as ``CUDA_VISIBLE_DEVICES`` leaves them."""
    devices = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = [item for item in visible.split(",") if item.strip()]
        if not chosen or chosen[0].strip() == "-1":
            return 0
        devices = min(devices, len(chosen))
    return devices


def adapted(launcher: Launcher | None, command: list[str], split: Split,
            gpus: int) -> tuple[list[str], dict[str, str]]:
    """The command as it runs on this machine, and the variables it is given besides."""
    if launcher is None or not launcher.kind.accelerate:
        return command, {}
    head = command[:launcher.arguments_at]
    arguments = own_arguments(launcher, command)
    script = command[launcher.arguments_at + len(arguments):]
    # accelerate launch --cpu runs its simple launcher: one process, whatever
    # --num_processes says (with GPUs or without). The user asked for N processes on CPUs:
    # at N > 1 that is its torch elastic launcher with its own CPU variable.
    if "--cpu" in arguments and split.world_size > 1:
        arguments = [argument for argument in arguments if argument != "--cpu"]
    elif gpus:
        return command, {}
    if split.world_size > 1 and not any(argument.partition("=")[0] in ACCELERATE_CHOOSES
                                        for argument in arguments):
        arguments = ["--multi_gpu", *arguments]
    return [*head, *arguments, *script], {"ACCELERATE_USE_CPU": "1"}
