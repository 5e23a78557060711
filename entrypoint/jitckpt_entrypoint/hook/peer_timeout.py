"""A machine gone without closing its connections fails the next collective in seconds (opt-in:
JITCKPT_PEER_TIMEOUT).

A node that is powered off, cut off the network or hung in its kernel sends no FIN and no RST:
its peers' gloo collectives wait for the process group's timeout (30 minutes by default, HF's
`ddp_timeout`), and the survivors' save (survivors.py) waits with them; TCP itself retransmits
for about 15 minutes.

So the training process's TCP connections get keepalive probes (an idle connection is probed
after half of `seconds`, then every quarter) and, where the kernel has it (Linux >= 6.15), a
retransmission and zero-window probe interval capped at a quarter of `seconds`
(TCP_RTO_MAX_MS): after an outage the next retransmission or probe, and so its answer, comes
within that quarter. While training is on and has not finished a step for LOOK_AFTER seconds, a
watch thread reads each connection's TCP_INFO every LOOK seconds. A connection that owes an
acknowledgement (data or a probe sent, none back) on every look for `seconds`, with no
acknowledgement between the looks, is shut down: gloo then raises `Connection closed by peer` at
once, and the survivors save as after a closed connection. The silence counts from the first
look that saw it, never from the last acknowledgement (an idle connection's probe goes out long
after that), so an outage shorter than three quarters of `seconds` never ends a live connection
(with the cap; without it, the kernel's backoff can leave a connection owing for up to the
outage's length again after it ended: about half of `seconds`).

Only the other machine's kernel matters: a peer process that is slow, holds its GIL, waits in a
long evaluation, does not read (its zero window answers the probes) or is stopped still
acknowledges. The socket calls go through libc on the process's own descriptors (no Python
socket object, which would change a socket's blocking mode; no duplicate to close).
Never raises into training.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Optional

LOOK = 0.5
"""Seconds between looks."""
LOOK_AFTER = 1.0
"""Looks start once no step has ended for this long (a stalled collective)."""
PROBES = 9
"""Keepalive probes unanswered before the kernel itself ends an idle connection: a backstop well
after the watch (seconds/2 + 9 x seconds/4)."""
ACK_SLACK = 0.25
"""Seconds an acknowledgement's time may differ between two reads of the same one."""
REAPPLY = 10.0
"""Seconds between looks for connections made since (a group created at the first save)."""
TCP_INFO = struct.Struct("8B14I")
"""struct tcp_info up to tcpi_last_ack_recv (linux/tcp.h, a stable ABI)."""
ESTABLISHED = 1
TCP_RTO_MAX_MS = 44
"""linux/tcp.h (6.15): the largest retransmission timeout, in ms."""


