"""What a trainer of the trainers study is: its command, the settings compared, the causes it
can name (harness/studies/trainers/trainers.py and programs.py declare them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.grad_check.script.failures import Unusable
from harness.grad_check.script.wire import RankError
from harness.studies.trainers.assets import Assets
from harness.studies.trainers.source import Source

#: The setting that runs a trainer exactly as shipped.
DEFAULT = "default"
#: A row's status where the trainer's environment lacks it: then the install that brings it.
NOT_INSTALLED = "not installed"
#: The CPU build of torch comes from PyTorch's CPU index: pinned alone, torch==2.13.0 from
#: PyPI is its CUDA build (several GB of CUDA libraries).
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
TRAINERS_INSTALL = f"pip install torch==2.13.0 -e '.[trainers]' {CPU_INDEX}"
VISION_PYTHON = "GRAD_STUDY_VISION_PYTHON"
#: torchvision's wheels are built against PyPI's default torch (a CUDA build, which runs on a
#: CPU too); beside the CPU build their ops do not load.
VISION_INSTALL = ("python -m venv .venv-vision && .venv-vision/bin/pip install torch==2.14.1 "
                  "-e '.[vision]'")
#: Hugging Face libraries read nothing from the network.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Setting:
    """A setting compared: its name as users write it, and the arguments it appends."""

    name: str
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.name == DEFAULT) != (not self.args):
            raise ValueError(f"setting {self.name!r}: `default` and only it appends nothing")


@dataclass(frozen=True)
class Fails:
    """A failed run, by the fields of ``grad-check run``'s ``failures.json``
    (harness/grad_check/script/failures.py): the reference found unusable for ``unusable``,
    or a rank that raised ``type`` in a file whose path ends in ``raised_in`` (in the
    reference's run or a split's), or both."""

    unusable: Unusable | None = None
    type: str = ""
    raised_in: str = ""

    def __post_init__(self) -> None:
        if not (self.unusable or self.type) or bool(self.type) != bool(self.raised_in):
            raise ValueError(f"{self}: an unusable reference's id, or an error's type and "
                             "the file it is raised in (or both)")

    def explains(self, unusable: str, error: RankError | None) -> bool:
        """Whether a run that failed so (``unusable``: why the reference is, as
        ``failures.json`` says it, "" for a split's run; ``error``: the failing rank's) is
        this failure."""
        if self.unusable and self.unusable != unusable:
            return False
        return not self.type or (error is not None and error.type == self.type
                                 and error.at.rpartition(":")[0].endswith(self.raised_in))


@dataclass(frozen=True)
class Cause:
    """Why a trainer's step differs from the big batch's, in the trainer's own terms.

    It names a row's difference only where ``grad-check run`` measured one and named a
    cause of ``explains`` (ids of harness/check/causes/), or a run that failed as ``fails``
    says: a cause explains a measurement, never stands in for one.
    """

    text: str
    source: Source
    fix: str
    explains: tuple[str, ...] = ()
    fails: Fails | None = None

    def __post_init__(self) -> None:
        if bool(self.explains) == (self.fails is not None):
            raise ValueError(f"{self.text[:40]!r}: it explains measured causes or a failure, "
                             "one of the two")


@dataclass(frozen=True)
class Trainer:
    #: Its name in ``--trainers``.
    key: str
    name: str
    #: The distribution whose version the rows give.
    distribution: str
    #: The module that must import for it to run.
    module: str
    #: What it reads from the study's assets (harness/studies/trainers/assets.py), or None
    #: for a program that makes its own data.
    assets: Assets | None
    command: tuple[str, ...]
    cpu_args: tuple[str, ...]
    splits: tuple[str, ...]
    settings: tuple[Setting, ...]
    causes: tuple[Cause, ...] = ()
    global_batch: int = 8
    env: dict[str, str] = field(default_factory=dict)
    #: The environment variable naming the Python of an environment of the trainer's own,
    #: for a trainer that cannot share one with the others (``{python}`` in its command);
    #: unset, this interpreter's.
    python_variable: str = ""

    #: The install that brings it (a row says it where the trainer is not installed).
    install: str = TRAINERS_INSTALL

    def __post_init__(self) -> None:
        if not self.settings or self.settings[0].name != DEFAULT:
            raise ValueError(f"{self.name}: its first setting is `default`")
        if self.assets is not None and not isinstance(self.assets, Assets):
            raise ValueError(f"{self.name}: assets {self.assets!r}; allowed: "
                             f"{', '.join(repr(str(kind)) for kind in Assets)}, or None")

    def setting(self, name: str) -> Setting:
        return next(setting for setting in self.settings if setting.name == name)

    def argv(self, setting: Setting) -> tuple[str, ...]:
        """The whole command at ``setting``, placeholders left in."""
        return (*self.command, *self.cpu_args, *setting.args)

    def cause_of(self, measured: str) -> Cause | None:
        """The cause of a difference ``grad-check run`` named ``measured`` (its id)."""
        return next((cause for cause in self.causes if measured in cause.explains), None)

    def cause_of_failure(self, unusable: str, error: RankError | None) -> Cause | None:
        """The cause of a run that failed so (:meth:`Fails.explains`)."""
        return next((cause for cause in self.causes
                     if cause.fails is not None and cause.fails.explains(unusable, error)), None)
