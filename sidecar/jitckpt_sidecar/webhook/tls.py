"""The webhook's server certificate, reloaded when its files change (cert-manager rotates them).

Kubernetes updates a mounted Secret by swapping a symlink, so both files change at once from a
reader's side; a pair that does not load (a key that does not match its certificate, a file
half-written by some other tool) keeps the previous context in use and is tried again at the
next change. The files are looked at, at most once a second, when a connection comes in.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from typing import Callable, Optional

from jitckpt_sidecar.errors import ConfigError

CHECK_EVERY = 1.0
"""Seconds between looks at the files."""

Signature = tuple[tuple[int, int, int], ...]


class ReloadingContext:
    """The SSLContext to wrap the next connection with; the first load's failure is a
    ConfigError (exit 2), later ones are logged and counted (`on_reload(ok)`)."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        logger: logging.Logger,
        on_reload: Callable[[bool], None] = lambda _ok: None,
    ) -> None:
        self.cert_file, self.key_file, self.log = cert_file, key_file, logger
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._signature = self._stat()
        try:
            self._context = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the TLS certificate {cert_file} with its key {key_file}: "
                f"{_reason(exc)}; check --tls-cert-file and --tls-private-key-file"
            ) from None

    def context(self) -> ssl.SSLContext:
        now = time.monotonic()
        with self._lock:
            if now - self._checked >= CHECK_EVERY:
                self._checked = now
                self._maybe_reload()
            return self._context

    def _maybe_reload(self) -> None:
        signature = self._stat()
        if signature == self._signature or signature is None:
            return
        self._signature = signature
        try:
            self._context = self._load()
        except (OSError, ssl.SSLError) as exc:
            self.log.warning(
                "the new TLS certificate %s does not load (%s); serving with the previous one",
                self.cert_file,
                _reason(exc),
            )
            self._on_reload(False)
            return
        self.log.info("reloaded the TLS certificate %s", self.cert_file)
        self._on_reload(True)

    def _stat(self) -> Optional[Signature]:
        try:
            stats = [os.stat(path) for path in (self.cert_file, self.key_file)]
        except OSError:
            return None  # mid-rotation: look again at the next connection
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
