"""jitckpt-entrypoint as a real PID 1: signals, zombies, exit codes, environment, bad inputs."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from harness.procs import ENTRYPOINT, UNSHARE_PID, Proc, children_of, environ_of, wait_for
from jitckpt_entrypoint.cli import HOOK_DIR

pytestmark = pytest.mark.integration
CHILDREN = Path(__file__).parent / "children"
PY = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def child(name: str, *args: str) -> list[str]:
    return [PY, str(CHILDREN / name), *args]


def start_pid1(spawn, env, command, stdin=False) -> tuple[Proc, int]:
    """The entrypoint as PID 1 of a new PID namespace; returns (unshare proc, entrypoint pid)."""
    proc = spawn([*UNSHARE_PID, *ENTRYPOINT, "--", *command], env=env, stdin=stdin)
    (entry_pid,) = wait_for(lambda: children_of(proc.pid), what="the entrypoint under unshare")
    return proc, entry_pid


def test_child_of_pid1_runs_in_its_own_session(spawn, base_env):
    """In a PID namespace the entrypoint is PID 1; the command is its child, in a new session."""
    proc, _ = start_pid1(spawn, base_env, child("echo_signals.py"), stdin=True)
    ready = proc.expect(r"ready pid=(\d+) ppid=(\d+) sid=(\d+)")
    pid, ppid, sid = map(int, ready.groups())
    assert ppid == 1
    assert sid == pid
    proc.write("exit 0\n")
    assert proc.wait() == 0


def test_every_forwarded_signal_reaches_the_child_and_repeats_are_forwarded(spawn, base_env):
    """SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 reach the child; a second TERM/INT too."""
    proc, entry = start_pid1(spawn, base_env, child("echo_signals.py"), stdin=True)
    proc.expect("ready")
    for name in (
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGTERM",
        "SIGINT",
    ):
        os.kill(entry, getattr(signal, name))
        assert proc.expect(r"^SIG").group(0) is not None
        assert proc.stdout[-1] == name
    proc.write("exit 0\n")
    assert proc.wait() == 0
    assert "forwarding SIGINT" in "\n".join(proc.stderr)


@pytest.mark.parametrize("orphans", [1, 25])
def test_orphaned_grandchildren_never_stay_zombies(spawn, base_env, orphans):
    """Orphans re-parented to PID 1 are reaped as soon as they exit, however many exit at once."""
    proc, _ = start_pid1(spawn, base_env, child("orphans.py", str(orphans)))
    assert proc.expect(r"^(reaped|zombie)").group(0) == "reaped"
    assert proc.stdout[-1] == f"reaped {orphans}"
    assert proc.wait() == 0


@pytest.mark.parametrize("code", [0, 1, 2, 3, 42, 126, 127, 128, 129, 143, 200, 254, 255])
def test_exit_code_propagates_from_pid1(spawn, base_env, code):
    """The entrypoint exits with the child's exit code."""
    proc, _ = start_pid1(spawn, base_env, child("exit_with.py", "code", str(code)))
    assert proc.wait() == code


@pytest.mark.parametrize(
    "signo",
    [
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGABRT,
        signal.SIGKILL,
        signal.SIGSEGV,
        signal.SIGTERM,
    ],
)
def test_child_killed_by_signal_gives_128_plus_n(spawn, base_env, jdir, signo):
    """A child killed by signal N: exit 128+N, and the termination log says so."""
    proc, _ = start_pid1(
        spawn,
        base_env,
        ["sh", "-c", f"ulimit -c 0; exec {PY} {CHILDREN / 'exit_with.py'} signal {int(signo)}"],
    )
    assert proc.wait() == 128 + signo
    assert (jdir / "termination-log").read_text().strip() == (
        f"training command killed by {signal.Signals(signo).name} (exit {128 + signo})"
    )


