"""The pieces inject adds to a pod: containers, volumes, environment, failure rules, patches.

Plain functions of the options that return fresh objects (an edit of one never shows up in
another); the names, paths and port are the contract k8s/ and the sidecar share.
"""

from __future__ import annotations

from typing import Any, Optional

from jitckpt_entrypoint import config as trainer
from jitckpt_entrypoint.settings import default_of, format_quantity, parse_quantity
from jitckpt_sidecar import config as sidecar
from jitckpt_sidecar.inject.options import Options

Obj = dict[str, Any]

BUNDLE_DIR = "/jitckpt"
BUNDLE_VOLUME = "jitckpt-bundle"
DATA_DIR: str = default_of(trainer.Config, "dir")
DATA_VOLUME = "jitckpt"
MEMORY_DIR = "/mnt/jitckpt-memory"
MEMORY_VOLUME = "jitckpt-memory"
INSTALL = "jitckpt-install"
SIDECAR = "jitckpt-sidecar"
RESTORE = "jitckpt-restore"
METRICS_PORT: int = default_of(sidecar.Config, "metrics_port")
METRICS_PORT_NAME = "jitckpt-metrics"
LAUNCHER = f"{BUNDLE_DIR}/jitckpt-entrypoint"
TRAINJOB_PATCH_MANAGER = "jitckpt.io/inject"
TRAINER_API = "trainer.kubeflow.org"
SIDECAR_MEMORY = "1Gi"
"""The sidecar's own memory limit; with the peer replica the memory volume's size on top (the
peer's snapshot it keeps there, and its own restored from it, count against it)."""
PEER_TOKEN_KEY = "token"  # noqa: S105 - the Secret's key, not a token
"""The key of --peer-secret's Secret that holds the token."""


def _var(option: str, value: object) -> Obj:
    """An env entry for the sidecar's option `option` (its JITCKPT_* name)."""
    return {"name": sidecar.OPTION_BY_FIELD[option].env, "value": str(value)}


def trainer_env(opts: Options, grace: Optional[int] = None) -> list[tuple[str, str]]:
    """(name, value) the training container gets unless it sets them itself."""
    values: dict[str, object] = {"dir": DATA_DIR, "storage_uri": opts.storage_uri}
    if grace is None:  # a TrainJob: its runtime mounts the volume and sets the grace period
        del values["dir"]
    else:
        values["grace_seconds"] = grace
    values["exit_code"] = opts.exit_code
    if opts.memory and grace is not None:
        values["memory_dir"] = MEMORY_DIR
    return [(trainer.OPTION_BY_FIELD[f].env, str(v)) for f, v in values.items()]


def wrapped(command: list[str], opts: Options) -> list[str]:
    return [opts.python, LAUNCHER, "--", *command]


def security_context(trainer_container: Optional[Obj] = None) -> Obj:
    """Our containers: non-root, no privilege escalation, read-only root, no capabilities.

    The sidecar deletes staged files the trainer wrote, so it runs as the trainer's UID when
    the trainer names one (OpenShift gives every container of a pod the same UID anyway).
    """
    ctx: Obj = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    theirs = (trainer_container or {}).get("securityContext") or {}
    for key in ("runAsUser", "runAsGroup"):
        if isinstance(theirs.get(key), int) and theirs[key] > 0:
            ctx[key] = theirs[key]
    return ctx


DOWNWARD_ENV = [
    {"name": sidecar.OPTION_BY_FIELD[option].env, "valueFrom": {"fieldRef": {"fieldPath": path}}}
    for option, path in (
        ("node_name", "spec.nodeName"),
        ("pod_name", "metadata.name"),
        ("pod_namespace", "metadata.namespace"),
    )
]
"""What the notice watch reads (notice.py), from the downward API."""


def sidecar_env(
    opts: Options, grace: int, *, exit_with_trainer: bool = False, restart_policy: str = ""
) -> list[Obj]:
    env = [
        _var("dir", DATA_DIR),
        _var("storage_uri", opts.storage_uri),
        _var("storage_capacity", opts.capacity),
        _var("grace_seconds", grace),
        _var("metrics_port", METRICS_PORT),
        *DOWNWARD_ENV,
    ]
    if exit_with_trainer:  # no SIGTERM comes when the trainer ends: which ends are final
        env.append(_var("exit_with_trainer", "1"))
        if restart_policy:
            env.append(_var("restart_policy", restart_policy))
    return env


NODE_VARS = {
    "PET_NODE_RANK": "JITCKPT_NODE_RANK",
    "PET_NNODES": "JITCKPT_NNODES",
    "PET_RDZV_BACKEND": "PET_RDZV_BACKEND",
    "JOB_COMPLETION_INDEX": "JOB_COMPLETION_INDEX",
}
"""The trainer's torchrun variables (and an Indexed Job's index, which the Job controller adds to
the pods it creates, before the webhook adds the sidecar) the sidecar reads too, under its own
names: with the node rank and count it restores only what its node's ranks load
(docs/how-it-works.md)."""


def node_env(trainer_container: Obj) -> list[Obj]:
    """The trainer's NODE_VARS (value or valueFrom), for the sidecar."""
    return [
        {**var, "name": NODE_VARS[var["name"]]}
        for var in trainer_container.get("env") or []
        if isinstance(var, dict) and var.get("name") in NODE_VARS
    ]


def install_container(opts: Options, trainer_container: Obj) -> Obj:
    return {
        "name": INSTALL,
        "image": opts.image,
        "command": ["jitckpt-sidecar", "install", BUNDLE_DIR],
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": security_context(trainer_container),
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR}],
    }


