"""`jitckpt-sidecar install DIR`: the swap-in bundle runs under another python3 and any UID."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jitckpt_sidecar import install


def _python39() -> str:
    """A real python3.9 (pyenv's shim only works where pyenv selects that version)."""
    for candidate in sorted(Path("/root/.pyenv/versions").glob("3.9.*/bin/python3.9")):
        return str(candidate)
    return shutil.which("python3.9") or "/nonexistent/python3.9"


PY39 = _python39()


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in sorted(root.rglob("*"))}


def test_install_copies_the_package_without_bytecode_and_writes_an_executable_launcher(tmp_path):
    launcher = install.install(tmp_path / "bundle")
    assert launcher == tmp_path / "bundle" / "jitckpt-entrypoint"
    assert os.access(launcher, os.X_OK)
    copied = tmp_path / "bundle" / "jitckpt_entrypoint"
    assert (copied / "cli.py").is_file()
    assert (copied / "_site" / "sitecustomize.py").is_file()
    assert not list(copied.rglob("__pycache__"))
    assert not list(copied.rglob("*.pyc"))
    source = {p.relative_to(install.package_dir()) for p in install.package_dir().rglob("*.py")}
    assert {p.relative_to(copied) for p in copied.rglob("*.py")} == source


def test_install_is_idempotent_and_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "bundle"
    install.install(target)
    first = tree(target)
    (target / "jitckpt_entrypoint" / "stale.py").write_text("# from an older version\n")
    install.install(target)
    assert tree(target) == first  # the stale file is gone, nothing else changed
    assert not [p for p in target.iterdir() if p.name.startswith(".")]


def test_files_are_readable_by_any_uid_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        install.install(tmp_path / "bundle")
    finally:
        os.umask(old)
    modes = tree(tmp_path / "bundle")
    assert modes["jitckpt-entrypoint"] == 0o755
    assert modes["jitckpt_entrypoint"] == 0o755
    assert modes["jitckpt_entrypoint/cli.py"] == 0o644


def run_bundle(
    launcher: Path, python: str, jdir: Path, *prefix: str, child: str = "", **extra: str
) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "JITCKPT_DIR": str(jdir),
        "JITCKPT_TERMINATION_LOG": "",
        **extra,
    }
    child = child or (
        "import sys, sitecustomize; print('child', sys.version_info[:2], sitecustomize.__file__)"
    )
    return subprocess.run(
        [*prefix, python, str(launcher), "--", python, "-c", child],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(not Path(PY39).exists(), reason="no python3.9 on this machine")
def test_the_bundle_runs_under_python_3_9_and_injects_its_hook(tmp_path):
    """The launcher runs jitckpt-entrypoint with an older python3, and the child process
    loads the bundle's sitecustomize hook (not disabled) from the bundle directory."""
    launcher = install.install(tmp_path / "bundle")
    jdir = tmp_path / "jitckpt"
    jdir.mkdir()
    result = run_bundle(launcher, PY39, jdir)
    assert result.returncode == 0, result.stderr
    assert "child (3, 9)" in result.stdout
    assert str(tmp_path / "bundle" / "jitckpt_entrypoint" / "_site") in result.stdout
    assert "disabled" not in result.stderr


def test_the_bundle_starts_its_ram_writer(tmp_path):
    """With JITCKPT_MEMORY_DIR, the bundle's entrypoint starts the RAM writer from the bundle
    (not installed anywhere the python finds by itself)."""
    launcher = install.install(tmp_path / "bundle")
    jdir, memory = tmp_path / "jitckpt", tmp_path / "memory"
    jdir.mkdir()
    wait = "import time; time.sleep(2)"  # the writer's start, before the entrypoint stops it
    result = run_bundle(launcher, PY39, jdir, child=wait, JITCKPT_MEMORY_DIR=str(memory))
    assert result.returncode == 0, result.stderr
    assert "jitckpt-ram-writer: INFO writing periodic saves from" in result.stderr, result.stderr
    assert (memory / "write-out" / "writer.json").exists()


def test_the_bundle_runs_as_another_uid(request):
    """Installed by root (umask 077), run by nobody: what an init container and a trainer
    with different UIDs do."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to switch UIDs")
    tmp_path = Path(tempfile.mkdtemp(prefix="jitckpt-uid-", dir="/tmp"))  # pytest's is 0700
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    tmp_path.chmod(0o755)
    old = os.umask(0o077)
    try:
        launcher = install.install(tmp_path / "bundle")
    finally:
        os.umask(old)
    jdir = tmp_path / "jitckpt"
    jdir.mkdir(mode=0o777)
    jdir.chmod(0o777)
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    setpriv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    result = run_bundle(launcher, python, jdir, *setpriv)
    assert result.returncode == 0, result.stderr
    assert "child" in result.stdout


def test_an_old_python_gets_one_line_instead_of_a_syntax_error(tmp_path):
    """The launcher itself parses under any python3 and names the version it needs."""
    launcher = install.install(tmp_path / "bundle")
    text = launcher.read_text().replace("(3, 9)", "(99, 0)")
    launcher.write_text(text)
    result = subprocess.run(
        [sys.executable, str(launcher), "--", "true"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "needs python3 >= 3.9" in result.stderr


def test_main_reports_an_unwritable_target_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert install.main([str(blocker / "bundle")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jitckpt-sidecar install: error: cannot write the entrypoint bundle")
    assert err.count("\n") == 1


def test_main_without_a_directory_is_a_usage_error(capsys):
    assert install.main([]) == 2
    assert "usage: jitckpt-sidecar install DIR" in capsys.readouterr().err


def test_main_prints_the_command_to_run(tmp_path, capsys):
    assert install.main([str(tmp_path / "b")]) == 0
    assert f"python3 {tmp_path / 'b' / 'jitckpt-entrypoint'} -- COMMAND" in capsys.readouterr().out
