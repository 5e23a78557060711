"""The S3 client, the start-up access probe, and one-line descriptions of S3 failures.

Credentials, region and CA bundle follow botocore's own chain (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, IRSA / web identity, AWS_DEFAULT_REGION, AWS_CA_BUNDLE); the endpoint
comes from the config (which already fell back to AWS_ENDPOINT_URL* or AWS_S3_ENDPOINT).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import time
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional

from jitckpt_sidecar import __version__, quickack
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import StorageAccessError

log = logging.getLogger("jitckpt.jitckpt-sidecar.s3")

PROBE_ATTEMPTS = 2
"""The start-up probe fails fast: a wrong endpoint should not take a minute to report."""
PROBE_PATIENCE = 60.0
"""Seconds of transient failures (5xx, throttling, resets, timeouts) the probe rides out."""
ASK_ATTEMPTS, ASK_READ_TIMEOUT = 2, 10.0
"""The pruner's questions (does S3 hold this checkpoint?): small reads, asked again at its next
pass, where no answer means no; an S3 that stopped answering must not hold the pruner for
minutes (the transfer client waits 120 s per read, `cfg.s3_max_attempts` times)."""
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
}
_PERMISSION = {
    "ListObjectsV2": "s3:ListBucket",
    "PutObject": "s3:PutObject",
    "GetObject": "s3:GetObject",
    "DeleteObject": "s3:DeleteObject",
    "DeleteObjects": "s3:DeleteObject",
    "HeadObject": "s3:GetObject",
    "CreateMultipartUpload": "s3:PutObject",
    "UploadPart": "s3:PutObject",
    "CompleteMultipartUpload": "s3:PutObject",
    "ListMultipartUploads": "s3:ListBucketMultipartUploads",
    "AbortMultipartUpload": "s3:AbortMultipartUpload",
}


CHECKSUM_REFUSALS = (
    "MissingContentLength",
    "XAmzContentSHA256Mismatch",
    "InvalidArgument",
    "NotImplemented",
    "InvalidRequest",
    "BadDigest",
    "InvalidDigest",
)
"""What S3-compatible stores without flexible-checksum support answer to botocore's default
CRC32 checksums: Ceph RGW 16 refuses the aws-chunked, trailer-checksummed bodies botocore
sends over HTTPS with 411 MissingContentLength; older MinIO answers XAmzContentSHA256Mismatch."""
WHEN_REQUIRED = "when_required"
"""botocore's setting for checksums only where an operation requires one (the fallback)."""


def endpoint_of(cfg: Config) -> str:
    """The endpoint in words, for messages (no credentials: any user:password@ is dropped)."""
    if not cfg.s3_endpoint:
        return "AWS S3"
    return re.sub(r"//[^/@]*@", "//", cfg.s3_endpoint)


def new_session() -> Any:
    """A botocore session: the credential chain and the loaded service models, shared by
    clients. botocore's, not boto3's: its client is botocore's, and boto3's import also loads
    s3transfer, which the one-shot restore does not need."""
    import botocore.session

    return botocore.session.get_session()