def test_users_pythonpath_and_sitecustomize_still_work(spawn, base_env, tmp_path):
    """Hook first on PYTHONPATH; the user's entries still import; their sitecustomize runs."""
    user = tmp_path / "user-lib"
    user.mkdir()
    (user / "user_module.py").write_text("VALUE = 42\n")
    (user / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n"
    )
    env = {**base_env, "PYTHONPATH": str(user)}
    proc, _ = start_pid1(spawn, env, child("python_env.py"))
    assert proc.wait() == 0, proc.output()
    out = dict(line.split("=", 1) for line in proc.stdout)
    assert out["user_module"] == "42"
    assert out["user_sitecustomize"] == "True"
    assert out["pythonpath"] == f"{HOOK_DIR}:{user}"
    sys_path = out["sys_path"].split(":")
    assert sys_path.index(HOOK_DIR) < sys_path.index(str(user))
    assert not [line for line in proc.stderr if "jitckpt hook" in line]


def test_status_file_and_termination_log_record_the_run(spawn, base_env, jdir):
    """trainer.json records start, SIGTERM and exit; the termination log gets one summary line."""
    proc, entry = start_pid1(spawn, base_env, child("echo_signals.py"), stdin=True)
    proc.expect("ready")
    status_file = jdir / "status" / "trainer.json"
    started = json.loads(status_file.read_text())
    assert started["started_at"] > 0
    assert started["sigterm_at"] is None
    os.kill(entry, signal.SIGTERM)
    proc.expect("SIGTERM")
    wait_for(lambda: json.loads(status_file.read_text())["sigterm_at"], what="sigterm_at")
    proc.write("exit 3\n")
    assert proc.wait() == 3
    final = json.loads(status_file.read_text())
    assert final["exit_code"] == 3
    assert final["exited_at"] >= final["sigterm_at"] >= final["started_at"]
    assert (jdir / "termination-log").read_text() == (
        "SIGTERM received, no JIT checkpoint committed; training command exited with code 3\n"
    )


def _fake_trainer_writing_jit(run_id_expr: str) -> list[str]:
    code = (
        "import os, time\n"
        "from jitckpt_entrypoint.protocol import status\n"
        "d = os.path.join(os.environ['JITCKPT_DIR'], 'status')\n"
        f"rec = status.JitRecord({run_id_expr}, 12, 'checkpoint-12', time.time(), "
        "time.time() - 1.5, 0.5)\n"
        "status.write_jit(d, rec)\n"
        "raise SystemExit(1)\n"
    )
    return [PY, "-c", code]


def test_jit_record_of_this_run_gives_the_jit_exit_code(spawn, base_env, jdir):
    """A committed JIT checkpoint recorded for this run: exit JITCKPT_EXIT_CODE."""
    env = {**base_env, "JITCKPT_EXIT_CODE": "99"}
    proc, _ = start_pid1(spawn, env, _fake_trainer_writing_jit("os.environ['JITCKPT_RUN_ID']"))
    assert proc.wait() == 99
    assert (jdir / "termination-log").read_text() == (
        "JIT checkpoint checkpoint-12 committed 1.5 s after SIGTERM\n"
    )


def test_jit_record_of_another_run_is_ignored(spawn, base_env, jdir):
    """A jit.json left by an earlier run does not turn this run's failure into a JIT exit."""
    proc, _ = start_pid1(spawn, base_env, _fake_trainer_writing_jit("'some-older-run'"))
    assert proc.wait() == 1
    assert (jdir / "termination-log").read_text() == "training command exited with code 1\n"


def test_outside_a_namespace_it_becomes_a_subreaper_and_says_so_once(spawn, base_env):
    """Not PID 1: registers as child subreaper, says so once, and still reaps orphans."""
    proc = spawn([*ENTRYPOINT, "--", *child("orphans.py", "5")], env=base_env)
    # orphans.py looks at its own /proc (the host's here), so it sees the orphans reaped by us.
    assert proc.expect(r"^(reaped|zombie)").group(0) == "reaped"
    assert proc.wait() == 0
    notes = [line for line in proc.stderr if "subreaper" in line]
    assert len(notes) == 1
    assert "not PID 1" in notes[0]


