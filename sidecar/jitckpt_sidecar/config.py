"""The sidecar's settings: one frozen, validated object built from flags and JITCKPT_* env.

Same pattern as the entrypoint's config: every option is a flag and a JITCKPT_* variable (a
flag wins), parsed once; a bad value is a one-line `ConfigError` that names the flag or
variable and the accepted values, before anything starts. Two settings also fall back to the
S3 conventions of the platform: the endpoint to AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (boto3's
own) or AWS_S3_ENDPOINT (OpenShift AI data connections), and an empty storage URI to
`s3://$AWS_S3_BUCKET/jitckpt`.
"""

from __future__ import annotations

import dataclasses
import decimal
import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Callable, Optional

from jitckpt_entrypoint.config import Option, parse_s3_uri, redact_userinfo
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol.layout import S3Uri
from jitckpt_sidecar.errors import ConfigError

LOG_FORMATS = ("text", "json")
ADDRESSING_STYLES = ("auto", "path", "virtual")
DEFAULT_PREFIX = "jitckpt"
"""The prefix under AWS_S3_BUCKET when only a data connection names the bucket."""
MIN_PART = 5 * 1024**2
"""S3's smallest multipart part (the last part excepted)."""
MAX_PART = 5 * 1024**3
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BUCKET_FALLBACK = "AWS_S3_BUCKET"
_FALLBACKS = {
    # boto3's own variables first, then OpenShift AI data connections.
    "s3_endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_S3_ENDPOINT"),
    "s3_max_attempts": ("AWS_MAX_ATTEMPTS",),
}
_FALLBACK_FIELDS = ("storage_uri", *_FALLBACKS)

OPTIONS = (
    Option("dir", "JITCKPT_DIR", "--dir", "shared volume root (the emptyDir)"),
    Option(
        "storage_uri",
        "JITCKPT_STORAGE_URI",
        "--storage-uri",
        f"s3://bucket/prefix; empty = s3://$AWS_S3_BUCKET/{DEFAULT_PREFIX}",
    ),
    Option(
        "s3_endpoint",
        "JITCKPT_S3_ENDPOINT",
        "--s3-endpoint",
        "S3 endpoint URL; default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_S3_ENDPOINT, AWS",
    ),
    Option(
        "s3_verify_tls",
        "JITCKPT_S3_VERIFY_TLS",
        "--s3-verify-tls",
        "1 = verify the endpoint's TLS certificate (CA from AWS_CA_BUNDLE), 0 = insecure",
    ),
    Option(
        "s3_addressing",
        "JITCKPT_S3_ADDRESSING",
        "--s3-addressing",
        "auto|path|virtual; auto = path-style for a custom endpoint",
    ),
    Option(
        "s3_max_attempts",
        "JITCKPT_S3_MAX_ATTEMPTS",
        "--s3-max-attempts",
        "tries per S3 request (backoff with jitter); default AWS_MAX_ATTEMPTS, else 8",
    ),
    Option(
        "s3_keep",
        "JITCKPT_S3_KEEP",
        "--s3-keep",
        "newest committed checkpoints to keep in S3; 0 = keep all",
    ),
    Option(
        "metrics_port",
        "JITCKPT_METRICS_PORT",
        "--metrics-port",
        "port of /metrics, /readyz and /healthz; 0 = any free port",
    ),
    Option("metrics_host", "JITCKPT_METRICS_HOST", "--metrics-host", "address to listen on"),
    Option(
        "storage_capacity",
        "JITCKPT_STORAGE_CAPACITY",
        "--storage-capacity",
        "the emptyDir sizeLimit (e.g. 50Gi); empty = the filesystem size",
    ),
    Option(
        "disk_pressure_threshold",
        "JITCKPT_DISK_PRESSURE_THRESHOLD",
        "--disk-pressure-threshold",
        "used/capacity above which uploaded local checkpoints are deleted",
    ),
    Option(
        "grace_seconds",
        "JITCKPT_GRACE_SECONDS",
        "--grace-seconds",
        "the pod's terminationGracePeriodSeconds",
    ),
    Option(
        "rescan_seconds",
        "JITCKPT_RESCAN_SECONDS",
        "--rescan-seconds",
        "interval of the full rescan of staging/ and status/",
    ),
    Option(
        "upload_concurrency",
        "JITCKPT_UPLOAD_CONCURRENCY",
        "--upload-concurrency",
        "parallel S3 requests of one upload",
    ),
    Option(
        "download_concurrency",
        "JITCKPT_DOWNLOAD_CONCURRENCY",
        "--download-concurrency",
        "parallel S3 requests of a restore",
    ),
    Option(
        "multipart_chunk",
        "JITCKPT_MULTIPART_CHUNK",
        "--multipart-chunk",
        "upload part size (e.g. 16Mi; 5Mi to 5Gi)",
    ),
    Option(
        "download_chunk",
        "JITCKPT_DOWNLOAD_CHUNK",
        "--download-chunk",
        "ranged-GET size of a restore (e.g. 512Mi; 5Mi to 5Gi)",
    ),
    Option(
        "exit_with_trainer",
        "JITCKPT_EXIT_WITH_TRAINER",
        "--exit-with-trainer",
        "1 = exit once the trainer exited and everything is uploaded",
    ),
    Option("log_format", "JITCKPT_LOG_FORMAT", "--log-format", "text|json"),
    Option(
        "termination_log",
        "JITCKPT_TERMINATION_LOG",
        "--termination-log",
        "where the one-line reason of a failure goes (the container's termination message); "
        "empty = nowhere",
    ),
)
OPTION_BY_FIELD = {o.field: o for o in OPTIONS}
BOOL_FIELDS = ("s3_verify_tls", "exit_with_trainer")
QUANTITY_FIELDS = ("storage_capacity", "multipart_chunk", "download_chunk")