def make_client(
    cfg: Config,
    session: Any,
    *,
    attempts: Optional[int] = None,
    pool: int = 10,
    checksums: Optional[str] = None,
    read_timeout: float = 120.0,
) -> Any:
    """A botocore S3 client for `cfg`; each request is tried `attempts` (default
    cfg.s3_max_attempts) times in botocore's standard mode (exponential backoff with full
    jitter, capped at 20 s, on throttling, 5xx and connection errors), each read waiting
    `read_timeout` seconds. `checksums` (WHEN_REQUIRED) overrides botocore's flexible-checksum
    settings for this client."""
    from botocore.config import Config as BotoConfig

    quickack.install()
    addressing = cfg.s3_addressing
    if addressing == "auto":
        # MinIO, Ceph RGW and ODF endpoints rarely have wildcard DNS for virtual-host buckets.
        addressing = "path" if cfg.s3_endpoint else "auto"
    # botocore's flexible checksums stay at boto3's default (CRC32 on every upload request, so
    # S3 rejects bytes damaged in transit; measured faster on moto too, which otherwise builds a
    # full-object checksum itself). Stores that refuse them are found by the start-up probe,
    # which then asks for clients with checksums only where required (`checksums`).
    extra: dict[str, Any] = {}
    if checksums:
        extra = {
            "request_checksum_calculation": checksums,
            "response_checksum_validation": checksums,
        }
    s3_settings: dict[str, Any] = {"addressing_style": addressing}
    setting = checksums or os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION", "")
    if setting.lower() == WHEN_REQUIRED and not (cfg.s3_endpoint or "").startswith("http:"):
        # Without a checksum header botocore SHA-256-signs every upload body, even over TLS
        # (measured: 40 % of an upload's CPU on RGW). TLS guards the bytes in transit and the
        # restore verifies every file's xxh128 checksum, so the payload goes unsigned, as it
        # does over TLS with boto3's default checksums.
        s3_settings["payload_signing_enabled"] = False
    boto_cfg = BotoConfig(
        **extra,
        retries={"mode": "standard", "total_max_attempts": attempts or cfg.s3_max_attempts},
        max_pool_connections=max(pool, 10),
        connect_timeout=10,
        read_timeout=read_timeout,
        tcp_keepalive=True,
        s3=s3_settings,
        user_agent_extra=f"jitckpt-sidecar/{__version__}",
    )
    verify: Optional[bool] = None  # None: verify, with AWS_CA_BUNDLE when set
    if not cfg.s3_verify_tls:
        verify = False
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    return session.create_client(
        "s3", endpoint_url=cfg.s3_endpoint or None, verify=verify, config=boto_cfg
    )


def count_retries(client: Any, on_retry: Callable[[], None]) -> None:
    """Call `on_retry` once for every request `client` sends again (a retry by botocore)."""

    def hook(request: Any, **_: Any) -> None:
        # botocore numbers the attempts of one operation in the request context.
        if request.context.get("retries", {}).get("attempt", 1) > 1:
            on_retry()

    client.meta.events.register("request-created.s3", hook)