def test_torchrun_workers_receive_sigterm_and_the_agent_gets_the_shutdown_timeout(spawn, base_env):
    """torchrun forwards SIGTERM to both workers; the agent's env has the derived timeout."""
    pytest.importorskip("torch", reason="torchrun needs torch (not in the python3.9 run)")
    env = {**base_env, "JITCKPT_GRACE_SECONDS": "40"}
    command = [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        "--master-port",
        "0",
        str(CHILDREN / "torchrun_worker.py"),
    ]
    proc, entry = start_pid1(spawn, env, command)
    ranks = {proc.expect(r"ready rank=(\d) timeout=(\S+) agent=").groups() for _ in range(2)}
    assert ranks == {("0", "30"), ("1", "30")}
    (agent,) = children_of(entry)
    assert environ_of(agent)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "30"
    os.kill(entry, signal.SIGTERM)
    got = {proc.expect(r"SIGTERM rank=(\d)").group(1) for _ in range(2)}
    assert got == {"0", "1"}
    code = proc.wait(timeout=60)
    assert code == 1  # torchrun's code after a signal; no JIT record here to map it
    # The agent's SignalException is one line, not a traceback after the workers' logs.
    output = proc.stdout + proc.stderr
    assert not [line for line in output if "Traceback" in line or "SignalException" in line]
    assert sum("the agent stopped on SIGTERM" in line for line in output) == 1


def test_users_own_shutdown_timeout_is_kept(spawn, base_env):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT set by the user is not overridden."""
    env = {**base_env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}
    proc = spawn(
        [*ENTRYPOINT, "--", "sh", "-c", "echo timeout=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], env=env
    )
    assert proc.wait() == 0
    assert proc.stdout == ["timeout=7"]


BAD_INPUTS = [
    (["--bogus", "--"], {}, "unrecognized arguments: --bogus"),
    ([], {}, "missing '--' before the training command"),
    (["--"], {}, None),  # command removed below: missing command
    (["--", "no-such-command-xyz"], {}, "command not found on PATH: 'no-such-command-xyz'"),
    (
        ["--"],
        {"JITCKPT_GRACE_SECONDS": "thirty"},
        "JITCKPT_GRACE_SECONDS='thirty' is not an integer",
    ),
    (["--grace-seconds", "0", "--"], {}, "--grace-seconds 0 is invalid"),
    (["--"], {"JITCKPT_GRACE_SECONDS": "-5"}, "JITCKPT_GRACE_SECONDS=-5 is invalid"),
    (
        ["--"],
        {"JITCKPT_EXIT_CODE": "0"},
        "JITCKPT_EXIT_CODE=0 is invalid; use an exit code from 1 to 255",
    ),
    (
        ["--exit-code", "256", "--"],
        {},
        "--exit-code 256 is invalid; use an exit code from 1 to 255",
    ),
    (["--"], {"JITCKPT_SAVE_STRATEGY": "hourly"}, "JITCKPT_SAVE_STRATEGY='hourly' is invalid"),
    (["--"], {"JITCKPT_JIT": "maybe"}, "JITCKPT_JIT='maybe' is not a boolean"),
    (["--"], {"JITCKPT_STORAGE_URI": "gs://bucket"}, "is not an S3 URI"),
    (["--"], {"JITCKPT_DIR": "{file}/sub"}, "is not writable"),
]


@pytest.mark.parametrize(("args", "env_extra", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_error_and_exit_2_before_starting(
    spawn, base_env, tmp_path, args, env_extra, message
):
    """Each bad option or value: one line naming the fix, exit 2, the command never ran."""
    marker = tmp_path / "ran"
    command = ["sh", "-c", f"touch {marker}"]
    argv = list(args)
    if argv == ["--"] and message is None:
        message = "missing the training command after '--'"
    elif argv and argv[-1] == "--":
        argv += command
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {**base_env, **{k: v.replace("{file}", str(a_file)) for k, v in env_extra.items()}}
    proc = spawn([*ENTRYPOINT, *argv], env=env)
    assert proc.wait() == 2
    assert len(proc.stderr) == 1, proc.stderr
    assert proc.stderr[0].startswith("jitckpt-entrypoint: error: ")
    assert message in proc.stderr[0]
    assert not marker.exists()
