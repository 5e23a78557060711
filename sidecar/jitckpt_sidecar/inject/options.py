"""inject's flags: what it adds, checked as the sidecar and the entrypoint check the same values.

A value inject writes into a pod is one the containers accept: --capacity goes through the
sidecar's own quantity parser and check (JITCKPT_STORAGE_CAPACITY), --grace-seconds and
--exit-code through the entrypoint's; the defaults it does not choose itself (the volume path,
the JIT exit code) are the components' own.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jitckpt_entrypoint import config as trainer
from jitckpt_entrypoint import shared_settings as shared
from jitckpt_entrypoint.settings import (
    INTEGER,
    OPTIONAL_TEXT,
    QUANTITY_TEXT,
    TEXT,
    Option,
    SettingError,
    default_of,
    one_of,
    parse_quantity,
    rule,
    validate,
)
from jitckpt_sidecar import __version__
from jitckpt_sidecar import config as sidecar

DEFAULT_IMAGE = f"jitckpt-sidecar:{__version__}"
DEFAULT_CAPACITY = "50Gi"
DEFAULT_GRACE_SECONDS = 120
"""Longer than the components' 30 s: a pod without its own value gets time to save and upload."""
DEFAULT_TRAINJOB_RUNTIME = "TrainingRuntime/torch-distributed-jitckpt"
SIDECAR_MODES = ("native", "container")
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")


def _capacity_problem(text: str) -> Optional[str]:
    """The sidecar's check of JITCKPT_STORAGE_CAPACITY, on the quantity as written."""
    check = sidecar.STORAGE_CAPACITY.check
    return check(parse_quantity(text)) if check else None


def _runtime_ok(value: str) -> bool:
    kind, _, name = value.partition("/")
    return kind in RUNTIME_KINDS and bool(name)


OPTIONS = (
    Option(
        "storage_uri",
        TEXT,
        "where this job's checkpoints go (JITCKPT_STORAGE_URI)",
        check=shared.s3_uri_problem,  # required here: an empty one would stop the sidecar
        show=shared.STORAGE_URI.show,
        flag_only=True,
        required=True,
        metavar="s3://BUCKET/PREFIX",
    ),
    Option("image", TEXT, "sidecar image", flag_only=True, metavar="IMAGE"),
    Option(
        "secret",
        OPTIONAL_TEXT,
        "Secret with S3 credentials for envFrom (a data connection works as is)",
        flag_only=True,
        metavar="NAME",
    ),
    Option(
        "capacity",
        QUANTITY_TEXT,
        "emptyDir sizeLimit = JITCKPT_STORAGE_CAPACITY",
        check=_capacity_problem,
        flag_only=True,
        metavar="CAPACITY",
    ),
    Option(
        "memory",
        dataclasses.replace(QUANTITY_TEXT, optional=True),
        "a memory-backed emptyDir of this size for snapshots in RAM (JITCKPT_MEMORY_DIR); "
        "about two snapshots of a node's model and optimizer state (four with --peers)",
        check=rule(lambda v: parse_quantity(v) > 0, "a positive quantity, e.g. 24Gi"),
        flag_only=True,
        metavar="SIZE",
    ),
    Option(
        "peers",
        OPTIONAL_TEXT,
        "the peer replica: every node's sidecar URL (JITCKPT_PEERS: one with {node}, its node "
        "rank, or one per node); needs --memory and --peer-secret",
        check=sidecar.OPTION_BY_FIELD["peers"].check,
        flag_only=True,
        metavar="URLS",
    ),
    Option(
        "peer_secret",
        OPTIONAL_TEXT,
        "Secret whose key `token` the job's sidecars present to each other (JITCKPT_PEER_TOKEN)",
        flag_only=True,
        metavar="NAME",
    ),
    Option(
        "grace_seconds",
        INTEGER,
        "terminationGracePeriodSeconds where a pod sets none",
        check=shared.GRACE_SECONDS.check,
        flag_only=True,
        metavar="GRACE_SECONDS",
    ),
    Option(
        "exit_code",
        INTEGER,
        "JIT exit code the podFailurePolicy ignores",
        check=trainer.OPTION_BY_FIELD["exit_code"].check,
        flag_only=True,
        metavar="EXIT_CODE",
    ),
    Option(
        "containers",
        TEXT,
        "training container (repeatable); default: the only one",
        flag="--container",
        flag_only=True,
        repeat=True,
        metavar="NAME",
    ),
    Option(
        "sidecar_mode",
        TEXT,
        "native sidecar (Kubernetes >= 1.29) or restore init container + regular sidecar container",
        check=one_of(SIDECAR_MODES, "native or container"),
        choices=SIDECAR_MODES,
        flag_only=True,
        metavar="{native,container}",
    ),
    Option(
        "python",
        TEXT,
        "python3 in the training image that runs the launcher",
        check=rule(lambda v: v and not any(c.isspace() for c in v), "a name or path, no spaces"),
        flag_only=True,
        metavar="PYTHON",
    ),
    Option(
        "trainjob_runtime",
        TEXT,
        "jitckpt runtime for TrainJobs",
        check=rule(_runtime_ok, "TrainingRuntime/NAME or ClusterTrainingRuntime/NAME"),
        flag_only=True,
        metavar="KIND/NAME",
    ),
)


