"""The sidecar's settings: one frozen, validated object built from flags and JITCKPT_* env.

The same option machinery as the entrypoint's config (jitckpt_entrypoint.settings), and the
options both read come from there: every option is a flag and a JITCKPT_* variable (a flag
wins), parsed once; a bad value is a one-line `SettingError` that names the flag or variable
and the accepted values, before anything starts. Two settings also fall back to the S3
conventions of the platform: the endpoint to AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (boto3's
own) or AWS_S3_ENDPOINT (OpenShift AI data connections), and an empty storage URI to
`s3://$AWS_S3_BUCKET/jitckpt`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, Optional

from jitckpt_entrypoint import shared_settings as shared
from jitckpt_entrypoint.protocol.layout import S3Uri
from jitckpt_entrypoint.settings import (
    BOOLEAN,
    INTEGER,
    NUMBER,
    OPTIONAL_INTEGER,
    OPTIONAL_QUANTITY,
    QUANTITY,
    TEXT,
    Fallback,
    Kind,
    Option,
    SettingError,
    at_least,
    between,
    one_of,
    resolve,
    rule,
    validate,
)
from jitckpt_entrypoint.shared_settings import parse_s3_uri, redact_userinfo

ADDRESSING_STYLES = ("auto", "path", "virtual")
RESTART_POLICIES = ("Never", "OnFailure", "Always")
DEFAULT_PREFIX = "jitckpt"
"""The prefix under AWS_S3_BUCKET when only a data connection names the bucket."""
MIN_PART = 5 * 1024**2
"""S3's smallest multipart part (the last part excepted)."""
MAX_PART = 5 * 1024**3
_BUCKET_FALLBACK = "AWS_S3_BUCKET"


def _storage_uri_problem(value: str) -> Optional[str]:
    if not value:
        accepted = f"s3://bucket/prefix (or set {_BUCKET_FALLBACK} from a data connection)"
        return f" is invalid; use {accepted}"
    return shared.s3_uri_problem(value)


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


STORAGE_CAPACITY = Option(
    "storage_capacity",
    OPTIONAL_QUANTITY,
    "the emptyDir sizeLimit (e.g. 50Gi); empty = the filesystem size",
    check=at_least(1, "a positive quantity such as 50Gi"),
    default_doc="empty",
    doc="the emptyDir `sizeLimit` (Kubernetes quantity: `50Gi`, `500M`); empty = filesystem size",
)
"""Also inject's --capacity: what inject writes, the sidecar accepts."""
_CHUNK = between(MIN_PART, MAX_PART, "a quantity from 5Mi to 5Gi")


def _node_count(text: str) -> Optional[int]:
    """torchrun's --nnodes: N, or MIN:MAX (elastic: the count is known only when they agree)."""
    low, _, high = text.partition(":")
    return int(low) if not high or int(high) == int(low) else None


NODE_COUNT = Kind(
    _node_count,
    "is not a node count; set N (or MIN:MAX, as torchrun's --nnodes)",
    optional=True,
    format=lambda v: "" if v is None else str(v),
)


def _peers_ok(value: str) -> bool:
    urls = [value.replace("{node}", "0")] if "{node}" in value else value.split(",")
    return not value or all(
        u.strip().startswith(("http://", "https://")) and _endpoint_ok(u.strip()) for u in urls
    )


_CONCURRENCY = between(1, 64, "a number from 1 to 64")

