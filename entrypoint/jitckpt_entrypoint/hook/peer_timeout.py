"""A machine gone without closing its connections fails the next collective in seconds.

A node that is powered off, cut off the network or hung in its kernel sends no FIN and no RST:
its peers' gloo collectives wait for the process group's timeout (30 minutes by default, HF's
`ddp_timeout`), and the survivors' save (survivors.py) waits with them; TCP itself retransmits
for about 15 minutes.

So the training processes' TCP connections get keepalive probes (an idle connection is probed
after half of `seconds`), and while training has not finished a step for half of `seconds`, a
watch thread reads each connection's TCP_INFO: one that has data or a probe awaiting an
acknowledgement and has received none for `seconds`, on looks 1.5 s apart, is shut down. gloo
then raises `Connection closed by peer` at once, and the survivors save as after a closed
connection.

Only the other machine's kernel matters: a peer process that is slow, holds its GIL, waits in a
long evaluation or is stopped still has its connections acknowledged (a full receive window
answers its probes), so nothing alive is cut short, as TCP_USER_TIMEOUT would (it also ends a
connection whose receiver does not read for that long). Never raises into training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from typing import Optional

PROBES = 9
"""Keepalive probes unanswered before the kernel itself ends an idle connection (a backstop:
the watch ends it first)."""
LOOK = 0.5
"""Seconds between looks while no step ends."""
CONFIRM = 1.5
"""Seconds a connection must stay silent across looks: a probe the other end's rate limit on
out-of-window acknowledgements (500 ms) left unanswered is answered by the next."""
TCP_INFO = struct.Struct("8B14I")
"""struct tcp_info up to tcpi_last_ack_recv (linux/tcp.h, a stable ABI)."""


class PeerTimeout:
    """Keepalive on the process's TCP connections, and the watch that shuts down a silent
    one."""

    def __init__(self, seconds: int, log: logging.Logger) -> None:
        self.seconds = seconds
        self.log = log
        self._known: set[tuple[int, int]] = set()
        """(fd, inode) of the connections set."""
        self._progress = time.monotonic()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def apply(self) -> int:
        """Keepalive on every established TCP connection not yet set, and the watch started;
        how many were set now."""
        if self.seconds <= 0 or not hasattr(socket, "TCP_INFO"):
            return 0
        count = 0
        for key in _sockets():
            with self._lock:
                if key in self._known:
                    continue
            if _keepalive(key, self.seconds):
                count += 1
                with self._lock:
                    self._known.add(key)
        if self._thread is None and self._known:
            self._thread = threading.Thread(
                target=self._watch, name="jitckpt-peer-timeout", daemon=True
            )
            self._thread.start()
        return count

    def progressed(self) -> None:
        """Training finished a step: its connections are working."""
        self._progress = time.monotonic()

    def _watch(self) -> None:
        suspects: dict[tuple[int, int], float] = {}
        while True:
            time.sleep(LOOK)
            if time.monotonic() - self._progress < self.seconds / 2:
                suspects = {}
                continue
            try:
                suspects = self._look(suspects)
            except Exception as exc:  # noqa: BLE001 - the watch only: TCP's own timeouts stay
                self.log.debug("peer timeout watch ended: %r", exc)
                return

    def _look(self, suspects: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
        """Shut down the connections silent for the timeout, and so on looks at least CONFIRM
        seconds apart; the ones silent now (for the timeout less CONFIRM), with when each was
        first seen so."""
        silent, now, limit = {}, time.monotonic(), self.seconds * 1000
        soon = limit - CONFIRM * 1000
        with self._lock:
            known = list(self._known)
        for key in known:
            with _open(key) as sock:
                if sock is None:
                    with self._lock:
                        self._known.discard(key)
                    continue
                waited = _unacknowledged_ms(sock)
                if waited is None or waited < soon:
                    continue
                if waited < limit or now - suspects.get(key, now) < CONFIRM:
                    silent[key] = suspects.get(key, now)
                    continue
                with contextlib.suppress(OSError):
                    peer = "%s:%s" % sock.getpeername()[:2]  # noqa: UP031 - IPv4 and IPv6 alike
                    sock.shutdown(socket.SHUT_RDWR)
                    self.log.warning(
                        "the machine at %s acknowledged nothing for %.0f s "
                        "(JITCKPT_PEER_TIMEOUT): its connection is closed, so the collective "
                        "waiting on it fails and the survivors save",
                        peer,
                        waited / 1000,
                    )
                with self._lock:
                    self._known.discard(key)
        return silent


def _sockets() -> list[tuple[int, int]]:
    """(fd, inode) of this process's sockets."""
    out = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    out.append((int(name), int(target[8:-1])))
    return out


@contextlib.contextmanager
def _open(key: tuple[int, int]):  # type: ignore[no-untyped-def]
    """A duplicate of the connected TCP socket `key` (fd, inode), or None when that fd is no
    longer it. Closing the duplicate leaves the socket open."""
    try:
        dup = os.dup(key[0])
    except OSError:
        yield None
        return
    try:
        if os.fstat(dup).st_ino != key[1]:
            os.close(dup)
            yield None
            return
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    with sock:
        try:
            connected = sock.type == socket.SOCK_STREAM and sock.family in (
                socket.AF_INET,
                socket.AF_INET6,
            )
            sock.getpeername()  # listening or unconnected: not a connection
        except OSError:
            connected = False
        yield sock if connected else None


def _keepalive(key: tuple[int, int], seconds: int) -> bool:
    with _open(key) as sock:
        if sock is None:
            return False
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, seconds // 2))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, seconds // 4))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBES)
        except OSError:
            return False
    return True


def _unacknowledged_ms(sock: socket.socket) -> Optional[int]:
    """Milliseconds since `sock` last received an acknowledgement, when it has data or a
    probe awaiting one (else None: nothing is owed to it)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < TCP_INFO.size:
        return None
    info = TCP_INFO.unpack_from(raw)
    probes, unacked, last_ack_recv = info[3], info[12], info[20]
    return last_ack_recv if (probes or unacked) else None