def probe(
    client: Any,
    cfg: Config,
    *,
    fallback: Optional[Callable[[], Any]] = None,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Optional[str]:
    """Prove that the bucket exists and that we may list, write, read and delete under the
    prefix; raise a one-line StorageAccessError that names the fix otherwise. Transient
    failures are retried for PROBE_PATIENCE seconds: a 5xx burst must not crash-loop the pod.

    When the store refuses botocore's flexible checksums (CHECKSUM_REFUSALS) and `fallback`
    is given, the probe is repeated with `fallback()`, a client that sends checksums only where
    required; if that passes, the refusal's error code is returned (the caller must make every
    client that way), else None."""
    deadline = monotonic() + PROBE_PATIENCE
    delay = 0.5
    refused: Optional[str] = None
    while True:
        try:
            _probe_once(client, cfg, WHEN_REQUIRED if refused else None)
        except StorageAccessError as exc:
            if fallback is not None and refused is None and exc.code in CHECKSUM_REFUSALS:
                refused = exc.code
                client = fallback()
                continue
            if not exc.transient or monotonic() + delay > deadline:
                raise
            log.warning("S3 access probe: %s; retrying in %.1f s", exc, delay)
            sleep(delay)
            delay = min(delay * 2, 8.0)
        else:
            return refused


def _probe_once(client: Any, cfg: Config, checksums: Optional[str]) -> None:
    uri = cfg.uri
    key = uri.key(f".jitckpt-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    body = b"jitckpt sidecar access probe\n"
    with translate(cfg, "ListObjectsV2", str(uri)):
        client.list_objects_v2(Bucket=uri.bucket, Prefix=uri.key(""), MaxKeys=1)
    where = f"s3://{uri.bucket}/{key}"
    with translate(cfg, "PutObject", where, checksums):
        client.put_object(Bucket=uri.bucket, Key=key, Body=body)
    with translate(cfg, "GetObject", where, checksums):
        got = client.get_object(Bucket=uri.bucket, Key=key)["Body"].read()
    with translate(cfg, "DeleteObject", where, checksums):
        client.delete_object(Bucket=uri.bucket, Key=key)
    if got != body:
        raise StorageAccessError(
            f"{where} read back different bytes than were written; "
            f"check the S3 endpoint {endpoint_of(cfg)} (a proxy or gateway rewriting objects?)"
        )


def retention_notes(client: Any, cfg: Config) -> list[str]:
    """One line each when the bucket keeps what is deleted (versioning, Object Lock): then
    JITCKPT_S3_KEEP retention and withdrawn re-saves free no bytes. Best effort: a store or a
    policy that refuses the question gets no line."""
    bucket = cfg.uri.bucket
    notes = []
    try:
        versioning = client.get_bucket_versioning(Bucket=bucket).get("Status")
    except Exception as exc:  # noqa: BLE001 - s3:GetBucketVersioning is not a permission we need
        log.debug("cannot read the versioning of bucket %s: %s", bucket, exc)
        versioning = None
    if versioning in ("Enabled", "Suspended"):
        notes.append(
            f"bucket {bucket!r} has versioning {versioning}: checkpoints that retention deletes "
            "(JITCKPT_S3_KEEP) or a re-save replaces stay stored as noncurrent versions; add a "
            "lifecycle rule that expires them (docs/operations.md, Bucket settings)"
        )
    try:
        lock = client.get_object_lock_configuration(Bucket=bucket)
        locked = lock.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
    except Exception as exc:  # noqa: BLE001 - most buckets have none: the store answers an error
        log.debug("no Object Lock configuration for bucket %s: %s", bucket, exc)
        locked = False
    if locked:
        notes.append(
            f"bucket {bucket!r} has Object Lock: deleted checkpoints stay stored until their "
            "retention period ends, so JITCKPT_S3_KEEP frees no bytes before then"
        )
    return notes


def checksum_note(cfg: Config, refused: str) -> str:
    """The one line that says the probe switched to checksums "when required"."""
    return (
        f"{endpoint_of(cfg)} refuses S3's flexible checksums ({refused}), as Ceph RGW 16 and "
        "older MinIO do: sending checksums only where S3 requires them (as with "
        "AWS_REQUEST_CHECKSUM_CALCULATION=when_required); the sidecar's xxh128 checksums "
        "still verify every file"
    )


@contextlib.contextmanager
def translate(
    cfg: Config, operation: str, where: str, checksums: Optional[str] = None
) -> Iterator[None]:
    """Turn a boto3/botocore failure inside the block into a one-line StorageAccessError."""
    try:
        yield
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        error = StorageAccessError(describe(exc, cfg, operation, where, checksums))
        error.transient = is_transient(exc)
        error.code = error_code(exc)
        raise error from None


_BROKEN_OFF = (
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
)
"""A request or a response body cut short (a reset, a timeout): the next try may go through."""


def is_transient(exc: BaseException) -> bool:
    """A failure that retrying later may cure: 5xx, throttling, a reset or timed-out request.
    A refused connection is not: that is a wrong endpoint, reported at once."""
    if type(exc).__name__ in _BROKEN_OFF:
        return True
    code = error_code(exc)
    return code in _TRANSIENT_CODES or (code.isdigit() and code.startswith("5"))


_STORE_WIDE_CODES = {
    "AccessDenied",
    "403",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "NoSuchBucket",
    "PermanentRedirect",
}
_CONNECTION_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionError")


def is_store_failure(exc: BaseException) -> bool:
    """A failure of the store or of our access to it (down, throttled, credentials or bucket
    refused) rather than of one object: every checkpoint would fail the same way right now."""
    if not is_storage_error(exc):
        return False
    if type(exc).__name__ in _CONNECTION_ERRORS or "Credential" in type(exc).__name__:
        return True
    return is_transient(exc) or error_code(exc) in _STORE_WIDE_CODES


def is_storage_error(exc: BaseException) -> bool:
    """Whether `exc` came from boto3/botocore/s3transfer (a failed S3 interaction)."""
    module = type(exc).__module__ or ""
    return module.split(".")[0] in ("botocore", "boto3", "s3transfer", "urllib3")


def error_code(exc: BaseException) -> str:
    """The S3 error code ('NoSuchKey', 'SlowDown', '404', ...) of a ClientError, else ''."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    code = response.get("Error", {}).get("Code")
    if code:
        return str(code)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(status) if status else ""


def describe(  # noqa: PLR0911 - one return per failure kind reads better than a table of lambdas
    exc: BaseException,
    cfg: Config,
    operation: str,
    where: str,
    checksums: Optional[str] = None,
) -> str:
    """One line that says what failed and what to fix; never a secret. `checksums` is the
    failing client's checksum setting when it overrides the environment's."""
    endpoint = endpoint_of(cfg)
    name = type(exc).__name__
    code = error_code(exc)
    bucket = cfg.uri.bucket
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (
            f"no usable S3 credentials ({name}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(e.g. from a data connection secret) or configure IRSA / web identity"
        )
    if name == "SSLError" or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (
            f"TLS verification of {endpoint} failed; set AWS_CA_BUNDLE to the CA bundle that "
            "signed it (or JITCKPT_S3_VERIFY_TLS=0 to skip verification, insecure)"
        )
    if name == "ConnectionClosedError":
        return f"the S3 endpoint {endpoint} closed the connection during {operation} ({name})"
    if name in ("EndpointConnectionError", "ConnectTimeoutError"):
        return (
            f"cannot connect to the S3 endpoint {endpoint} ({name}); check AWS_ENDPOINT_URL "
            "(or AWS_S3_ENDPOINT / JITCKPT_S3_ENDPOINT) and that the pod may reach it"
        )
    if name == "ReadTimeoutError":
        return f"the S3 endpoint {endpoint} did not answer {operation} in time; check its health"
    if code == "NoSuchBucket" or (code == "404" and operation == "ListObjectsV2"):
        return (
            f"bucket {bucket!r} does not exist at {endpoint}; create it or fix "
            "JITCKPT_STORAGE_URI (or AWS_S3_BUCKET)"
        )
    if code == "InvalidAccessKeyId":
        return (
            f"{endpoint} does not know the access key (InvalidAccessKeyId); check AWS_ACCESS_KEY_ID"
        )
    if code == "SignatureDoesNotMatch":
        return (
            f"{endpoint} rejected the request signature (SignatureDoesNotMatch); "
            "check AWS_SECRET_ACCESS_KEY"
        )
    if code in ("ExpiredToken", "InvalidToken", "TokenRefreshRequired"):
        return f"the S3 session token was refused ({code}); refresh the credentials"
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraint"):
        return (
            f"bucket {bucket!r} is in another region ({code}); set AWS_DEFAULT_REGION to the "
            "bucket's region"
        )
    if code in ("AccessDenied", "403", "AllAccessDisabled"):
        permission = _PERMISSION.get(operation, operation)
        return (
            f"access denied: {operation} on {where} ({code}); grant the credentials "
            f"{permission} there"
        )
    detail = _one_line(str(exc))
    setting = checksums or os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION", "")
    if code in CHECKSUM_REFUSALS and setting.lower() != WHEN_REQUIRED:
        return (
            f"{operation} on {where} at {endpoint} failed ({code}): the store may predate S3's "
            "flexible checksums; set AWS_REQUEST_CHECKSUM_CALCULATION=when_required"
        )
    return f"{operation} on {where} at {endpoint} failed: {detail}"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
