"""Config: flags over env over defaults, one-line errors that name the variable or flag."""

from __future__ import annotations

import pytest

from jitckpt_entrypoint.config import Config, shutdown_timeout_for
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.shared_settings import parse_s3_uri


def test_defaults_match_the_design_table():
    """With no env and no flags every setting has its documented default."""
    cfg = Config.from_env({})
    assert (cfg.dir, cfg.storage_uri, cfg.jit, cfg.resume) == ("/mnt/jitckpt", "", True, True)
    assert (cfg.grace_seconds, cfg.exit_code) == (30, 143)
    assert cfg.save_strategy is cfg.save_steps is cfg.save_total_limit is None


def test_flag_wins_over_env():
    """A flag value overrides the JITCKPT_* variable."""
    cfg = Config.from_env({"JITCKPT_GRACE_SECONDS": "60"}, {"grace_seconds": "90"})
    assert cfg.grace_seconds == 90


def test_to_env_round_trips():
    """The resolved settings passed to the child parse back to the same config."""
    cfg = Config.from_env(
        {"JITCKPT_SAVE_STEPS": "5", "JITCKPT_JIT": "no", "JITCKPT_STORAGE_URI": "s3://b-1/x"}
    )
    assert Config.from_env(cfg.to_env()) == cfg


def test_save_steps_alone_implies_the_steps_strategy():
    """JITCKPT_SAVE_STEPS without a strategy means save every N steps."""
    assert Config.from_env({"JITCKPT_SAVE_STEPS": "10"}).effective_save_strategy == "steps"
    assert Config.from_env({}).effective_save_strategy is None


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({"JITCKPT_GRACE_SECONDS": "x"}, {}, "JITCKPT_GRACE_SECONDS='x' is not an integer"),
        ({}, {"grace_seconds": "0"}, "--grace-seconds 0 is invalid"),
        (
            {"JITCKPT_EXIT_CODE": "300"},
            {},
            "JITCKPT_EXIT_CODE=300 is invalid; use an exit code from 1 to 255",
        ),
        ({"JITCKPT_SAVE_STRATEGY": "often"}, {}, "use one of no, steps, epoch"),
        ({"JITCKPT_SAVE_STEPS": "0"}, {}, "JITCKPT_SAVE_STEPS=0 is invalid"),
        ({"JITCKPT_SAVE_TOTAL_LIMIT": "-1"}, {}, "JITCKPT_SAVE_TOTAL_LIMIT=-1 is invalid"),
        ({"JITCKPT_RESUME": "sure"}, {}, "JITCKPT_RESUME='sure' is not a boolean; use 1 or 0"),
        (
            {"JITCKPT_LOG_FORMAT": "xml"},
            {},
            "JITCKPT_LOG_FORMAT='xml' is invalid; use text or json",
        ),
        ({"JITCKPT_STORAGE_URI": "s3://"}, {}, "is not a valid bucket name"),
        ({"JITCKPT_DIR": ""}, {}, "JITCKPT_DIR='' is invalid"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_source(env, flags, expected):
    """Each bad value raises one line naming the variable (or flag) and what is accepted."""
    with pytest.raises(JitckptError) as info:
        Config.from_env(env, flags)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [
        ("s3://bucket", "bucket", ""),
        ("s3://my.bucket/a/b/", "my.bucket", "a/b"),
        ("s3://b-1/x", "b-1", "x"),
    ],
)
def test_s3_uri_parses(uri, bucket, prefix):
    """s3://bucket[/prefix] splits into bucket and a slash-trimmed prefix."""
    parsed = parse_s3_uri(uri)
    assert (parsed.bucket, parsed.prefix) == (bucket, prefix)
    assert parsed.key("checkpoint-1", "f") == "/".join(
        p for p in (prefix, "checkpoint-1", "f") if p
    )


@pytest.mark.parametrize(
    "uri", ["bucket/x", "s3://UPPER/x", "s3://ab", "s3://a..b/x", "s3://bucket/a//b"]
)
def test_bad_s3_uris_are_rejected(uri):
    """Malformed URIs are rejected with the accepted form in the message."""
    with pytest.raises(JitckptError, match="s3://bucket/prefix"):
        parse_s3_uri(uri)


def test_shutdown_timeout_leaves_a_quarter_of_the_grace_period_for_upload():
    """torchrun's shutdown timeout is 3/4 of the grace period, at least one second."""
    assert [shutdown_timeout_for(g) for g in (1, 4, 30, 600)] == [1, 3, 22, 450]
