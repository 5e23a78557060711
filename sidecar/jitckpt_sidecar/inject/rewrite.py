"""The rewrite: Pods, Jobs, JobSets, TrainJobs, PyTorchJobs and Lists into the swap-in form, in
place.

Each rewriter checks before it changes anything it cannot undo: a refusal (InjectError) names
the object; warnings and notes go into the Report, for the command line to print.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jitckpt_sidecar.errors import InjectError
from jitckpt_sidecar.inject import templates as t
from jitckpt_sidecar.inject import yaml_io
from jitckpt_sidecar.inject.options import Options
from jitckpt_sidecar.inject.templates import Obj

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
# PID-1 wrappers: jitckpt-entrypoint must be PID 1 itself; a second init in front would swallow
# or reorder the signals it forwards, so such commands are refused rather than stacked.
WRAPPERS = frozenset({"tini", "tini-static", "dumb-init", "catatonit", "s6-svscan", "supervisord"})
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh"})


@dataclasses.dataclass
class Report:
    """What inject did and what the user should know."""

    objects: list[str] = dataclasses.field(default_factory=list)
    """One line per object: injected, unchanged or passed through."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """'warning: ...' and 'note: ...' lines, in the order they came up."""


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
        if command[1] != t.LAUNCHER:
            raise InjectError(
                f"{where}: container {name!r} already runs a jitckpt-entrypoint from "
                f"{command[1]!r}, not {t.LAUNCHER!r}; start from the original YAML"
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
    ours = [c for c in containers if c.get("name") != t.SIDECAR]
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


def _mount(container: Obj, opts: Options, where: str, report: Report) -> None:
    """Our volumes in a training container (and the memory volume's limit, or a warning)."""
    mounts = container.setdefault("volumeMounts", [])
    mounts.append({"name": t.BUNDLE_VOLUME, "mountPath": t.BUNDLE_DIR, "readOnly": True})
    mounts.append({"name": t.DATA_VOLUME, "mountPath": t.DATA_DIR})
    if opts.memory:
        mounts.append({"name": t.MEMORY_VOLUME, "mountPath": t.MEMORY_DIR})
        _memory_note(container, opts.memory, where, report)


def _memory_note(container: Obj, size: str, where: str, report: Report) -> None:
    """The trainer's memory limit raised by the memory volume's size, or a warning; and where
    snapshots help."""
    name = container.get("name")
    report.notes.append(
        f"note: {where}: snapshots in RAM are used when the trainer restarts in the same pod "
        "(torchrun --max-restarts, restartPolicy OnFailure, the pod's own restart); a new pod "
        "starts without them (with --peers, a replacement pod gets its own from its peer's "
        "sidecar), but for the newest of a single-node job, which the sidecar writes out when "
        "the trainer's container was killed whole"
    )
    raised = t.raise_memory_limit(container, size)
    if raised is None:
        report.notes.append(
            f"warning: {where}: container {name!r} has no memory limit; the {size} memory "
            f"volume {t.MEMORY_VOLUME} counts against the node's memory"
        )
    else:
        report.notes.append(
            f"note: {where}: container {name!r}: memory limit raised to {raised} (the {size} "
            f"memory volume {t.MEMORY_VOLUME} counts against it; its request too)"
        )


def _same_memory(spec: Obj, opts: Options, where: str) -> None:
    """An injected pod asked for again: with the memory volume exactly when --memory is given,
    and the same --peers."""
    memory = t.MEMORY_VOLUME in _names(spec.get("volumes"))
    if bool(opts.memory) != memory:
        raise InjectError(
            f"{where}: already injected {'with' if memory else 'without'} --memory; start from "
            "the original YAML to change it"
        )
    env = env_by_name(sidecar_of(spec))
    token = (env.get("JITCKPT_PEER_TOKEN") or {}).get("valueFrom") or {}
    peers = (env.get("JITCKPT_PEERS") or {}).get("value")
    had = (peers, (token.get("secretKeyRef") or {}).get("name"))
    if had != (opts.peers, opts.peer_secret):
        before = f"--peers {had[0]!r} --peer-secret {had[1]!r}" if had[0] else "no --peers"
        raise InjectError(
            f"{where}: already injected with {before}; start from the original YAML to change "
            "the peer replica"
        )


def _injected_state(spec: Obj) -> tuple[bool, bool]:
    """(has any of our parts, has all of them)."""
    init = _names(spec.get("initContainers"))
    main = _names(spec.get("containers"))
    vols = _names(spec.get("volumes"))
    parts = [
        t.INSTALL in init,
        t.SIDECAR in init or t.SIDECAR in main,
        t.BUNDLE_VOLUME in vols,
        t.DATA_VOLUME in vols,
    ]
    return any(parts), all(parts)


def inject_pod(
    spec: Obj,
    opts: Options,
    where: str,
    report: Report,
    restart_policy: str = "",
    *,
    indexed: bool = False,
    index_repeats: bool = False,
) -> tuple[str, list[str]]:
    """Rewrite one pod spec in place; return ('injected' | 'unchanged', trainer names).
    `restart_policy`: the pods' restartPolicy when a controller sets it (else the spec's own,
    Kubernetes' default Always when unset); `indexed`: the pods of an Indexed Job, each told
    its node rank by the Job controller (JOB_COMPLETION_INDEX); `index_repeats`: a JobSet's
    pods of several Jobs, whose completion indexes repeat (not a node rank)."""
    if not isinstance(spec, dict):
        raise InjectError(f"{where}: the pod spec is not a mapping")
    trainers = _trainers(spec, opts, where)
    names = _names(trainers)
    states = [_check_command(c, where) for c in trainers]
    some, everything = _injected_state(spec)
    if all(s == "wrapped" for s in states) and everything:
        _same_memory(spec, opts, where)
        return "unchanged", names
    if some or any(s == "wrapped" for s in states):
        raise InjectError(
            f"{where}: partially injected (some of {t.INSTALL}, {t.SIDECAR}, the {t.BUNDLE_VOLUME} "
            f"and {t.DATA_VOLUME} volumes and the wrapped command are there, not all); "
            "start from the original YAML"
        )
    taken = {
        (m.get("mountPath") or "").rstrip("/")
        for c in trainers
        for m in c.get("volumeMounts") or []
        if isinstance(m, dict)
    }
    for path in (t.BUNDLE_DIR, t.DATA_DIR, *((t.MEMORY_DIR,) if opts.memory else ())):
        if path in taken:
            raise InjectError(f"{where}: {path} is already a mount point in the trainer")
    for name in (t.INSTALL, t.SIDECAR, t.RESTORE):
        if name in _names(spec.get("initContainers")) + _names(spec.get("containers")):
            raise InjectError(f"{where}: a container is already named {name!r}; rename it")

    grace = _grace(spec, opts, where)
    for container in trainers:
        if container["command"][0].rsplit("/", 1)[-1] in SHELLS:
            report.notes.append(
                f"warning: {where}: container {container.get('name')!r} runs a shell; "
                "make its last command `exec torchrun ...` so SIGTERM reaches torchrun"
            )
        container["command"] = t.wrapped(container["command"], opts)
        for name, value in t.trainer_env(opts, grace):
            _set_env(container, name, value)
        _mount(container, opts, where, report)

    first = trainers[0]
    init = spec.setdefault("initContainers", [])
    init.append(t.install_container(opts, first))
    if opts.native:
        sidecar = t.sidecar_container(opts, first, grace)
        init.append(sidecar)
    else:
        init.append(t.restore_container(opts, first, grace))
        restart = restart_policy or spec.get("restartPolicy") or "Always"
        sidecar = t.sidecar_container(opts, first, grace, restart)
        spec["containers"].append(sidecar)
    spec.setdefault("volumes", []).extend(t.volumes(opts))
    in_place = _restarts_in_place(spec, trainers, restart_policy)
    _peer_notes(
        sidecar,
        opts,
        where,
        report,
        indexed=indexed,
        index_repeats=index_repeats,
        in_place=in_place,
    )
    return "injected", names


def _restarts_in_place(spec: Obj, trainers: list[Obj], restart_policy: str) -> bool:
    """Whether a trainer that fails comes back in the same pod: the pod's restartPolicy, or
    torchrun's --max-restarts in the trainer's command."""
    if (restart_policy or spec.get("restartPolicy") or "Always") != "Never":
        return True
    words = [str(w) for c in trainers for w in [*(c.get("command") or []), *(c.get("args") or [])]]
    return any("max-restarts" in w or "max_restarts" in w for w in words)


def sidecar_of(spec: Obj) -> Obj:
    """The injected sidecar container of a pod spec ({} when there is none)."""
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return next((c for c in containers if isinstance(c, dict) and c.get("name") == t.SIDECAR), {})


def env_by_name(container: Obj) -> dict[str, Obj]:
    env = container.get("env") or []
    return {str(var.get("name")): var for var in env if isinstance(var, dict)}


def rank_source(sidecar: Obj) -> str:
    """Where `sidecar` (inject's) gets its node rank: "rank" (the trainer's PET_NODE_RANK),
    "index" (a Job's completion index: JOB_COMPLETION_INDEX, or a PET_NODE_RANK taken from
    it), or "" (none it can see)."""
    env = env_by_name(sidecar)
    rank = env.get("JITCKPT_NODE_RANK")
    if rank is not None:
        path = ((rank.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        return "index" if "job-completion-index" in path else "rank"
    return "index" if "JOB_COMPLETION_INDEX" in env else ""


def _peer_notes(
    sidecar: Obj,
    opts: Options,
    where: str,
    report: Report,
    *,
    indexed: bool,
    index_repeats: bool,
    in_place: bool,
) -> None:
    """The peer replica: the node rank and count it needs (InjectError without a rank: its
    sidecar would exit 2 in every pod, or nodes of different Jobs would share a rank), the
    sidecar's memory limit."""
    if not opts.peers:
        return
    names = {var["name"] for var in sidecar["env"]}
    source = rank_source(sidecar) or ("index" if indexed else "")
    if not source or (source == "index" and index_repeats):
        raise InjectError(
            f"{where}: --peers needs each pod's node rank: set PET_NODE_RANK in the training "
            "container's env (in a JobSet of several Jobs: the node's rank in the whole set), "
            "or run it as an Indexed Job (completionMode: Indexed)"
        )
    report.notes.append(
        f"note: {where}: the peer replica: {t.SIDECAR}'s memory limit is "
        f"{sidecar['resources']['limits']['memory']} (its own {t.SIDECAR_MEMORY} and the "
        f"{opts.memory} memory volume: the peer's snapshot it keeps there, and its own restored "
        "from it, count against it; so does the restore init container's in the "
        "sidecar-as-container mode); size --memory for about four snapshots of a node; the "
        f"Secret {opts.peer_secret!r} needs the key {t.PEER_TOKEN_KEY!r}"
    )
    if not in_place:
        report.notes.append(
            f"note: {where}: the peer replica helps when the other nodes' trainers restart in "
            "place after a node is lost (torchrun --max-restarts, or restartPolicy OnFailure); "
            "with restartPolicy Never and no --max-restarts every pod is replaced, its memory "
            "volume with it, and the job goes back to the volume or S3"
        )
    if "JITCKPT_NNODES" not in names:
        report.notes.append(
            f"warning: {where}: the peer replica needs the node count: set PET_NNODES in the "
            "training container's env (the sidecar reads it as JITCKPT_NNODES), or it exits 2"
        )


def inject_job_spec(
    job: Obj, opts: Options, where: str, report: Report, *, one_of_many: bool = False
) -> tuple[str, list[str]]:
    """A Job's spec: the pod template, then the podFailurePolicy. `one_of_many`: a Job of a
    JobSet of several Jobs (each counts its completion index from 0)."""
    template = job.get("template") if isinstance(job, dict) else None
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise InjectError(f"{where}: no pod template (spec.template.spec)")
    pod = template["spec"]
    indexed = job.get("completionMode") == "Indexed" and not one_of_many
    result, trainers = inject_pod(
        pod, opts, where, report, indexed=indexed, index_repeats=one_of_many
    )
    if pod.get("restartPolicy") != "Never":
        if result == "injected":
            report.notes.append(
                f"note: {where}: restartPolicy is {pod.get('restartPolicy')!r}, not "
                "Never, so no podFailurePolicy was added; a JIT exit restarts the container "
                "in place and counts against backoffLimit"
            )
        return result, trainers
    policy = job.setdefault("podFailurePolicy", {})
    rules = policy.setdefault("rules", [])
    missing = [r for r in t.failure_rules(trainers, opts.exit_code) if r not in rules]
    if missing:
        policy["rules"] = missing + rules
        result = "injected"
    return result, trainers


def inject_trainjob(doc: Obj, opts: Options, where: str, report: Report) -> str:
    """Wrap the trainer's command; the runtime carries the sidecar, install and volumes."""
    spec = doc.get("spec")
    trainer = spec.get("trainer") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(trainer, dict) or not trainer.get("command"):
        raise InjectError(
            f"{where}: no spec.trainer.command; the runtime's command cannot be wrapped from "
            "here: write the command out in the TrainJob and run inject again"
        )
    state = _check_command({"name": "node", "command": trainer["command"]}, where)
    ref = t.runtime_ref(opts)
    patches = spec.setdefault("runtimePatches", [])
    ours = [
        p for p in patches if isinstance(p, dict) and p.get("manager") == t.TRAINJOB_PATCH_MANAGER
    ]
    if state == "wrapped":
        if ours and spec.get("runtimeRef", {}).get("name") == ref["name"]:
            return "unchanged"
        raise InjectError(f"{where}: partially injected; start from the original YAML")
    if ours:
        raise InjectError(f"{where}: partially injected; start from the original YAML")
    old = spec.get("runtimeRef") or {}
    if old.get("name") != ref["name"]:
        report.notes.append(
            f"note: {where}: runtimeRef {old.get('name')!r} replaced by {ref['kind']} "
            f"{ref['name']!r} (k8s/trainjob/runtime.yaml: the torch runtime plus the jitckpt "
            "sidecar); apply that runtime first"
        )
    if opts.memory:
        report.notes.append(
            f"warning: {where}: --memory is not applied to a TrainJob (its runtime owns the "
            "pod's volumes); add the memory volume and JITCKPT_MEMORY_DIR to the runtime"
        )
    spec["runtimeRef"] = ref
    trainer["command"] = t.wrapped(trainer["command"], opts)
    for name, value in t.trainer_env(opts):
        _set_env(trainer, name, value)
    patches.append(t.trainjob_patch(opts))
    return "injected"


def _label(doc: Obj, index: int, total: int) -> str:
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name") or (doc.get("metadata") or {}).get(
        "generateName", "?"
    )
    obj = f"{kind}/{name}"
    return f"document {index} ({obj})" if total > 1 else obj


def inject_object(doc: Any, opts: Options, where: str, report: Report) -> None:
    """Rewrite one Kubernetes object in place (a List recursively)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        raise InjectError(f"{where}: not a Kubernetes object (a mapping with apiVersion and kind)")
    kind = doc["kind"]
    api = str(doc.get("apiVersion", ""))
    if kind in PASSTHROUGH:
        report.objects.append(f"{where}: {kind} passed through")
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
        result, trainers = inject_pod(doc.get("spec"), opts, where, report)  # type: ignore[arg-type]
    elif kind == "Job" and api == "batch/v1":
        result, trainers = inject_job_spec(doc.get("spec"), opts, where, report)  # type: ignore[arg-type]
    elif kind == "JobSet" and api.startswith("jobset.x-k8s.io/"):
        result, trainers = inject_jobset(doc, opts, where, report)
    elif kind == "TrainJob" and api.startswith(f"{t.TRAINER_API}/"):
        result, trainers = inject_trainjob(doc, opts, where, report), ["node"]
    elif kind == "PyTorchJob" and api == PYTORCHJOB_API:
        result, trainers = inject_pytorchjob(doc, opts, where, report)
    else:
        raise InjectError(
            f"{where}: {api or '?'} {kind} is not supported (inject handles v1 Pod, batch/v1 "
            f"Job, JobSet, Kubeflow Trainer TrainJob, {PYTORCHJOB_API} PyTorchJob and List); "
            "run training in a Job"
        )
    what = "already injected, unchanged" if result == "unchanged" else "injected"
    report.objects.append(f"{where}: {what} (trainer container {', '.join(trainers)})")


PYTORCHJOB_API = "kubeflow.org/v1"
PYTORCHJOB_CONTAINER = "pytorch"
"""The container the Training Operator gives torchrun's environment (PET_*, MASTER_ADDR)."""
PYTORCHJOB_RESTART = {
    "ExitCode": "",
    "OnFailure": "the container restarts in place after a JIT exit and resumes from the volume "
    "(an evicted pod is recreated and restores from S3); ExitCode restarts only on exit codes "
    "of 128 and above, the JIT exit 143 among them",
    "Always": "the container restarts in place even after training ends",
    "Never": "a JIT exit fails the PyTorchJob; set restartPolicy: ExitCode (exit codes of 128 "
    "and above, the JIT exit 143 among them, are retried) or OnFailure",
}
"""What a replica's restartPolicy does to a JIT exit; ExitCode (the recommended one) says
nothing. The operator's default when unset is OnFailure."""
PYTORCHJOB_POD_RESTART = {
    "ExitCode": "Never",
    "OnFailure": "OnFailure",
    "Always": "Always",
    "Never": "Never",
}
"""The pods' restartPolicy the operator sets for a replica's (ExitCode: it recreates the pod)."""


def inject_pytorchjob(doc: Obj, opts: Options, where: str, report: Report) -> tuple[str, list[str]]:
    """Kubeflow Training Operator v1: every replica type's pod template (Master, Worker), each
    with its own sidecar and one storage URI; a note for each restartPolicy that does not bring
    a preempted replica back to resume."""
    spec = doc.get("spec")
    replicas = spec.get("pytorchReplicaSpecs") if isinstance(spec, dict) else None
    if not isinstance(replicas, dict) or not replicas:
        raise InjectError(f"{where}: no spec.pytorchReplicaSpecs")
    if opts.peers:
        raise InjectError(
            f"{where}: --peers cannot be written into a PyTorchJob's templates (the operator "
            "sets each pod's node rank, and its pods are <name>-master-0, <name>-worker-<rank-1>"
            "): use the webhook with the annotations jitckpt.io/peers (one URL per node, "
            "comma-separated) and jitckpt.io/peer-secret"
        )
    if isinstance(spec.get("elasticPolicy"), dict):  # type: ignore[union-attr]
        report.notes.append(
            f"note: {where}: elasticPolicy (a dynamic rendezvous): every node restores whole "
            "checkpoints, since node ranks are assigned at the rendezvous"
        )
    results: list[str] = []
    trainers: list[str] = []
    for rtype, rspec in replicas.items():
        where_r = f"{where} {rtype}"
        template = rspec.get("template") if isinstance(rspec, dict) else None
        pod = template.get("spec") if isinstance(template, dict) else None
        if not isinstance(pod, dict):
            raise InjectError(f"{where_r}: no template.spec")
        ours = opts
        if not opts.containers and PYTORCHJOB_CONTAINER in _names(pod.get("containers")):
            ours = dataclasses.replace(opts, containers=(PYTORCHJOB_CONTAINER,))
        policy = rspec.get("restartPolicy") or "OnFailure"
        restart = PYTORCHJOB_POD_RESTART.get(policy, "")
        result, names = inject_pod(pod, ours, where_r, report, restart)
        effect = PYTORCHJOB_RESTART.get(policy, f"restartPolicy {policy!r} is not one inject knows")
        if result == "injected" and effect:
            report.notes.append(f"note: {where_r}: restartPolicy {policy}: {effect}")
        results.append(result)
        trainers.extend(n for n in names if n not in trainers)
    return ("injected" if "injected" in results else "unchanged"), trainers


def inject_jobset(doc: Obj, opts: Options, where: str, report: Report) -> tuple[str, list[str]]:
    spec = doc.get("spec")
    jobs = spec.get("replicatedJobs") if isinstance(spec, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise InjectError(f"{where}: no spec.replicatedJobs")
    results: list[str] = []
    trainers: list[str] = []
    jobs_in_set = sum(rj.get("replicas", 1) if isinstance(rj, dict) else 1 for rj in jobs)
    for rj in jobs:
        name = rj.get("name", "?") if isinstance(rj, dict) else "?"
        template = rj.get("template") if isinstance(rj, dict) else None
        if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
            raise InjectError(f"{where}: replicatedJob {name!r} has no template.spec")
        pod = (template["spec"].get("template") or {}).get("spec") or {}
        if opts.containers and not set(_names(pod.get("containers"))) & set(opts.containers):
            continue  # e.g. a launcher or a data job next to the workers: left as it is
        where_rj = f"{where} replicatedJob {name!r}"
        many = jobs_in_set != 1  # each Job counts its completion index from 0
        result, names = inject_job_spec(template["spec"], opts, where_rj, report, one_of_many=many)
        results.append(result)
        trainers.extend(n for n in names if n not in trainers)
    if not results:
        raise InjectError(
            f"{where}: no replicatedJob has a container named {', '.join(opts.containers)}; "
            "check --container"
        )
    return ("injected" if "injected" in results else "unchanged"), trainers


def inject_documents(docs: list[Any], opts: Options, source: str) -> Report:
    """Rewrite every document of a stream in place; InjectError refuses the whole stream."""
    if not docs:
        raise InjectError(f"{source}: no Kubernetes objects in the input")
    report = Report()
    for index, doc in enumerate(docs, 1):
        label = _label(doc, index, len(docs)) if isinstance(doc, dict) else f"document {index}"
        inject_object(doc, opts, f"{source}: {label}", report)
    return report


def inject_text(text: str, opts: Options, source: str = "<stdin>") -> tuple[str, Report]:
    """The rewritten YAML stream and what was done; InjectError refuses the whole stream."""
    docs = yaml_io.load(text, source)
    report = inject_documents(docs, opts, source)
    return yaml_io.dump(docs), report
