"""Run real processes in tests: read their output line by line, wait with deadlines, kill trees.

No fixed sleeps as synchronisation: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Optional, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = [sys.executable, "-m", "jitckpt_entrypoint"]
UNSHARE_PID = ["unshare", "--pid", "--fork", "--mount-proc"]


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.01,
) -> T:
    """Poll `predicate` until it returns something truthy; fail the test at the deadline.

    Every `interval` seconds, or less often for a costly predicate (an HTTP scrape, an S3
    LIST): it runs at most a tenth of the time, with at most 0.25 s between looks. At 100 Hz
    such polls took CPU from the trainers under test (2 cores in CI)."""
    deadline = time.monotonic() + timeout
    while True:
        began = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(max(interval, min(0.25, 9 * (now - began))))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (free_ports)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago, none handed out
    before in this session. Below the ephemeral range: a port the kernel picked (bind to port
    0) goes free when the test closes its socket, and any outgoing connection (an S3 client's,
    gloo's) may take it before the server the test starts binds it; outside that range only
    another listener can, and each is handed its own."""
    low = int(_ephemeral_range()[0])
    ports: list[int] = []
    while len(ports) < count:
        port = _ports.randrange(max(1024, low - 12000), low)
        if port in _handed:
            continue
        _handed.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
        ports.append(port)
    return ports


_ports = random.Random(os.getpid())
_handed: set[int] = set()


def _ephemeral_range() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return f.read().split()
    except OSError:
        return ["32768", "60999"]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out.extend(kids)
        todo.extend(kids)
    return out


def state_of(pid: int) -> Optional[str]:
    """The process state letter (R, S, Z, ...) or None when it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[0]


def _stat(pid: int) -> Optional[tuple[str, int]]:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (found through /proc)."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def clean_env(jdir: Optional[Path] = None, *, checkout: bool = False) -> dict[str, str]:
    """The environment for processes under test (conftest's base_env; for module-scoped runs
    and the benches too): this one's without JITCKPT_* or TORCH_ELASTIC_* from outside, without
    PYTHONPATH, no hub; JITCKPT_DIR and the termination log in `jdir` when given. `checkout`:
    this checkout's entrypoint on PYTHONPATH, for a python where jitckpt is not installed (make
    test-gpu runs benches under the GPU machine's own python3)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "TORCH_ELASTIC_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    if jdir is not None:
        env.update(JITCKPT_DIR=str(jdir), JITCKPT_TERMINATION_LOG=str(jdir / "termination-log"))
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = str(REPO / "entrypoint")
    return env


class Proc:
    """A running command whose stdout and stderr are read line by line in the background."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[Path] = None,
        stdin: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.popen = subprocess.Popen(
            self.argv,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.pid = self.popen.pid
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.stamped: list[tuple[float, str]] = []
        """(time.monotonic() when read, line) for every stdout line."""
        self.stamped_err: list[tuple[float, str]] = []
        """(time.monotonic() when read, line) for every stderr line."""
        self._readers = [
            threading.Thread(
                target=self._pump, args=(self.popen.stdout, self.stdout, True), daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(self.popen.stderr, self.stderr, False), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()

    def _pump(self, stream: object, sink: list[str], to_queue: bool) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            line = raw.rstrip("\n")
            sink.append(line)
            if to_queue:
                self.stamped.append((time.monotonic(), line))
                self.lines.put(line)
            else:
                self.stamped_err.append((time.monotonic(), line))

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Read stdout lines until one matches `pattern` (torch starts slowly on a busy runner)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no stdout line matched {pattern!r} within {timeout} s\n{self.output()}"
                )
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.popen.poll() is not None and self.lines.empty():
                    self._drain()
                    if self.lines.empty():
                        raise AssertionError(
                            f"exited ({self.popen.returncode}) before printing {pattern!r}\n"
                            f"{self.output()}"
                        ) from None
                continue
            match = regex.search(line)
            if match:
                return match

    def _drain(self) -> None:
        for reader in self._readers:
            reader.join(timeout=5)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout} s: {self.argv}\n{self.output()}"
            ) from None
        self._drain()
        return code

    def send(self, signo: int) -> None:
        os.kill(self.pid, signo)

    def write(self, text: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text)
        self.popen.stdin.flush()

    def output(self) -> str:
        return "--- stdout\n" + "\n".join(self.stdout) + "\n--- stderr\n" + "\n".join(self.stderr)

    def kill_tree(self) -> None:
        if self.popen.poll() is None or descendants(self.pid):
            kill_tree(self.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        self._drain()
