"""`jitckpt-sidecar inject`: rewrite Pod, Job, JobSet and TrainJob YAML into the swap-in form.

Like `linkerd inject`: YAML in (a file or stdin, multi-document), YAML out on stdout, one line
per object on stderr. For every pod the training container keeps its image; inject adds

- an init container that copies the stdlib-only entrypoint bundle into an emptyDir (`install`),
- the sidecar (a native sidecar: an init container with restartPolicy Always whose startupProbe
  holds the pod's other containers back until the restore from S3 is done; or, with
  `--sidecar-mode container` for clusters without native sidecars, a plain `restore` init
  container plus the sidecar as a regular container that exits after the trainer),
- the shared emptyDir with a sizeLimit (and JITCKPT_STORAGE_CAPACITY matching it),
- `python3 /jitckpt/jitckpt-entrypoint --` in front of the training container's command,
- for Jobs, a podFailurePolicy that ignores disruptions and the JIT exit code.

A TrainJob (Kubeflow Trainer v2) cannot add containers through its own spec: its runtime must
carry the sidecar (k8s/trainjob/runtime.yaml); inject wraps the trainer's command, points the
TrainJob at that runtime and patches the sidecar's storage URI in through runtimePatches.

Anything it cannot rewrite safely is refused with one line naming the object, and nothing is
written. Running it on its own output changes nothing. Comments in the input are not kept
(PyYAML drops them), and YAML aliases are written out in full.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
from collections.abc import Iterator
from typing import Any, NoReturn, Optional

import yaml

from jitckpt_entrypoint.config import parse_s3_uri
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_sidecar import __version__

PROG = "jitckpt-sidecar inject"
Obj = dict[str, Any]

BUNDLE_DIR = "/jitckpt"
BUNDLE_VOLUME = "jitckpt-bundle"
DATA_DIR = "/mnt/jitckpt"
DATA_VOLUME = "jitckpt"
INSTALL = "jitckpt-install"
SIDECAR = "jitckpt-sidecar"
RESTORE = "jitckpt-restore"
METRICS_PORT = 9402
METRICS_PORT_NAME = "jitckpt-metrics"
LAUNCHER = f"{BUNDLE_DIR}/jitckpt-entrypoint"
DEFAULT_IMAGE = f"jitckpt-sidecar:{__version__}"
DEFAULT_CAPACITY = "50Gi"
DEFAULT_GRACE_SECONDS = 120
DEFAULT_EXIT_CODE = 143
DEFAULT_TRAINJOB_RUNTIME = "TrainingRuntime/torch-distributed-jitckpt"
TRAINJOB_PATCH_MANAGER = "jitckpt.io/inject"
TRAINER_API = "trainer.kubeflow.org"
# Kinds that never hold a pod template: passed through untouched, so a file with its Service,
# ConfigMap or Kueue objects next to the Job still works. Everything else unknown is refused.
PASSTHROUGH = frozenset(
    {
        "ConfigMap",
        "Secret",
        "Service",
        "ServiceAccount",
        "PersistentVolumeClaim",
        "Namespace",
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PriorityClass",
        "LocalQueue",
        "ClusterQueue",
        "ResourceFlavor",
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
    }
)
SUPPORTED = ("Pod", "Job", "JobSet", "TrainJob", "List")
# PID-1 wrappers: jitckpt-entrypoint must be PID 1 itself; a second init in front would swallow
# or reorder the signals it forwards, so such commands are refused rather than stacked.
WRAPPERS = frozenset({"tini", "tini-static", "dumb-init", "catatonit", "s6-svscan", "supervisord"})
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$")
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})


class InjectError(Exception):
    """The input cannot be rewritten; the message is one line naming the object."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What inject adds; every field has a flag (see `_parser`)."""

    storage_uri: str
    """s3://bucket/prefix for this job's checkpoints (JITCKPT_STORAGE_URI on both sides)."""
    image: str = DEFAULT_IMAGE
    """The sidecar image: runs `install`, the sidecar and (container mode) `restore`."""
    secret: Optional[str] = None
    """Secret with the S3 credentials, used via envFrom (an OpenShift AI data connection works)."""
    capacity: str = DEFAULT_CAPACITY
    """sizeLimit of the shared emptyDir, and JITCKPT_STORAGE_CAPACITY."""
    grace_seconds: int = DEFAULT_GRACE_SECONDS
    """terminationGracePeriodSeconds for pods that have none; a pod's own value is kept."""
    exit_code: int = DEFAULT_EXIT_CODE
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
        try:
            parse_s3_uri(self.storage_uri, "--storage-uri")
        except JitckptError as exc:
            raise InjectError(str(exc)) from None
        if self.sidecar_mode not in ("native", "container"):
            raise InjectError(f"--sidecar-mode {self.sidecar_mode!r}: use native or container")
        if self.grace_seconds < 1:
            raise InjectError(f"--grace-seconds {self.grace_seconds}: use a number >= 1")
        if not 1 <= self.exit_code <= 255:
            raise InjectError(f"--exit-code {self.exit_code}: use an exit code from 1 to 255")
        if not _QUANTITY.match(self.capacity):
            raise InjectError(
                f"--capacity {self.capacity!r} is not a Kubernetes quantity; use e.g. 50Gi"
            )
        kind, _, name = self.trainjob_runtime.partition("/")
        if kind not in ("TrainingRuntime", "ClusterTrainingRuntime") or not name:
            raise InjectError(
                f"--trainjob-runtime {self.trainjob_runtime!r}: "
                "use TrainingRuntime/NAME or ClusterTrainingRuntime/NAME"
            )


