"""The one settings system: option tables, typed converters, sources named in errors, docs."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from jitckpt_entrypoint import config as trainer
from jitckpt_entrypoint import settings
from jitckpt_entrypoint.settings import (
    INTEGER,
    OPTIONAL_QUANTITY,
    QUANTITY_TEXT,
    Fallback,
    Option,
    SettingError,
)
from jitckpt_sidecar import config as sidecar

TABLES = {"E": (trainer.Config, trainer.OPTIONS), "S": (sidecar.Config, sidecar.OPTIONS)}


@dataclasses.dataclass(frozen=True)
class Demo:
    size: Optional[int] = None
    tries: int = 3

    def __post_init__(self) -> None:
        settings.validate(self, DEMO)


DEMO = (
    Option("size", OPTIONAL_QUANTITY, "a size", check=settings.at_least(1, "a size >= 1")),
    Option(
        "tries",
        INTEGER,
        "tries per request",
        check=settings.between(1, 9, "1 to 9"),
        fallbacks=(Fallback("AWS_MAX_ATTEMPTS"), Fallback("TRIES_K", "{}000")),
    ),
)


def test_a_flag_wins_over_its_variable_which_wins_over_fallbacks_then_the_default():
    """Sources in order: flag, JITCKPT_* variable (unless empty where a fallback exists),
    the fallbacks in order, the dataclass default."""
    env = {"JITCKPT_TRIES": "4", "AWS_MAX_ATTEMPTS": "5"}
    assert settings.resolve(Demo, DEMO, env, {"tries": "6"}).tries == 6
    assert settings.resolve(Demo, DEMO, env).tries == 4
    assert settings.resolve(Demo, DEMO, {**env, "JITCKPT_TRIES": " "}).tries == 5
    assert settings.resolve(Demo, DEMO, {}).tries == 3


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({"JITCKPT_TRIES": "x"}, {}, "JITCKPT_TRIES='x' is not an integer; set tries per request"),
        ({}, {"tries": "10"}, "--tries 10 is invalid; use 1 to 9"),
        ({"AWS_MAX_ATTEMPTS": "0"}, {}, "AWS_MAX_ATTEMPTS=0 is invalid; use 1 to 9"),
        ({"TRIES_K": "7"}, {}, "JITCKPT_TRIES (from TRIES_K)=7000 is invalid; use 1 to 9"),
        (
            {"JITCKPT_SIZE": "5 Gi"},
            {},
            "JITCKPT_SIZE='5 Gi' is not a Kubernetes quantity; use e.g. 50Gi, 500M or 64Mi",
        ),
        ({"JITCKPT_SIZE": "500m"}, {"size": "0"}, "--size 0 is invalid; use a size >= 1"),
    ],
)
def test_an_error_names_the_flag_or_variable_the_value_came_from(env, flags, message):
    """Conversion and check errors alike name where the value was read, in one line."""
    with pytest.raises(SettingError) as info:
        settings.resolve(Demo, DEMO, env, flags)
    assert str(info.value) == message
    assert info.value.exit_code == 2


def test_a_value_built_in_code_is_checked_and_named_by_its_variable():
    """Direct construction runs the same checks; the error names the variable."""
    with pytest.raises(SettingError, match=r"^JITCKPT_SIZE=0 is invalid"):
        Demo(size=0)


def test_a_quantity_text_is_refused_as_a_quantity_is_and_kept_as_written():
    """QUANTITY_TEXT (inject's --capacity) accepts what the sidecar's quantities accept."""
    option = Option("capacity", QUANTITY_TEXT, "size", flag_only=True)
    assert option.convert("1e9", "--capacity ") == "1e9"
    with pytest.raises(SettingError, match=r"^--capacity '50GB' is not a Kubernetes quantity"):
        option.convert("50GB", "--capacity ")


def test_both_components_share_the_options_they_both_read():
    """DIR, GRACE_SECONDS and LOG_FORMAT are one declaration read by both sides."""
    for option in (trainer.DIR, trainer.GRACE_SECONDS, trainer.LOG_FORMAT):
        assert option in sidecar.OPTIONS
        assert option in trainer.OPTIONS


def test_a_variable_documented_differently_by_two_components_is_refused():
    """doc_rows merges a shared variable into one row only when both say the same."""
    other = dataclasses.replace(trainer.DIR, doc="something else")
    with pytest.raises(ValueError, match="JITCKPT_DIR is documented differently"):
        settings.doc_rows({"E": (trainer.Config, (trainer.DIR,)), "S": (sidecar.Config, (other,))})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("600", 600.0), ("600s", 600.0), ("10m", 600.0), ("1.5h", 5400.0), ("1h30m", 5400.0)],
)
def test_save_interval_takes_seconds_or_a_unit(text, seconds):
    cfg = trainer.Config.from_env({"JITCKPT_SAVE_INTERVAL": text})
    assert cfg.save_interval == seconds
    assert trainer.Config.from_env(cfg.to_env()).save_interval == seconds  # the child reads it


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JITCKPT_SAVE_INTERVAL": "1h30"}, "JITCKPT_SAVE_INTERVAL='1h30' is not a duration"),
        ({"JITCKPT_SAVE_INTERVAL": "0"}, "JITCKPT_SAVE_INTERVAL='0s' is invalid; use a duration"),
        ({"JITCKPT_SAVE_OVERHEAD": "1"}, "JITCKPT_SAVE_OVERHEAD='1' is not a percentage; use"),
        (
            {"JITCKPT_SAVE_OVERHEAD": "80%"},
            "OVERHEAD='80%' is invalid; use a percentage from 0.01%",
        ),
    ],
)
def test_a_bad_interval_or_budget_is_one_line_naming_the_variable(env, message):
    with pytest.raises(SettingError) as raised:
        trainer.Config.from_env(env)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_budget_reaches_the_child_as_a_percentage():
    cfg = trainer.Config.from_env({"JITCKPT_SAVE_OVERHEAD": "0.5%"})
    assert cfg.save_overhead == 0.005
    assert cfg.to_env()["JITCKPT_SAVE_OVERHEAD"] == "0.5%"
    assert trainer.Config.from_env(cfg.to_env()).save_overhead == 0.005