@dataclasses.dataclass(frozen=True)
class Config:
    """The sidecar's settings; every field has a flag and a JITCKPT_* twin (see OPTIONS)."""

    dir: str = "/mnt/jitckpt"
    """Root of the volume shared with the trainer: checkpoints/, staging/, status/."""
    storage_uri: str = ""
    """s3://bucket/prefix that checkpoints are restored from and uploaded to (required)."""
    s3_endpoint: str = ""
    """Endpoint URL of an S3-compatible store; empty = AWS (boto3 resolves the region)."""
    s3_verify_tls: bool = True
    """Verify the endpoint's certificate; turning it off is explicit and logged."""
    s3_addressing: str = "auto"
    """Bucket addressing: path-style suits MinIO/Ceph/ODF endpoints without wildcard DNS."""
    s3_max_attempts: int = 8
    """Tries per S3 request during transfers (botocore standard mode: exponential backoff with
    jitter on throttling, 5xx and connection errors); a failed upload is then retried whole."""
    s3_keep: int = 0
    """Newest committed checkpoints kept in S3; older ones are deleted. 0 keeps all."""
    metrics_port: int = 9402
    """Port of /metrics, /readyz (the startupProbe) and /healthz."""
    metrics_host: str = "0.0.0.0"  # noqa: S104 - Prometheus scrapes the pod IP
    """Address the HTTP server listens on."""
    storage_capacity: Optional[int] = None
    """Bytes the shared volume may hold (the emptyDir sizeLimit); None = the filesystem size."""
    disk_pressure_threshold: float = 0.85
    """Used/capacity ratio above which uploaded local checkpoints are deleted, oldest first."""
    grace_seconds: int = 30
    """The pod's terminationGracePeriodSeconds: the drain ends a small margin before it."""
    rescan_seconds: float = 30.0
    """Full rescan interval; inotify events are the fast path, the rescan catches misses."""
    upload_concurrency: int = 8
    """Parallel S3 requests (parts and whole files) of one checkpoint upload (measured: see
    bench/bench_s3.py; 4 to 16 are within noise of each other, 8 leaves CPU for the rest)."""
    download_concurrency: int = 4
    """Parallel S3 requests of a restore. Measured on a 2-core node: 4 was steadier than 8 or
    16 (fewer large responses in flight at once); raise it on big nodes with fast networks."""
    multipart_chunk: int = 16 * 1024**2
    """Upload part size; files above it go multipart. Measured fastest of 8 to 256 MiB; 16 MiB
    keeps a 5 GB shard at ~300 parts (s3transfer raises it past S3's 10,000-part limit)."""
    download_chunk: int = 512 * 1024**2
    """Ranged-GET size of a restore; a file above it is fetched in parallel ranges. Fewer,
    larger GETs cost less per byte on both ends: measured on 1 GiB in 13 files, 512 MiB (one GET
    per file) against 256 MiB ranges: moto ~2x faster (it reads the whole object for each
    range), Ceph RGW the same within noise; a multi-GB shard still goes in parallel ranges."""
    exit_with_trainer: bool = False
    """Exit once the trainer exited and the queue is empty (plain-container variant)."""
    log_format: str = "text"
    """text or json log lines on stderr."""
    termination_log: str = "/dev/termination-log"
    """Where the one-line reason of a failure (a restore that failed, S3 refused) is written,
    which Kubernetes shows as the container's termination message; the default path only when
    it exists."""

    def __post_init__(self) -> None:
        try:
            parse_s3_uri(self.storage_uri, OPTION_BY_FIELD["storage_uri"].env)
        except JitckptError as exc:
            accepted = (
                str(exc)
                if self.storage_uri
                else (f"s3://bucket/prefix (or set {_BUCKET_FALLBACK} from a data connection)")
            )
            raise InvalidOptionError("storage_uri", self.storage_uri, accepted) from None
        checks: list[tuple[object, str, str]] = [
            (
                os.path.isabs(self.dir),  # a relative one is not the volume shared with the trainer
                "dir",
                "an absolute path to the shared volume, e.g. /mnt/jitckpt",
            ),
            (
                not self.s3_endpoint or _endpoint_ok(self.s3_endpoint),
                "s3_endpoint",
                "an http:// or https:// URL with a valid host name and port",
            ),
            (
                self.s3_addressing in ADDRESSING_STYLES,
                "s3_addressing",
                "one of " + ", ".join(ADDRESSING_STYLES),
            ),
            (1 <= self.s3_max_attempts <= 50, "s3_max_attempts", "a number from 1 to 50"),
            (self.s3_keep >= 0, "s3_keep", "a whole number >= 0 (0 keeps every checkpoint)"),
            (0 <= self.metrics_port <= 65535, "metrics_port", "a TCP port from 0 to 65535"),
            (self.metrics_host, "metrics_host", "an address such as 0.0.0.0, :: or 127.0.0.1"),
            (
                self.storage_capacity is None or self.storage_capacity >= 1,
                "storage_capacity",
                "a positive quantity such as 50Gi",
            ),
            (
                0 < self.disk_pressure_threshold <= 1,
                "disk_pressure_threshold",
                "a ratio in (0, 1]",
            ),
            (self.grace_seconds >= 1, "grace_seconds", "the pod's terminationGracePeriodSeconds"),
            (0.1 <= self.rescan_seconds <= 3600, "rescan_seconds", "seconds from 0.1 to 3600"),
            (1 <= self.upload_concurrency <= 64, "upload_concurrency", "a number from 1 to 64"),
            (
                1 <= self.download_concurrency <= 64,
                "download_concurrency",
                "a number from 1 to 64",
            ),
            (
                MIN_PART <= self.multipart_chunk <= MAX_PART,
                "multipart_chunk",
                "a quantity from 5Mi to 5Gi",
            ),
            (
                MIN_PART <= self.download_chunk <= MAX_PART,
                "download_chunk",
                "a quantity from 5Mi to 5Gi",
            ),
            (self.log_format in LOG_FORMATS, "log_format", "text or json"),
        ]
        for ok, field, accepted in checks:
            if not ok:
                value = getattr(self, field)
                if field == "s3_endpoint":  # user:password@ may carry a secret
                    value = redact_userinfo(value)
                raise InvalidOptionError(field, value, accepted)

    @property
    def uri(self) -> S3Uri:
        return parse_s3_uri(self.storage_uri)

    @property
    def drain_seconds(self) -> float:
        """How long the drain may run after SIGTERM: the grace period minus a small margin.

        The margin (10 %, 2 to 5 s) leaves time to stop, log and exit before the kubelet's
        SIGKILL.
        """
        return max(0.5, self.grace_seconds - min(5.0, max(2.0, self.grace_seconds * 0.1)))

    @classmethod
    def from_env(cls, env: Mapping[str, str], flags: Optional[Mapping[str, str]] = None) -> Config:
        """Build from flags (by field name) over JITCKPT_* env over platform fallbacks."""
        flags = flags or {}
        kwargs: dict[str, object] = {}
        sources: dict[str, str] = {}
        for field in dataclasses.fields(cls):
            option = OPTION_BY_FIELD[field.name]
            if field.name in flags:
                raw, source = flags[field.name], option.flag + " "
            elif option.env in env and (
                env[option.env].strip() or field.name not in _FALLBACK_FIELDS
            ):  # an empty storage URI or endpoint falls back to the platform's variables
                raw, source = env[option.env], option.env + "="
            else:
                fallback = _fallback(field.name, env)
                if fallback is None:
                    continue
                raw, source = fallback
            sources[field.name] = source
            kwargs[field.name] = _convert(field.name, str(field.type), raw.strip(), source)
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except InvalidOptionError as exc:
            raise ConfigError(exc.describe(sources.get(exc.field))) from None