# --- the pieces inject adds ---------------------------------------------------------------


def security_context(trainer: Optional[Obj] = None) -> Obj:
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
    theirs = (trainer or {}).get("securityContext") or {}
    for key in ("runAsUser", "runAsGroup"):
        if isinstance(theirs.get(key), int) and theirs[key] > 0:
            ctx[key] = theirs[key]
    return ctx


def sidecar_env(opts: Options, grace: int, *, exit_with_trainer: bool = False) -> list[Obj]:
    env = [
        {"name": "JITCKPT_DIR", "value": DATA_DIR},
        {"name": "JITCKPT_STORAGE_URI", "value": opts.storage_uri},
        {"name": "JITCKPT_STORAGE_CAPACITY", "value": opts.capacity},
        {"name": "JITCKPT_GRACE_SECONDS", "value": str(grace)},
        {"name": "JITCKPT_METRICS_PORT", "value": str(METRICS_PORT)},
    ]
    if exit_with_trainer:
        env.append({"name": "JITCKPT_EXIT_WITH_TRAINER", "value": "1"})
    return env


def _with_secret(container: Obj, opts: Options) -> Obj:
    if opts.secret:
        container["envFrom"] = [{"secretRef": {"name": opts.secret}}]
    return container


def install_container(opts: Options, trainer: Obj) -> Obj:
    return {
        "name": INSTALL,
        "image": opts.image,
        "command": ["jitckpt-sidecar", "install", BUNDLE_DIR],
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": security_context(trainer),
        "volumeMounts": [{"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR}],
    }


def sidecar_container(opts: Options, trainer: Obj, grace: int, *, native: bool) -> Obj:
    container: Obj = {"name": SIDECAR, "image": opts.image}
    if native:
        container["restartPolicy"] = "Always"
    container["env"] = sidecar_env(opts, grace, exit_with_trainer=not native)
    _with_secret(container, opts)
    container["ports"] = [
        {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}
    ]
    if native:
        # The pod's other containers start only once this passes: /readyz is 200 after the
        # restore. A large checkpoint can take a while to download; allow up to an hour.
        container["startupProbe"] = {
            "httpGet": {"path": "/readyz", "port": METRICS_PORT_NAME},
            "periodSeconds": 2,
            "failureThreshold": 1800,
        }
    container["livenessProbe"] = {
        "httpGet": {"path": "/healthz", "port": METRICS_PORT_NAME},
        "periodSeconds": 10,
        "failureThreshold": 6,
    }
    container["resources"] = {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    container["securityContext"] = security_context(trainer)
    container["volumeMounts"] = [{"name": DATA_VOLUME, "mountPath": DATA_DIR}]
    return container


def restore_container(opts: Options, trainer: Obj, grace: int) -> Obj:
    container: Obj = {
        "name": RESTORE,
        "image": opts.image,
        "command": ["jitckpt-sidecar", "restore"],
        "env": sidecar_env(opts, grace),
    }
    _with_secret(container, opts)
    container["resources"] = {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }
    container["securityContext"] = security_context(trainer)
    container["volumeMounts"] = [{"name": DATA_VOLUME, "mountPath": DATA_DIR}]
    return container


def volumes(opts: Options) -> list[Obj]:
    return [
        {"name": BUNDLE_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": DATA_VOLUME, "emptyDir": {"sizeLimit": opts.capacity}},
    ]


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


# --- the rewrite ---------------------------------------------------------------------------


def wrapped(command: list[str], opts: Options) -> list[str]:
    return [opts.python, LAUNCHER, "--", *command]


def _is_wrapped(command: list[Any]) -> bool:
    return (
        len(command) >= 3
        and isinstance(command[1], str)
        and command[1].endswith("/jitckpt-entrypoint")
        and command[2] == "--"
    )


def _check_command(container: Obj, where: str) -> Optional[str]:
    """None when the container can be wrapped; 'wrapped' when it already is; else refuse."""
    name = container.get("name")
    command = container.get("command")
    if not command:
        raise InjectError(
            f"{where}: container {name!r} has no command, so its image's ENTRYPOINT would run "
            "unwrapped; write the command out (command: [torchrun, ...]) and run inject again"
        )
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise InjectError(f"{where}: container {name!r} command is not a list of strings")
    if _is_wrapped(command):
        if command[1] != LAUNCHER:
            raise InjectError(
                f"{where}: container {name!r} already runs a jitckpt-entrypoint from "
                f"{command[1]!r}, not {LAUNCHER!r}; start from the original YAML"
            )
        return "wrapped"
    exe = command[0].rsplit("/", 1)[-1]
    if exe == "jitckpt-entrypoint" or (
        len(command) >= 3 and command[1] == "-m" and command[2] == "jitckpt_entrypoint"
    ):
        raise InjectError(
            f"{where}: container {name!r} already runs jitckpt-entrypoint (base-image mode); "
            "such a pod needs the sidecar from k8s/, not inject"
        )
    if exe in WRAPPERS:
        raise InjectError(
            f"{where}: container {name!r} runs under the init wrapper {exe!r}; remove it "
            "(jitckpt-entrypoint is the container's PID 1 and reaps zombies) and run inject again"
        )
    return None


def _names(items: Any) -> list[str]:
    return [str(c.get("name")) for c in items or [] if isinstance(c, dict)]


def _trainers(spec: Obj, opts: Options, where: str) -> list[Obj]:
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    if not containers:
        raise InjectError(f"{where}: the pod has no containers")
    names = _names(containers)
    if opts.containers:
        picked = [c for c in containers if c.get("name") in opts.containers]
        if not picked:
            raise InjectError(
                f"{where}: no container named {', '.join(opts.containers)} "
                f"(the pod has {', '.join(names)}); check --container"
            )
        return picked
    ours = [c for c in containers if c.get("name") != SIDECAR]
    if len(ours) != 1:
        raise InjectError(
            f"{where}: the pod has {len(ours)} containers ({', '.join(_names(ours))}); "
            "name the training container with --container NAME"
        )
    return ours


def _grace(spec: Obj, opts: Options, where: str) -> int:
    value = spec.get("terminationGracePeriodSeconds")
    if value is None:
        spec["terminationGracePeriodSeconds"] = opts.grace_seconds
        return opts.grace_seconds
    if not isinstance(value, int) or value < 1:
        raise InjectError(
            f"{where}: terminationGracePeriodSeconds is {value!r}; the JIT checkpoint needs "
            "a grace period of at least a few seconds"
        )
    return value


def _set_env(container: Obj, name: str, value: str) -> None:
    """Add `name` unless the container already sets it (the user's value wins)."""
    env = container.setdefault("env", [])
    if not any(isinstance(e, dict) and e.get("name") == name for e in env):
        env.append({"name": name, "value": value})


def _injected_state(spec: Obj) -> tuple[bool, bool]:
    """(has any of our parts, has all of them)."""
    init = _names(spec.get("initContainers"))
    main = _names(spec.get("containers"))
    vols = _names(spec.get("volumes"))
    parts = [
        INSTALL in init,
        SIDECAR in init or SIDECAR in main,
        BUNDLE_VOLUME in vols,
        DATA_VOLUME in vols,
    ]
    return any(parts), all(parts)


def inject_pod(spec: Obj, opts: Options, where: str) -> tuple[str, list[str]]:
    """Rewrite one pod spec in place; return ('injected' | 'unchanged', trainer names)."""
    if not isinstance(spec, dict):
        raise InjectError(f"{where}: the pod spec is not a mapping")
    trainers = _trainers(spec, opts, where)
    names = _names(trainers)
    states = [_check_command(c, where) for c in trainers]
    some, everything = _injected_state(spec)
    if all(s == "wrapped" for s in states) and everything:
        return "unchanged", names
    if some or any(s == "wrapped" for s in states):
        raise InjectError(
            f"{where}: partially injected (some of {INSTALL}, {SIDECAR}, the {BUNDLE_VOLUME} "
            f"and {DATA_VOLUME} volumes and the wrapped command are there, not all); "
            "start from the original YAML"
        )
    taken = {
        (m.get("mountPath") or "").rstrip("/")
        for c in trainers
        for m in c.get("volumeMounts") or []
        if isinstance(m, dict)
    }
    for path in (BUNDLE_DIR, DATA_DIR):
        if path in taken:
            raise InjectError(f"{where}: {path} is already a mount point in the trainer")
    for name in (INSTALL, SIDECAR, RESTORE):
        if name in _names(spec.get("initContainers")) + _names(spec.get("containers")):
            raise InjectError(f"{where}: a container is already named {name!r}; rename it")

    grace = _grace(spec, opts, where)
    native = opts.sidecar_mode == "native"
    for container in trainers:
        if container["command"][0].rsplit("/", 1)[-1] in SHELLS:
            print(
                f"{PROG}: warning: {where}: container {container.get('name')!r} runs a shell; "
                "make its last command `exec torchrun ...` so SIGTERM reaches torchrun",
                file=sys.stderr,
            )
        container["command"] = wrapped(container["command"], opts)
        _set_env(container, "JITCKPT_DIR", DATA_DIR)
        _set_env(container, "JITCKPT_STORAGE_URI", opts.storage_uri)
        _set_env(container, "JITCKPT_GRACE_SECONDS", str(grace))
        _set_env(container, "JITCKPT_EXIT_CODE", str(opts.exit_code))
        mounts = container.setdefault("volumeMounts", [])
        mounts.append({"name": BUNDLE_VOLUME, "mountPath": BUNDLE_DIR, "readOnly": True})
        mounts.append({"name": DATA_VOLUME, "mountPath": DATA_DIR})

    first = trainers[0]
    init = spec.setdefault("initContainers", [])
    init.append(install_container(opts, first))
    if native:
        init.append(sidecar_container(opts, first, grace, native=True))
    else:
        init.append(restore_container(opts, first, grace))
        spec["containers"].append(sidecar_container(opts, first, grace, native=False))
    spec.setdefault("volumes", []).extend(volumes(opts))
    return "injected", names


def inject_job_spec(job: Obj, opts: Options, where: str) -> tuple[str, list[str]]:
    """A Job's spec: the pod template, then the podFailurePolicy."""
    template = job.get("template") if isinstance(job, dict) else None
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise InjectError(f"{where}: no pod template (spec.template.spec)")
    pod = template["spec"]
    result, trainers = inject_pod(pod, opts, where)
    if pod.get("restartPolicy") != "Never":
        if result == "injected":
            print(
                f"{PROG}: note: {where}: restartPolicy is {pod.get('restartPolicy')!r}, not "
                "Never, so no podFailurePolicy was added; a JIT exit restarts the container "
                "in place and counts against backoffLimit",
                file=sys.stderr,
            )
        return result, trainers
    policy = job.setdefault("podFailurePolicy", {})
    rules = policy.setdefault("rules", [])
    missing = [r for r in failure_rules(trainers, opts.exit_code) if r not in rules]
    if missing:
        policy["rules"] = missing + rules
        result = "injected"
    return result, trainers


def inject_trainjob(doc: Obj, opts: Options, where: str) -> str:
    """Wrap the trainer's command; the runtime carries the sidecar, install and volumes."""
    spec = doc.get("spec")
    trainer = spec.get("trainer") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(trainer, dict) or not trainer.get("command"):
        raise InjectError(
            f"{where}: no spec.trainer.command; the runtime's command cannot be wrapped from "
            "here: write the command out in the TrainJob and run inject again"
        )
    state = _check_command({"name": "node", "command": trainer["command"]}, where)
    kind, _, name = opts.trainjob_runtime.partition("/")
    ref = {"name": name, "kind": kind, "apiGroup": TRAINER_API}
    patch = {
        "manager": TRAINJOB_PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "spec": {
                                    "template": {
                                        "spec": {
                                            "initContainers": [
                                                {
                                                    "name": SIDECAR,
                                                    "env": [
                                                        {
                                                            "name": "JITCKPT_STORAGE_URI",
                                                            "value": opts.storage_uri,
                                                        }
                                                    ],
                                                }
                                            ]
                                        }
                                    }
                                }
                            },
                        }
                    ]
                }
            }
        },
    }
    patches = spec.setdefault("runtimePatches", [])
    ours = [
        p for p in patches if isinstance(p, dict) and p.get("manager") == TRAINJOB_PATCH_MANAGER
    ]
    if state == "wrapped":
        if ours and spec.get("runtimeRef", {}).get("name") == name:
            return "unchanged"
        raise InjectError(f"{where}: partially injected; start from the original YAML")
    if ours:
        raise InjectError(f"{where}: partially injected; start from the original YAML")
    old = spec.get("runtimeRef") or {}
    if old.get("name") != name:
        print(
            f"{PROG}: note: {where}: runtimeRef {old.get('name')!r} replaced by {kind} {name!r} "
            "(k8s/trainjob/runtime.yaml: the torch runtime plus the jitckpt sidecar); "
            "apply that runtime first",
            file=sys.stderr,
        )
    spec["runtimeRef"] = ref
    trainer["command"] = wrapped(trainer["command"], opts)
    _set_env(trainer, "JITCKPT_STORAGE_URI", opts.storage_uri)
    _set_env(trainer, "JITCKPT_EXIT_CODE", str(opts.exit_code))
    patches.append(patch)
    return "injected"