def _s3_container(
    opts: Options, trainer_container: Obj, grace: int, head: Obj, probes: Obj, **env: Any
) -> Obj:
    """A container of the sidecar image that talks to S3: `head`, its settings and credentials,
    `probes`, then resources, security context and the data volume, in that order."""
    container = {**head, "env": sidecar_env(opts, grace, **env) + node_env(trainer_container)}
    if opts.secret:
        container["envFrom"] = [{"secretRef": {"name": opts.secret}}]
    container.update(probes)
    container["resources"] = {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": SIDECAR_MEMORY},
    }
    container["securityContext"] = security_context(trainer_container)
    container["volumeMounts"] = [{"name": DATA_VOLUME, "mountPath": DATA_DIR}]
    return container


def sidecar_container(
    opts: Options, trainer_container: Obj, grace: int, restart_policy: str = ""
) -> Obj:
    """The sidecar; `restart_policy` is the pod's (a plain container's sidecar needs it; empty:
    unknown, not set)."""
    head: Obj = {"name": SIDECAR, "image": opts.image}
    probes: Obj = {
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}]
    }
    if opts.native:
        head["restartPolicy"] = "Always"
        # The pod's other containers start only once this passes: /readyz is 200 after the
        # restore. A large checkpoint can take a while to download; allow up to an hour.
        probes["startupProbe"] = {
            "httpGet": {"path": "/readyz", "port": METRICS_PORT_NAME},
            "periodSeconds": 2,
            "failureThreshold": 1800,
        }
    probes["livenessProbe"] = {
        "httpGet": {"path": "/healthz", "port": METRICS_PORT_NAME},
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    env = {} if opts.native else {"exit_with_trainer": True, "restart_policy": restart_policy}
    container = _s3_container(opts, trainer_container, grace, head, probes, **env)
    if opts.memory:  # a snapshot a trainer container killed whole left there: ram_rescue.py
        _memory_volume(container, opts)
    return container


def _memory_volume(container: Obj, opts: Options) -> None:
    """The memory volume in a container of the sidecar image: read-only, or with the peer
    replica read-write (the peer's snapshot kept there, this node's own restored from it),
    with its settings and the volume's size on top of the memory limit."""
    container["env"].append(_var("memory_dir", MEMORY_DIR))
    mount: Obj = {"name": MEMORY_VOLUME, "mountPath": MEMORY_DIR, "readOnly": True}
    if opts.peers and opts.memory:
        del mount["readOnly"]
        container["env"].extend(peer_env(opts))
        container["resources"]["limits"]["memory"] = format_quantity(
            parse_quantity(SIDECAR_MEMORY) + parse_quantity(opts.memory)
        )
    container["volumeMounts"].append(mount)


def peer_env(opts: Options) -> list[Obj]:
    """The peer replica's settings: the URLs, and the token from its Secret."""
    token = {"secretKeyRef": {"name": opts.peer_secret, "key": PEER_TOKEN_KEY}}
    return [
        _var("peers", opts.peers),
        {"name": sidecar.OPTION_BY_FIELD["peer_token"].env, "valueFrom": token},
    ]


def restore_container(opts: Options, trainer_container: Obj, grace: int) -> Obj:
    head = {"name": RESTORE, "image": opts.image, "command": ["jitckpt-sidecar", "restore"]}
    container = _s3_container(opts, trainer_container, grace, head, {})
    if opts.peers:  # a replacement pod's snapshot from its peer, before the trainer starts
        _memory_volume(container, opts)
    return container


def volumes(opts: Options) -> list[Obj]:
    out: list[Obj] = [
        {"name": BUNDLE_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": DATA_VOLUME, "emptyDir": {"sizeLimit": opts.capacity}},
    ]
    if opts.memory:
        out.append(
            {"name": MEMORY_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": opts.memory}}
        )
    return out


def raise_memory_limit(container: Obj, size: str) -> Optional[str]:
    """A memory-backed emptyDir counts against the memory limit of the container that writes
    it: the trainer's limit (when it has one) grows by `size`. Returns the new limit, or None
    when the container has no memory limit."""
    limits = (container.get("resources") or {}).get("limits") or {}
    limit = limits.get("memory")
    if limit is None:
        return None
    raised = format_quantity(parse_quantity(str(limit)) + parse_quantity(size))
    container.setdefault("resources", {}).setdefault("limits", {})["memory"] = raised
    requests = container["resources"].get("requests") or {}
    if "memory" in requests:  # the scheduler counts the volume too (and Guaranteed stays so)
        requests["memory"] = format_quantity(
            parse_quantity(str(requests["memory"])) + parse_quantity(size)
        )
    return raised


def failure_rules(trainers: list[str], exit_code: int) -> list[Obj]:
    """Preemption, eviction and drains (DisruptionTarget) and the JIT exit do not count as
    failures: the Job replaces the pod, which restores and resumes."""
    rules: list[Obj] = [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    rules.extend(
        {
            "action": "Ignore",
            "onExitCodes": {"containerName": name, "operator": "In", "values": [exit_code]},
        }
        for name in trainers
    )
    return rules


def runtime_ref(opts: Options) -> Obj:
    kind, name = opts.runtime
    return {"name": name, "kind": kind, "apiGroup": TRAINER_API}


def trainjob_patch(opts: Options) -> Obj:
    """The runtimePatches entry that gives the runtime's sidecar this job's storage URI."""
    sidecar_patch = {"name": SIDECAR, "env": [_var("storage_uri", opts.storage_uri)]}
    pod = {"spec": {"initContainers": [sidecar_patch]}}
    node = {"name": "node", "template": {"spec": {"template": pod}}}
    return {
        "manager": TRAINJOB_PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node]}}},
    }
