"""The CLI edge: subcommands through a table, one line per error, exit codes."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from jitckpt_sidecar import cli


def test_every_command_in_the_table_resolves_to_a_main_function():
    """Each entry is 'module:function' naming a callable main(argv) -> int."""
    for name, (target, help_) in cli.COMMANDS.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
        assert help_


def test_a_new_command_is_wired_with_one_table_entry(monkeypatch, capsys):
    """Adding ("module:main", help) makes `jitckpt-sidecar NAME ARGS` call it with ARGS."""
    calls = []
    plugin = types.ModuleType("jitckpt_sidecar_test_plugin")
    plugin.main = lambda argv: calls.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    monkeypatch.setitem(cli.COMMANDS, "install", (f"{plugin.__name__}:main", "copy the hook"))
    assert cli.main(["install", "/jitckpt", "--x"]) == 7
    assert calls == [["/jitckpt", "--x"]]
    cli.main(["--help"])
    assert "install" in capsys.readouterr().out


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    """A typo lists the commands."""
    assert cli.main(["uplaod"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = (
        "jitckpt-sidecar: error: unknown command 'uplaod'; use one of run, restore, check, "
        "install, inject, webhook (usage: jitckpt-sidecar "
        "[run|restore|check|install|inject|webhook] [OPTIONS])"
    )
    assert err == [expected]


def test_options_without_a_command_mean_run(monkeypatch):
    """`jitckpt-sidecar --dir X` is `jitckpt-sidecar run --dir X`."""
    seen = []
    monkeypatch.setattr(cli, "run_main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(cli.COMMANDS, "run", ("jitckpt_sidecar.cli:run_main", "run"))
    assert cli.main(["--dir", "/x"]) == 0
    assert seen == [["--dir", "/x"]]


@pytest.mark.parametrize("argv", [["check", "--nope"], ["check", "--s3-keep"]])
def test_bad_flags_are_one_line_and_exit_2(argv, capsys, monkeypatch):
    """argparse errors go through the same one-line edge."""
    monkeypatch.setenv("JITCKPT_STORAGE_URI", "s3://bucket-1/x")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("jitckpt-sidecar: error: ")