@dataclasses.dataclass(frozen=True)
class Options:
    """What inject adds; every field has a flag (see OPTIONS)."""

    storage_uri: str
    """s3://bucket/prefix for this job's checkpoints (JITCKPT_STORAGE_URI on both sides)."""
    image: str = DEFAULT_IMAGE
    """The sidecar image: runs `install`, the sidecar and (container mode) `restore`."""
    secret: Optional[str] = None
    """Secret with the S3 credentials, used via envFrom (an OpenShift AI data connection works)."""
    capacity: str = DEFAULT_CAPACITY
    """sizeLimit of the shared emptyDir, and JITCKPT_STORAGE_CAPACITY."""
    memory: Optional[str] = None
    """sizeLimit of a memory-backed emptyDir for snapshots in RAM; None: no RAM tier."""
    peers: Optional[str] = None
    """JITCKPT_PEERS for the sidecar (the peer replica); None: none."""
    peer_secret: Optional[str] = None
    """The Secret whose key `token` is JITCKPT_PEER_TOKEN."""
    grace_seconds: int = DEFAULT_GRACE_SECONDS
    """terminationGracePeriodSeconds for pods that have none; a pod's own value is kept."""
    exit_code: int = default_of(trainer.Config, "exit_code")
    """The JIT exit code that the Job's podFailurePolicy ignores."""
    containers: tuple[str, ...] = ()
    """Names of the training containers; empty means a pod's only container."""
    sidecar_mode: str = "native"
    """native (init container with restartPolicy Always) or container (plain init + container)."""
    python: str = "python3"
    """The interpreter in the training image that runs the launcher."""
    trainjob_runtime: str = DEFAULT_TRAINJOB_RUNTIME
    """KIND/NAME of the jitckpt-enabled Kubeflow Trainer runtime a TrainJob is pointed at."""

    def __post_init__(self) -> None:
        validate(self, OPTIONS)
        if self.peers and not (self.memory and self.peer_secret):
            lacks = (
                "--memory (the snapshots it replicates)"
                if not self.memory
                else ("--peer-secret (a Secret with the key `token`, shared by the job's sidecars)")
            )
            raise SettingError("--peers=", f"{self.peers!r} needs {lacks}", "peers")
        if self.peer_secret and not self.peers:
            raise SettingError(
                "--peer-secret=", f"{self.peer_secret!r} needs --peers (the peer replica)",
                "peer_secret",
            )  # fmt: skip

    @property
    def native(self) -> bool:
        return self.sidecar_mode == "native"

    @property
    def runtime(self) -> tuple[str, str]:
        """(kind, name) of trainjob_runtime."""
        kind, _, name = self.trainjob_runtime.partition("/")
        return kind, name