def _label(doc: Obj, index: int, total: int) -> str:
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name") or (doc.get("metadata") or {}).get(
        "generateName", "?"
    )
    obj = f"{kind}/{name}"
    return f"document {index} ({obj})" if total > 1 else obj


def inject_object(doc: Any, opts: Options, where: str, report: list[str]) -> None:
    """Rewrite one Kubernetes object in place (a List recursively)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        raise InjectError(f"{where}: not a Kubernetes object (a mapping with apiVersion and kind)")
    kind = doc["kind"]
    api = str(doc.get("apiVersion", ""))
    if kind in PASSTHROUGH:
        report.append(f"{where}: {kind} passed through")
        return
    if kind == "List" or (kind.endswith("List") and isinstance(doc.get("items"), list)):
        items = doc.get("items")
        if not isinstance(items, list):
            raise InjectError(f"{where}: List without items")
        for i, item in enumerate(items):
            inner = item if isinstance(item, dict) else {}
            name = (inner.get("metadata") or {}).get("name", "?")
            inject_object(item, opts, f"{where} item {i} ({inner.get('kind')}/{name})", report)
        return
    if kind == "Pod" and api == "v1":
        result, trainers = inject_pod(doc.get("spec"), opts, where)  # type: ignore[arg-type]
    elif kind == "Job" and api == "batch/v1":
        result, trainers = inject_job_spec(doc.get("spec"), opts, where)  # type: ignore[arg-type]
    elif kind == "JobSet" and api.startswith("jobset.x-k8s.io/"):
        result, trainers = inject_jobset(doc, opts, where)
    elif kind == "TrainJob" and api.startswith(f"{TRAINER_API}/"):
        result, trainers = inject_trainjob(doc, opts, where), ["node"]
    else:
        raise InjectError(
            f"{where}: {api or '?'} {kind} is not supported (inject handles v1 Pod, batch/v1 "
            f"Job, JobSet, Kubeflow Trainer TrainJob and List); run training in a Job"
        )
    what = "already injected, unchanged" if result == "unchanged" else "injected"
    report.append(f"{where}: {what} (trainer container {', '.join(trainers)})")


def inject_jobset(doc: Obj, opts: Options, where: str) -> tuple[str, list[str]]:
    spec = doc.get("spec")
    jobs = spec.get("replicatedJobs") if isinstance(spec, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise InjectError(f"{where}: no spec.replicatedJobs")
    results: list[str] = []
    trainers: list[str] = []
    for rj in jobs:
        name = rj.get("name", "?") if isinstance(rj, dict) else "?"
        template = rj.get("template") if isinstance(rj, dict) else None
        if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
            raise InjectError(f"{where}: replicatedJob {name!r} has no template.spec")
        pod = (template["spec"].get("template") or {}).get("spec") or {}
        if opts.containers and not set(_names(pod.get("containers"))) & set(opts.containers):
            continue  # e.g. a launcher or a data job next to the workers: left as it is
        result, names = inject_job_spec(template["spec"], opts, f"{where} replicatedJob {name!r}")
        results.append(result)
        trainers.extend(n for n in names if n not in trainers)
    if not results:
        raise InjectError(
            f"{where}: no replicatedJob has a container named {', '.join(opts.containers)}; "
            "check --container"
        )
    return ("injected" if "injected" in results else "unchanged"), trainers


# --- YAML in and out -------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block style, aliases written out, multi-line strings (scripts) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:  # noqa: ARG002 (PyYAML's signature)
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data and not data.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def _unshare(value: Any) -> Any:
    """A copy with no shared sub-objects: a YAML alias must not carry our edits elsewhere."""
    if isinstance(value, dict):
        return {k: _unshare(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshare(v) for v in value]
    return copy.copy(value)


def load(text: str, source: str) -> list[Any]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InjectError(f"{source}: not valid YAML{at}: {problem}") from None
    return [_unshare(d) for d in docs if d is not None]


def dump(docs: list[Any]) -> str:
    return yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100, allow_unicode=True
    )


def inject_text(text: str, opts: Options, source: str = "<stdin>") -> tuple[str, list[str]]:
    """The rewritten YAML stream and one report line per object; InjectError refuses all."""
    docs = load(text, source)
    if not docs:
        raise InjectError(f"{source}: no Kubernetes objects in the input")
    report: list[str] = []
    for index, doc in enumerate(docs, 1):
        label = _label(doc, index, len(docs)) if isinstance(doc, dict) else f"document {index}"
        inject_object(doc, opts, f"{source}: {label}", report)
    return dump(docs), report


# --- command line ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _parser() -> _Parser:
    p = _Parser(
        prog=PROG,
        description=(
            "Rewrite Pod, Job, JobSet and TrainJob YAML so that the training container runs "
            "under jitckpt-entrypoint with the jitckpt sidecar, keeping its own image. "
            "Reads FILE (or stdin), writes YAML to stdout; idempotent."
        ),
        allow_abbrev=False,
    )
    p.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        metavar="FILE",
        help="input YAML (multi-document); '-' or none = stdin; repeatable",
    )
    p.add_argument(
        "--storage-uri",
        required=True,
        metavar="s3://BUCKET/PREFIX",
        help="where this job's checkpoints go (JITCKPT_STORAGE_URI)",
    )
    p.add_argument("--image", default=DEFAULT_IMAGE, help=f"sidecar image [{DEFAULT_IMAGE}]")
    p.add_argument(
        "--secret",
        metavar="NAME",
        help="Secret with S3 credentials for envFrom (a data connection works as is)",
    )
    p.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITY,
        help=f"emptyDir sizeLimit = JITCKPT_STORAGE_CAPACITY [{DEFAULT_CAPACITY}]",
    )
    p.add_argument(
        "--grace-seconds",
        type=int,
        default=DEFAULT_GRACE_SECONDS,
        help=f"terminationGracePeriodSeconds where a pod sets none [{DEFAULT_GRACE_SECONDS}]",
    )
    p.add_argument(
        "--exit-code",
        type=int,
        default=DEFAULT_EXIT_CODE,
        help=f"JIT exit code the podFailurePolicy ignores [{DEFAULT_EXIT_CODE}]",
    )
    p.add_argument(
        "--container",
        dest="containers",
        action="append",
        default=[],
        metavar="NAME",
        help="training container (repeatable); default: the only one",
    )
    p.add_argument(
        "--sidecar-mode",
        choices=("native", "container"),
        default="native",
        help="native sidecar (Kubernetes >= 1.29) or restore init container + "
        "regular sidecar container [native]",
    )
    p.add_argument(
        "--python",
        default="python3",
        help="python3 in the training image that runs the launcher [python3]",
    )
    p.add_argument(
        "--trainjob-runtime",
        default=DEFAULT_TRAINJOB_RUNTIME,
        metavar="KIND/NAME",
        help=f"jitckpt runtime for TrainJobs [{DEFAULT_TRAINJOB_RUNTIME}]",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no per-object lines on stderr")
    return p


def _inputs(files: Optional[list[str]]) -> Iterator[tuple[str, str]]:
    for name in files or ["-"]:
        if name == "-":
            yield "<stdin>", sys.stdin.read()
        else:
            try:
                with open(name, encoding="utf-8") as f:
                    yield name, f.read()
            except OSError as exc:
                raise InjectError(f"cannot read {name}: {exc.strerror or exc}") from None


def main(argv: list[str]) -> int:
    """Exit 0 with the YAML on stdout; 1 when refused; 2 for a usage error."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}; see {PROG} --help", file=sys.stderr)
        return 2
    try:
        opts = Options(
            storage_uri=args.storage_uri,
            image=args.image,
            secret=args.secret,
            capacity=args.capacity,
            grace_seconds=args.grace_seconds,
            exit_code=args.exit_code,
            containers=tuple(args.containers),
            sidecar_mode=args.sidecar_mode,
            python=args.python,
            trainjob_runtime=args.trainjob_runtime,
        )
    except InjectError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    out, report = [], []
    try:
        for source, text in _inputs(args.files):
            rewritten, lines = inject_text(text, opts, source)
            out.append(rewritten)
            report.extend(lines)
    except InjectError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(out))
    if not args.quiet:
        for line in report:
            print(f"{PROG}: {line}", file=sys.stderr)
    return 0