_HOST_LABEL = re.compile(r"^(?!-)[a-z\d-]{1,63}(?<!-)$", re.IGNORECASE)


def _endpoint_ok(url: str) -> bool:
    """Whether botocore accepts `url` as an endpoint: http(s), a DNS name or IP, a valid port."""
    if any(c.isspace() for c in url):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not 0-65535
    except ValueError:
        return False
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.removesuffix(".").split(".")
        return len(host) <= 255 and all(_HOST_LABEL.match(label) for label in labels)
    return True


def _fallback(name: str, env: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """A value from the platform's S3 variables when the JITCKPT_* one is unset or empty."""
    for var in _FALLBACKS.get(name, ()):
        if env.get(var, "").strip():
            return env[var], var + "="
    if name == "storage_uri" and env.get(_BUCKET_FALLBACK, "").strip():
        uri = f"s3://{env[_BUCKET_FALLBACK].strip()}/{DEFAULT_PREFIX}"
        return uri, f"JITCKPT_STORAGE_URI (from {_BUCKET_FALLBACK})="
    return None


def _convert(name: str, kind: str, raw: str, source: str) -> object:
    if name in QUANTITY_FIELDS:
        if raw == "" and kind == "Optional[int]":
            return None
        return _parse(parse_quantity, raw, f"{source}{raw!r} is not a Kubernetes quantity; "
                      "use e.g. 50Gi, 500M or 64Mi")  # fmt: skip
    if kind == "bool":
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise ConfigError(f"{source}{raw!r} is not a boolean; use 1 or 0")
    hint = OPTION_BY_FIELD[name].help
    if kind == "int":
        return _parse(int, raw, f"{source}{raw!r} is not an integer; set {hint}")
    if kind == "float":
        return _parse(float, raw, f"{source}{raw!r} is not a number; set {hint}")
    return raw


def _parse(parser: Callable[[str], object], raw: str, error: str) -> object:
    try:
        return parser(raw)
    except ValueError:
        raise ConfigError(error) from None


_QUANTITY = re.compile(r"^(\+?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|[mkMGTPE])?$")
_SUFFIX = {
    "": decimal.Decimal(1),
    "m": decimal.Decimal("0.001"),
    "k": decimal.Decimal(10) ** 3,
    "M": decimal.Decimal(10) ** 6,
    "G": decimal.Decimal(10) ** 9,
    "T": decimal.Decimal(10) ** 12,
    "P": decimal.Decimal(10) ** 15,
    "E": decimal.Decimal(10) ** 18,
    **{s: decimal.Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi"))},
    "Ei": decimal.Decimal(1024) ** 6,
}


def parse_quantity(value: str) -> int:
    """A Kubernetes quantity ("50Gi", "500M", "1.5G", "12e6") in whole bytes, rounded up."""
    match = _QUANTITY.match(value)
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = decimal.Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        scale = decimal.Decimal(10) ** int(suffix[1:])
    else:
        scale = _SUFFIX[suffix]
    return int((number * scale).to_integral_value(rounding=decimal.ROUND_CEILING))


class InvalidOptionError(ConfigError):
    """A setting outside its accepted values; the message names the variable and the values."""

    def __init__(self, field: str, value: object, accepted: str) -> None:
        self.field, self.value, self.accepted = field, value, accepted
        super().__init__(self.describe(None))

    def describe(self, source: Optional[str]) -> str:
        source = source or OPTION_BY_FIELD[self.field].env + "="
        if self.field == "storage_uri" and self.value:  # parse_s3_uri names the value itself
            return self.accepted.replace(OPTION_BY_FIELD["storage_uri"].env + "=", source, 1)
        return f"{source}{self.value!r} is invalid; use {self.accepted}"
