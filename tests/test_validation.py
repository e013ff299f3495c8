"""Every numeric flag of study.py is checked up front against what its consumer accepts.

The flags are found, not listed: the run-wide ones by name and every study's own
options through ``Options.flags()``, so a flag added later is audited the day it
exists. Each must refuse, with one line naming it, the values that crashed a rank
before (an integer beyond 2**64, a negative one, inf, nan).
"""

import numpy as np
import pytest

from harness.errors import UsageError
from harness.grad_study import build_parser, config_from_args
from harness.options import (
    MAX_SEED,
    parse_float,
    parse_float_list,
    parse_int,
    parse_int_list,
)
from harness.seeding import generator_for
from harness.studies import STUDIES

INTEGER_PARSERS = (parse_int, parse_int_list)
NUMBER_PARSERS = (parse_float, parse_float_list)
#: Values no integer flag may take: beyond what torch and numpy take as an int, and < 0.
BAD_INTEGERS = ("99999999999999999999", "18446744073709551616", "-1",
                "-99999999999999999999")
#: Values no number flag may take.
BAD_NUMBERS = ("inf", "-inf", "nan", "-1", "1e309")


def numeric_study_flags() -> list[tuple[str, str, tuple[str, ...]]]:
    """(study, flag, bad values) for every numeric option of every study."""
    found = []
    for name, study in STUDIES.items():
        for field in study.Options.flags():
            parse = field.metadata["parse"]
            if parse in INTEGER_PARSERS:
                found.append((name, field.metadata["flag"], BAD_INTEGERS))
            elif parse in NUMBER_PARSERS:
                found.append((name, field.metadata["flag"], BAD_NUMBERS))
    return found


RUN_FLAGS = [(None, "--seed", BAD_INTEGERS), (None, "--world-sizes", ("-1", "0")),
             (None, "--timeout", BAD_NUMBERS)]
CASES = [(study, flag, value) for study, flag, values in RUN_FLAGS + numeric_study_flags()
         for value in values]


def refusal(argv: list[str], tmp_path) -> str:
    args = build_parser().parse_args([*argv, "--out", str(tmp_path / "out")])
    with pytest.raises(UsageError) as refused:
        config_from_args(args)
    return str(refused.value)


def test_the_audit_finds_every_numeric_study_option():
    flags = {flag for _, flag, _ in numeric_study_flags()}
    assert {"--epochs", "--shard-size", "--accum-steps", "--update-steps",
            "--update-accum-steps", "--update-lrs"} <= flags


@pytest.mark.parametrize("study, flag, value", CASES,
                         ids=[f"{flag}={value}" for _, flag, value in CASES])
def test_every_numeric_flag_refuses_what_its_consumer_cannot_take(study, flag, value,
                                                                   tmp_path):
    selected = ["--studies", study] if study else []
    message = refusal([*selected, f"{flag}={value}"], tmp_path)
    assert len(message.splitlines()) == 1
    assert message.startswith(flag), message
    assert "allowed" in message or "not an integer" in message or "not a number" in message


def test_the_seed_that_crashed_a_rank_is_refused_naming_the_limit(tmp_path):
    message = refusal(["--seed", "99999999999999999999"], tmp_path)
    assert message == (f"--seed 99999999999999999999 is not allowed; allowed: integers "
                       f"0..{MAX_SEED} (below 2^32, what numpy's RandomState takes; torch "
                       "generators take below 2^64)")


def test_the_largest_seed_allowed_is_taken_by_every_consumer(tmp_path):
    args = build_parser().parse_args(["--seed", str(MAX_SEED), "--out", str(tmp_path / "o")])
    assert config_from_args(args).seed == MAX_SEED
    # harness.seeding (every case's weights and batches) and PowerSGD's numpy generator.
    assert torch_draw(MAX_SEED) != torch_draw(MAX_SEED - 1)
    np.random.RandomState(MAX_SEED)
    with pytest.raises(ValueError):
        np.random.RandomState(MAX_SEED + 1)


def torch_draw(seed: int) -> float:
    import torch

    return float(torch.rand(1, generator=generator_for(seed, "a case")))


def test_seeds_in_range_mix_as_before_and_any_seed_gives_a_generator():
    import zlib

    key = zlib.crc32(b"a case")
    assert generator_for(MAX_SEED, "a case").initial_seed() == MAX_SEED * 1_000_003 + key
    assert generator_for(10**30, "a case").initial_seed() < 2**64