OPTIONS = (
    shared.DIR,
    dataclasses.replace(
        shared.STORAGE_URI,
        help=f"s3://bucket/prefix; empty = s3://${_BUCKET_FALLBACK}/{DEFAULT_PREFIX}",
        check=_storage_uri_problem,
        fallbacks=(Fallback(_BUCKET_FALLBACK, f"s3://{{}}/{DEFAULT_PREFIX}"),),
    ),
    Option(
        "s3_endpoint",
        TEXT,
        "S3 endpoint URL; default AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_S3_ENDPOINT, AWS",
        check=rule(
            lambda url: not url or _endpoint_ok(url),
            "an http:// or https:// URL with a valid host name and port",
        ),
        show=redact_userinfo,  # user:password@ may carry a secret
        # boto3's own variables first, then OpenShift AI data connections.
        fallbacks=tuple(
            Fallback(v) for v in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_S3_ENDPOINT")
        ),
        default_doc="AWS",
        doc="endpoint URL of an S3-compatible store (`http://` or `https://`)",
    ),
    Option(
        "s3_verify_tls",
        BOOLEAN,
        "1 = verify the endpoint's TLS certificate (CA from AWS_CA_BUNDLE), 0 = insecure",
        doc="verify the endpoint's certificate (CA from `AWS_CA_BUNDLE`); `0` is logged as a "
        "warning",
    ),
    Option(
        "s3_addressing",
        TEXT,
        "auto|path|virtual; auto = path-style for a custom endpoint",
        check=one_of(ADDRESSING_STYLES),
        doc="`auto`, `path` or `virtual`; `auto` = path-style with a custom endpoint",
    ),
    Option(
        "s3_max_attempts",
        INTEGER,
        "tries per S3 request (backoff with jitter); default AWS_MAX_ATTEMPTS, else 8",
        check=between(1, 50, "a number from 1 to 50"),
        fallbacks=(Fallback("AWS_MAX_ATTEMPTS"),),
        doc="tries per S3 request (1–50; exponential backoff with jitter)",
    ),
    Option(
        "s3_keep",
        INTEGER,
        "newest committed checkpoints to keep in S3; 0 = keep all",
        check=at_least(0, "a whole number >= 0 (0 keeps every checkpoint)"),
        doc="committed checkpoints of the run's lineage kept in S3, its highest steps (another "
        "lineage's on the prefix are left alone); `0` keeps all",
    ),
    Option(
        "metrics_port",
        INTEGER,
        "port of /metrics, /readyz and /healthz; 0 = any free port",
        check=between(0, 65535, "a TCP port from 0 to 65535"),
        doc="port of `/metrics`, `/readyz`, `/healthz`; `0` = any free port",
    ),
    Option(
        "metrics_host",
        TEXT,
        "address to listen on",
        check=rule(bool, "an address such as 0.0.0.0, :: or 127.0.0.1"),
    ),
    STORAGE_CAPACITY,
    Option(
        "disk_pressure_threshold",
        NUMBER,
        "used/capacity above which uploaded local checkpoints are deleted",
        check=rule(lambda ratio: 0 < ratio <= 1, "a ratio in (0, 1]"),
        doc="used/capacity at which uploaded local checkpoints are deleted; in (0, 1]",
    ),
    shared.GRACE_SECONDS,
    shared.MEMORY_DIR,
    Option(
        "rescan_seconds",
        NUMBER,
        "interval of the full rescan of staging/ and status/",
        check=between(0.1, 3600, "seconds from 0.1 to 3600"),
        doc="full rescan of `staging/` and `status/` (inotify is the fast path); 0.1–3600",
    ),
    Option(
        "restore_retry_seconds",
        NUMBER,
        "wait after a failed start-up restore, doubling to 300 s",
        check=between(0.1, 300, "seconds from 0.1 to 300"),
        doc="the wait after the first failed start-up restore (the sidecar stays up, not "
        "ready); it doubles after each failure, to at most 300 s",
    ),
    Option(
        "upload_concurrency",
        INTEGER,
        "parallel S3 requests of one upload",
        check=_CONCURRENCY,
        doc="parallel S3 requests of one upload (1–64)",
    ),
    Option(
        "download_concurrency",
        INTEGER,
        "parallel S3 requests of a restore",
        check=_CONCURRENCY,
        doc="parallel S3 requests of a restore (1–64); raise on big nodes with fast networks",
    ),
    Option(
        "multipart_chunk",
        QUANTITY,
        "upload part size (e.g. 16Mi; 5Mi to 5Gi)",
        check=_CHUNK,
        doc="upload part size (5Mi–5Gi)",
    ),
    Option(
        "download_chunk",
        QUANTITY,
        "ranged-GET size of a restore (e.g. 512Mi; 5Mi to 5Gi)",
        check=_CHUNK,
        doc="ranged-GET size of a restore: a larger file is fetched in parallel ranges (5Mi–5Gi)",
    ),
    Option(
        "node_rank",
        OPTIONAL_INTEGER,
        "this pod's node rank in the job; empty = PET_NODE_RANK, JOB_COMPLETION_INDEX, unknown",
        check=at_least(0, "a node rank >= 0"),
        fallbacks=(Fallback("PET_NODE_RANK"), Fallback("JOB_COMPLETION_INDEX")),
        default_doc="unknown",
        doc="this pod's node rank (torchrun's `--node-rank`); with `JITCKPT_NNODES`, the "
        "long-running sidecar restores a sharded checkpoint of that node count in part: this "
        "node's shards and the files every node reads (the rest on the trainer's request)",
    ),
    Option(
        "nnodes",
        NODE_COUNT,
        "the job's node count (torchrun's --nnodes); empty = PET_NNODES, unknown",
        check=at_least(1, "a node count >= 1"),
        fallbacks=(Fallback("PET_NNODES"),),
        default_doc="unknown",
        doc="the job's node count (torchrun's `--nnodes`; `MIN:MAX` counts as unknown); "
        "unknown means every node restores every file",
    ),
    Option(
        "peers",
        TEXT,
        "every node's sidecar URL: one with {node} (its rank), or one per node, comma-separated; "
        "empty = no peer replica",
        check=rule(_peers_ok, "http(s)://host:port URLs, one with {node} or one per node"),
        doc="every node's sidecar (`http://<job>-{node}.<service>:9402`: `{node}` is the node "
        "rank; or one URL per node, comma-separated): the peer replica, where each node's "
        "sidecar keeps the newest snapshot in RAM of the node before it, and a replacement pod "
        "restores its own from it (needs `JITCKPT_MEMORY_DIR`, `JITCKPT_PEER_TOKEN`, the node "
        "rank and count; docs/how-it-works.md)",
    ),
    Option(
        "peer_token",
        TEXT,
        "the token every sidecar of the job presents to its peers (from a Secret)",
        show=lambda _: "***",
        doc="the token the job's sidecars present to each other (a Secret's key: set the "
        "variable, a flag shows in the process list); required with `JITCKPT_PEERS`, never "
        "logged",
    ),
    Option(
        "notice_taints",
        TEXT,
        "node taints that give notice before SIGTERM (comma-separated; empty = none)",
        doc="taints on this pod's node that give notice before SIGTERM, comma-separated (a "
        "cordon counts as `node.kubernetes.io/unschedulable`): the sidecar asks the trainer "
        'for a save now (docs/how-it-works.md, "A save asked for now"); empty: no node watch',
        default_doc="drain/cordon, Karpenter, cluster autoscaler, AWS NTH, GKE (see docs)",
    ),
    Option(
        "notice_conditions",
        TEXT,
        "pod conditions that give notice before SIGTERM (comma-separated; empty = none)",
        doc="conditions of this pod that give notice before SIGTERM when True, comma-separated; "
        "empty: no pod watch",
    ),
    Option(
        "node_name",
        TEXT,
        "this pod's node (the downward API's spec.nodeName); empty = NODE_NAME",
        fallbacks=(Fallback("NODE_NAME"),),
        doc="this pod's node, for the notice watch (downward API `spec.nodeName`; inject, "
        "the webhook and `k8s/` set it)",
    ),
    Option(
        "pod_name",
        TEXT,
        "this pod's name (the downward API's metadata.name); empty = POD_NAME",
        fallbacks=(Fallback("POD_NAME"),),
        doc="this pod's name, for the notice watch (downward API `metadata.name`)",
    ),
    Option(
        "pod_namespace",
        TEXT,
        "this pod's namespace; empty = POD_NAMESPACE, else the service account's",
        fallbacks=(Fallback("POD_NAMESPACE"),),
        default_doc="the service account's",
        doc="this pod's namespace, for the notice watch",
    ),
    Option(
        "kube_credentials",
        TEXT,
        "directory of the service account's token and ca.crt",
        doc="the service account's token and `ca.crt` for the Kubernetes API (the notice watch)",
    ),
    Option(
        "exit_with_trainer",
        BOOLEAN,
        "1 = exit once the trainer has ended for good and everything is uploaded",
        doc="exit once the trainer has ended for good (`JITCKPT_RESTART_POLICY`) and everything "
        "is uploaded: a sidecar that is not native",
    ),
    Option(
        "restart_policy",
        TEXT,
        "Never|OnFailure|Always: the pod's restartPolicy (with --exit-with-trainer); "
        "empty = unknown",
        check=one_of(("", *RESTART_POLICIES), "Never, OnFailure or Always (empty: unknown)"),
        default_doc="unknown",
        doc="the pod's `restartPolicy`: with `JITCKPT_EXIT_WITH_TRAINER=1`, which ends of the "
        "trainer are final (`Never`: any exit, and its container killed whole; `OnFailure`: "
        "exit 0; `Always`: none; unknown: any exit); inject sets it",
    ),
    shared.LOG_FORMAT,
    dataclasses.replace(
        shared.TERMINATION_LOG,
        help="where the one-line reason of a failure goes (the container's termination message); "
        "empty = nowhere",
    ),
)
OPTION_BY_FIELD = {o.field: o for o in OPTIONS}


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
    memory_dir: str = ""
    """The trainer's JITCKPT_MEMORY_DIR, mounted here too: a snapshot the trainer's container
    left when it died whole is written out from it (ram_rescue.py)."""
    rescan_seconds: float = 30.0
    """Full rescan interval; inotify events are the fast path, the rescan catches misses."""
    restore_retry_seconds: float = 10.0
    """The wait after the first failed start-up restore; doubles after each, to 300 s."""
    upload_concurrency: int = 8
    """Parallel S3 requests (parts and whole files) of one checkpoint upload (measured: see
    bench/bench_s3.py; 4 to 16 are within noise of each other, 8 leaves CPU for the rest)."""
    download_concurrency: int = 8
    """Parallel S3 requests of a restore. Measured on a 2-core node, 1 GiB in 13 files, Ceph
    RGW: 8 requests of 64-256 MiB in 2.2 s, 4 of 512 MiB in 2.6 s, 12 or 16 no faster than 8
    (docs/benchmarks.md); raise it on big nodes with fast networks."""
    multipart_chunk: int = 16 * 1024**2
    """Upload part size; files above it go multipart. Measured fastest of 8 to 256 MiB; 16 MiB
    keeps a 5 GB shard at ~300 parts (s3transfer raises it past S3's 10,000-part limit)."""
    download_chunk: int = 256 * 1024**2
    """Ranged-GET size of a restore; a file above it is fetched in parallel ranges. Measured on
    1 GiB in 13 files (shards of 286 to 429 MB) with 8 requests: on Ceph RGW 64, 128 and 256 MiB
    ranges restore within noise of each other; on moto, which reads the whole object for every
    range, 256 MiB takes 0.65x the time of 128 and 0.45x that of 64."""
    node_rank: Optional[int] = None
    """This pod's node rank in the job (torchrun's static --node-rank); None = unknown."""
    nnodes: Optional[int] = None
    """The job's node count; None = unknown. With both known and equal to a checkpoint's own
    node count, the restore fetches only what this node's ranks load (validity.node_files)."""
    notice_taints: str = (
        "node.kubernetes.io/unschedulable,karpenter.sh/disrupted,karpenter.sh/disruption,"
        "ToBeDeletedByClusterAutoscaler,aws-node-termination-handler/spot-itn,"
        "aws-node-termination-handler/asg-lifecycle-termination,"
        "aws-node-termination-handler/scheduled-maintenance,"
        "cloud.google.com/impending-node-termination"
    )
    """Node taints that give notice before SIGTERM (notice.py): a drain's cordon, Karpenter's
    disruption (v1 and v0.3x), the cluster autoscaler's scale-down, AWS NTH's spot interruption,
    ASG termination and scheduled maintenance, GKE's spot preemption."""
    notice_conditions: str = "DisruptionTarget"
    """Pod conditions that give notice before SIGTERM when True."""
    node_name: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    kube_credentials: str = "/var/run/secrets/kubernetes.io/serviceaccount"
    peers: str = ""
    """Every node's sidecar URL (a template with {node}, or one per node): the peer replica
    (peer.py); empty = off."""
    peer_token: str = ""
    """The bearer token of the peer replica's requests."""
    exit_with_trainer: bool = False
    """Exit once the trainer has ended for good and the queue is empty (plain-container
    variant: no SIGTERM comes when the trainer container ends)."""
    restart_policy: str = ""
    """The pod's restartPolicy, which tells the plain-container variant whether the trainer's
    end is final: under Never any exit, and a container killed whole (ram_rescue.py), is; under
    OnFailure only an exit 0 is (the kubelet restarts the rest in place); under Always none.
    Empty (unknown, as before the setting): any exit, and a container killed whole is not
    looked for before SIGTERM (the kubelet may restart it in place)."""
    log_format: str = "text"
    """text or json log lines on stderr."""
    termination_log: str = "/dev/termination-log"
    """Where the one-line reason of a failure (a restore that failed, S3 refused) is written,
    which Kubernetes shows as the container's termination message; the default path only when
    it exists."""

    def __post_init__(self) -> None:
        validate(self, OPTIONS)
        problem = self.peer_problem()
        if problem:
            raise SettingError("JITCKPT_PEERS=", f"{self.peers!r}{problem}", "peers")

    def peer_problem(self) -> str:
        """What the peer replica lacks, as the rest of a one-line error ("" when it is off or
        has what it needs)."""
        if not self.peers:
            return ""
        if not self.peer_token:
            return " needs JITCKPT_PEER_TOKEN (a Secret's key shared by the job's sidecars)"
        if not self.memory_dir:
            return " needs JITCKPT_MEMORY_DIR (the snapshots in RAM it replicates)"
        if self.node_rank is None or self.nnodes is None or self.nnodes < 2:
            return (
                " needs the node rank and a node count of 2 or more (JITCKPT_NODE_RANK, "
                "JITCKPT_NNODES)"
            )
        if "{node}" not in self.peers and len(self.peers.split(",")) != self.nnodes:
            given = len(self.peers.split(","))
            return (
                f" names {given} URLs for {self.nnodes} nodes; give one per node or one with "
                "{node}"
            )
        return ""

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
    def from_env(cls, env: Mapping[str, str], flags: Optional[Mapping[str, Any]] = None) -> Config:
        """Build from flags (by field name) over JITCKPT_* env over platform fallbacks."""
        return resolve(cls, OPTIONS, env, flags)
