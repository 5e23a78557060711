"""A network namespace of the test's own: its loopback up, its packet filter touching nothing
else. `silence` makes a process tree a machine gone without closing its connections: stopped,
and every packet to or from its TCP ports dropped (no FIN, no RST, no acknowledgement)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

from harness.procs import descendants


class NetNs:
    def __init__(self, holder: subprocess.Popen[str]) -> None:
        self.holder = holder

    @property
    def prefix(self) -> list[str]:
        """Put before a command to run it in the namespace."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]

    def silence(self, pid: int) -> list[int]:
        """Stop `pid` and its descendants and drop their packets; the TCP ports dropped."""
        tree = [pid, *descendants(pid)]
        ports = sorted({port for p in tree for port in _tcp_ports(p)})
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        for start in range(0, len(ports), 15):  # multiport takes 15 ports a rule
            listed = ",".join(map(str, ports[start : start + 15]))
            subprocess.run(
                [*self.prefix, "iptables", "-A", "INPUT", "-p", "tcp", "-m", "multiport",
                 "--ports", listed, "-j", "DROP"],
                check=True,
            )  # fmt: skip
        return ports


@contextlib.contextmanager
def netns() -> Iterator[NetNs]:
    holder = subprocess.Popen(  # killed with this process, even when it is SIGKILLed
        ["setpriv", "--pdeathsig", "KILL", "unshare", "--net", "sh", "-c",
         "ip link set lo up && echo up && exec sleep 3600"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "up", "unshare --net failed"
        yield NetNs(holder)
    finally:
        holder.kill()
        holder.wait()


def _tcp_ports(pid: int) -> set[int]:
    """Local ports of `pid`'s TCP sockets."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
