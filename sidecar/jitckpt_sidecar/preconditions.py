"""Conditional writes: an upload's PUT of a key that was free succeeds only if it still is.

A step saved again (a restart resumed below it) is uploaded over the keys of the earlier save.
An old pod's sidecar still uploading that earlier save must not write over the newer save's
objects once they are there: each of its PUTs (and multipart completions) of a key it found
free carries `If-None-Match: *`, and S3 refuses it with 412 when another writer got there
first. s3transfer passes no such argument, so a botocore handler adds it to the request's
parameters, for the keys an upload has registered.

Only `If-None-Match: *`: Ceph RGW 16 compares `If-Match` with the ETag unquoted, so the quoted
ETag that S3 lists (and AWS expects) never matches there. A key that was taken is written
without a condition, after the uploader read which save wrote it (uploader.py). Stores that
ignore the header (Ceph RGW 16 on multipart completions) only lose this guard; the restore
still verifies every file's checksum against its manifest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Optional

from jitckpt_sidecar.s3 import error_code

_ATTRIBUTE = "_jitckpt_preconditions"
_OPERATIONS = ("PutObject", "CompleteMultipartUpload")
REFUSED = ("PreconditionFailed", "412", "ConditionalRequestConflict")
"""Error codes of a write refused by its precondition (409 for a concurrent multipart one)."""
UNSUPPORTED = ("NotImplemented", "501", "InvalidArgument", "InvalidRequest", "400")
"""Error codes of a store that does not take the header at all: the writes go without it."""


FREE = {"IfNoneMatch": "*"}
"""The precondition of a write to a key that was free: it still is."""


def refused(exc: BaseException) -> bool:
    """Whether `exc` is S3 refusing a write for its precondition."""
    return error_code(exc) in REFUSED


def unsupported(exc: BaseException) -> bool:
    """Whether `exc` may be a store refusing the header itself (not the write's condition)."""
    return error_code(exc) in UNSUPPORTED


class Preconditions:
    """The preconditions of the writes in progress through one client, by (bucket, key)."""

    def __init__(self, enabled: bool = True) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str], dict[str, str]] = {}
        self.enabled = enabled
        """False once the store refused the header (or the client's botocore lacks it)."""
        self._applied = 0

    def applied(self) -> int:
        """How many writes carried a precondition so far."""
        with self._lock:
            return self._applied

    def disable(self) -> bool:
        """Send no precondition from now on; True the first time."""
        with self._lock:
            was, self.enabled = self.enabled, False
            return was

    @contextlib.contextmanager
    def scope(self, bucket: str) -> Iterator[Scope]:
        """Preconditions set through the scope hold until the block ends."""
        scope = Scope(self, bucket)
        try:
            yield scope
        finally:
            with self._lock:
                for key in scope.keys:
                    self._by_key.pop(key, None)

    def _set(self, key: tuple[str, str], cond: dict[str, str]) -> None:
        with self._lock:
            self._by_key[key] = cond

    def _add(self, params: dict[str, Any], **_: Any) -> None:
        with self._lock:
            if not self.enabled:
                return
            cond = self._by_key.get((params.get("Bucket", ""), params.get("Key", "")))
            if cond:
                self._applied += 1
        if cond:
            params.update(cond)


class Scope:
    """The keys one upload set preconditions on."""

    def __init__(self, owner: Preconditions, bucket: str) -> None:
        self._owner, self._bucket = owner, bucket
        self.keys: list[tuple[str, str]] = []

    def require(self, key: str, cond: dict[str, str]) -> None:
        """A PUT or multipart completion of `key` carries `cond` from now on."""
        self.keys.append((self._bucket, key))
        self._owner._set((self._bucket, key), cond)


def of(client: Any) -> Preconditions:
    """The client's Preconditions, its handler registered on first use (one per client, so
    every Uploader over it shares them)."""
    found: Optional[Preconditions] = getattr(client, _ATTRIBUTE, None)
    if found is None:
        # A botocore older than S3's conditional writes would refuse the parameter outright.
        model = client.meta.service_model
        known = all(
            "IfNoneMatch" in model.operation_model(op).input_shape.members for op in _OPERATIONS
        )
        found = Preconditions(enabled=known)
        for op in _OPERATIONS:
            client.meta.events.register(f"before-parameter-build.s3.{op}", found._add)
        setattr(client, _ATTRIBUTE, found)
    return found
