"""The one exception type of the sidecar package, caught at the CLI edge.

Its message is one line that names the thing to fix and never carries a secret; `exit_code`
says how the process ends (2: configuration, 3: S3 access, 1: anything else).
"""

from __future__ import annotations

from jitckpt_entrypoint.errors import JitckptError


class SidecarError(JitckptError):
    """A problem the user can fix; one line, no secrets."""

    exit_code = 1


class ConfigError(SidecarError):
    """A setting outside its accepted values; reported before anything starts."""

    exit_code = 2


class StorageAccessError(SidecarError):
    """S3 is unreachable, the bucket is missing or the credentials are refused."""

    exit_code = 3
    transient = False
    """Set when retrying may cure it (5xx, throttling, a reset): the probe retries those."""
    code = ""
    """The S3 error code behind it ('AccessDenied', 'MissingContentLength', ...), if any."""


class InjectError(SidecarError):
    """`inject` cannot rewrite its input safely; the message names the object. Nothing is
    written."""