class PeerTimeout:
    """Keepalive on the process's TCP connections, and the watch that shuts down a silent
    one."""

    def __init__(self, seconds: int, log: logging.Logger) -> None:
        self.seconds = seconds
        self.log = log
        self._known: set[tuple[int, int]] = set()
        """(fd, inode) of the connections set."""
        self._other: set[tuple[int, int]] = set()
        """(fd, inode) of sockets that are not TCP connections (not looked at again)."""
        self._progress = time.monotonic()
        self._on = False
        """Training is on (between `started` and `stopped`)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._libc: Any = None

    def started(self) -> int:
        """Training starts: keepalive on the connections, the watch on; how many were set."""
        if self.seconds <= 0:
            return 0
        if self._libc is None:
            self._libc = _libc()
            if self._libc is None:
                return 0
        self._progress, self._on = time.monotonic(), True
        count = self._apply()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._watch, name="jitckpt-peer-timeout", daemon=True
            )
            self._thread.start()
        return count

    def progressed(self) -> None:
        """Training finished a step: its connections are working."""
        self._progress = time.monotonic()

    def stopped(self) -> None:
        """Training ended (or raised): no more looks until it starts again."""
        self._on = False

    def close(self) -> None:
        """End the watch thread."""
        self._on = False
        self._stop.set()

    def _apply(self) -> int:
        count = 0
        for key in _sockets():
            if key in self._known or key in self._other:
                continue
            if self._keepalive(key):
                self._known.add(key)
                count += 1
            else:
                self._other.add(key)
        return count

    def _watch(self) -> None:
        silent: dict[tuple[int, int], tuple[float, float]] = {}
        """Connections owing an acknowledgement: (the first look that saw it, when its last
        acknowledgement came, as that look read it)."""
        applied = time.monotonic()
        while not self._stop.wait(LOOK):
            now = time.monotonic()
            if not self._on or now - self._progress < LOOK_AFTER:
                silent = {}
                continue
            try:
                if now - applied >= REAPPLY:
                    applied = now
                    self._apply()
                silent = self._look(silent)
            except Exception as exc:  # noqa: BLE001 - the watch only: TCP's own timeouts stay
                self.log.warning("peer timeout: a look failed (%r); looking again", exc)
                silent = {}

    def _look(
        self, silent: dict[tuple[int, int], tuple[float, float]]
    ) -> dict[tuple[int, int], tuple[float, float]]:
        """Shut down the connections silent for `seconds`; those silent now."""
        still: dict[tuple[int, int], tuple[float, float]] = {}
        for key in list(self._known):
            now = time.monotonic()  # per read: a look can take long under contention
            owed = self._owed(key[0])
            if owed is None:
                if not _is(key):
                    self._known.discard(key)
                continue  # nothing owed now: a silence seen before is over
            acked = now - owed / 1000  # when its last acknowledgement came
            since, first_acked = silent.get(key, (now, acked))
            if acked > first_acked + ACK_SLACK:  # one came since the first look: a new silence
                since, first_acked = now, acked
            if now - since < self.seconds:
                still[key] = (since, first_acked)
                continue
            # The descriptor is checked just before: one closed and reused by another socket
            # in between (microseconds) would be shut down instead; nothing here ever closes.
            if self._on and _is(key) and self._libc.shutdown(key[0], socket.SHUT_RDWR) == 0:
                self._known.discard(key)
                self.log.warning(
                    "the machine at %s acknowledged nothing for %.0f s (JITCKPT_PEER_TIMEOUT): "
                    "its connection is shut down, so the collective waiting on it fails and the "
                    "survivors save",
                    self._peer(key[0]),
                    now - since,
                )
        return still

    def _owed(self, fd: int) -> Optional[int]:
        """Milliseconds since `fd` last received an acknowledgement, when it has data or a
        probe awaiting one (else None)."""
        info = self._getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO.size)
        if info is None or len(info) < TCP_INFO.size:
            return None
        fields = TCP_INFO.unpack_from(info)
        state, probes, unacked, last_ack_recv = fields[0], fields[3], fields[12], fields[20]
        if state != ESTABLISHED or not (probes or unacked):
            return None
        return int(last_ack_recv)

    def _keepalive(self, key: tuple[int, int]) -> bool:
        fd = key[0]
        kind = self._getsockopt(fd, socket.SOL_SOCKET, socket.SO_TYPE, 4)
        family = self._getsockopt(fd, socket.SOL_SOCKET, socket.SO_DOMAIN, 4)
        info = self._getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO.size)
        if kind is None or family is None or info is None or not _is(key):
            return False
        stream = struct.unpack("i", kind)[0] == socket.SOCK_STREAM
        inet = struct.unpack("i", family)[0] in (socket.AF_INET, socket.AF_INET6)
        if not (stream and inet and info[0] == ESTABLISHED):
            return False
        options = (
            (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, self.seconds // 2)),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, self.seconds // 4)),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBES),
        )
        for level, name, value in options:
            raw = ctypes.c_int(value)
            if self._libc.setsockopt(fd, level, name, ctypes.byref(raw), 4) != 0:
                return False
        cap = ctypes.c_int(max(1000, self.seconds * 250))  # older kernels: ENOPROTOOPT, as is
        self._libc.setsockopt(fd, socket.IPPROTO_TCP, TCP_RTO_MAX_MS, ctypes.byref(cap), 4)
        return True

    def _peer(self, fd: int) -> str:
        """host:port of the other end."""
        address = ctypes.create_string_buffer(128)
        length = ctypes.c_uint32(128)
        if self._libc.getpeername(fd, address, ctypes.byref(length)) != 0:
            return "?"
        raw = address.raw
        family, port = struct.unpack_from("=H", raw)[0], struct.unpack_from("!H", raw, 2)[0]
        if family == socket.AF_INET:
            return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
        if family == socket.AF_INET6:
            return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
        return "?"

    def _getsockopt(self, fd: int, level: int, name: int, size: int) -> Optional[bytes]:
        buffer = ctypes.create_string_buffer(size)
        length = ctypes.c_uint32(size)
        if self._libc.getsockopt(fd, level, name, buffer, ctypes.byref(length)) != 0:
            return None
        return buffer.raw[: length.value]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's
    except OSError:
        return None
    for name in ("getsockopt", "setsockopt", "shutdown", "getpeername"):
        if not hasattr(libc, name):
            return None
    return libc


def shut_down_to(pids: list[int]) -> int:
    """Shut down this process's TCP connections to the processes `pids` (matched by address
    in /proc/net/tcp and tcp6): a collective of theirs waiting on this process fails at once.
    How many were shut down. Never raises."""
    libc = _libc()
    if libc is None or not pids:
        return 0
    theirs = {inode for pid in pids for _, inode in _sockets(str(pid))}
    table: dict[int, tuple[str, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9].isdigit() and fields[3] == "01":  # established
                    table[int(fields[9])] = (_v4(fields[1]), _v4(fields[2]))
    ends = {table[inode][0] for inode in theirs if inode in table}
    count = 0
    for fd, inode in _sockets():
        if inode in table and table[inode][1] in ends and libc.shutdown(fd, socket.SHUT_RDWR) == 0:
            count += 1
    return count


def _v4(address: str) -> str:
    """/proc/net/tcp6's IPv4-mapped address (::ffff:a.b.c.d) as /proc/net/tcp writes it."""
    host, _, port = address.partition(":")
    if len(host) == 32 and host.startswith("0000000000000000FFFF0000"):
        return f"{host[24:]}:{port}"
    return address


def _sockets(pid: str = "self") -> list[tuple[int, int]]:
    """(fd, inode) of the process's sockets (this one's by default)."""
    out: list[tuple[int, int]] = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        inode = _inode(int(name), pid)
        if inode is not None:
            out.append((int(name), inode))
    return out


def _inode(fd: int, pid: str = "self") -> Optional[int]:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return int(target[8:-1]) if target.startswith("socket:[") else None


def _is(key: tuple[int, int]) -> bool:
    """The descriptor is still that socket (not closed, not reused)."""
    return _inode(key[0]) == key[1]
