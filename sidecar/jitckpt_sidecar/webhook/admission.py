"""One AdmissionReview in, one AdmissionReview out: the webhook's decision, without any I/O.

A pod labelled `jitckpt.io/inject: "true"` gets inject's own rewrite (`inject_pod`: one
implementation, two front doors), as a JSONPatch. Every other outcome allows the pod unchanged:
not labelled, already injected (the `jitckpt.io/injected` annotation this patch adds, or a pod
whose template was already run through inject), or refused by inject's checks, in which case the
response's `warnings` say why. Only a request that is not an AdmissionReview is refused (the
server answers it with a 400); nothing here blocks a pod's creation.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Optional

from jitckpt_entrypoint import shared_settings as shared
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.settings import Option, SettingError
from jitckpt_sidecar import __version__
from jitckpt_sidecar.errors import InjectError
from jitckpt_sidecar.inject.options import OPTIONS, Options
from jitckpt_sidecar.inject.rewrite import (
    PYTORCHJOB_CONTAINER,
    Report,
    inject_pod,
    rank_source,
    sidecar_of,
)

API_VERSION = "admission.k8s.io/v1"
LABEL = "jitckpt.io/inject"
INJECTED = "jitckpt.io/injected"
"""Added to every pod the webhook injects (value: the version); such a pod is never rewritten
again, whatever other webhooks add to it after us (reinvocationPolicy: IfNeeded)."""
ANNOTATION_PREFIX = "jitckpt.io/"
STORAGE_URI = ANNOTATION_PREFIX + "storage-uri"
SERVER_ONLY = ("image", "trainjob_runtime")
"""inject options a pod cannot choose: the sidecar image is the platform's."""
ANNOTATED: tuple[Option, ...] = tuple(
    o for o in OPTIONS if o.field not in (*SERVER_ONLY, "storage_uri")
)
"""The options a pod sets with the annotation jitckpt.io/<flag without -->."""
JOB_LABELS = (
    "jobset.sigs.k8s.io/jobset-name",  # JobSet and TrainJob: one name over all replicated jobs
    "training.kubeflow.org/job-name",  # PyTorchJob and the Training Operator's other jobs
    "batch.kubernetes.io/job-name",
    "job-name",
)
"""Labels naming the job a pod belongs to, most specific first: all pods of one job must share
one storage URI, and a JobSet's pods are owned by several Jobs."""
OUTCOMES = ("injected", "already_injected", "not_selected", "not_injected", "error")


def annotation(option: Option) -> str:
    return ANNOTATION_PREFIX + option.flag.removeprefix("--")


class BadReviewError(ValueError):
    """The body is not an AdmissionReview admission.k8s.io/v1 request: a 400."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the webhook was started with: inject's settings and where storage URIs come from."""

    defaults: Mapping[str, Any]
    """inject's option values from the webhook's flags, by field (typed)."""
    storage_uri_prefix: Optional[str] = None
    """s3://bucket/prefix; a pod without the storage-uri annotation gets
    <prefix>/<namespace>/<job name>."""


@dataclasses.dataclass
class Decision:
    """What was decided about one pod: `outcome` (one of OUTCOMES), the patch, the warnings."""

    outcome: str
    patch: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""
    """For the log: why the pod was left as it is."""


def parse(body: bytes) -> dict[str, Any]:
    """The AdmissionReview of a request body, or BadReviewError naming what is wrong."""
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadReviewError(f"the body is not JSON ({exc})") from None
    except RecursionError:
        raise BadReviewError("the body is JSON nested too deeply") from None
    if not isinstance(review, dict):
        raise BadReviewError("the body is not a JSON object")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != "AdmissionReview":
        raise BadReviewError(
            f"not an AdmissionReview {API_VERSION} (apiVersion {review.get('apiVersion')!r}, "
            f"kind {review.get('kind')!r}); set admissionReviewVersions: [v1]"
        )
    request = review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise BadReviewError("the AdmissionReview has no request with a uid")
    return review


def respond(review: Mapping[str, Any], decision: Decision) -> dict[str, Any]:
    """The AdmissionReview answer: always allowed; the patch and warnings when there are any."""
    response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": True}
    if decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(decision.patch).encode()).decode()
    if decision.warnings:
        response["warnings"] = [f"jitckpt: {w}" for w in decision.warnings]
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _field(obj: Any, key: str) -> dict[str, Any]:
    """obj[key] when both are mappings, else {} (the API server's objects, read defensively)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else {}


def pod_label(request: Mapping[str, Any]) -> str:
    """namespace/name of the pod for logs (generateName + '*' before the API server names it)."""
    meta = _field(_field(request, "object"), "metadata")
    name = meta.get("name") or f"{meta.get('generateName') or ''}*"
    return f"{request.get('namespace') or meta.get('namespace') or '?'}/{name}"


def decide(request: Mapping[str, Any], policy: Policy) -> Decision:
    """The decision for one AdmissionRequest; InjectError and SettingError become warnings."""
    pod = request.get("object")
    if not _is_pod_create(request) or not isinstance(pod, dict):
        return Decision("not_selected", reason="not a Pod CREATE")
    meta = _field(pod, "metadata")
    labels, annotations = _field(meta, "labels"), _field(meta, "annotations")
    if labels.get(LABEL) != "true":
        return Decision("not_selected", reason=f"no {LABEL}=true label")
    if INJECTED in annotations:
        return Decision("already_injected", reason=f"{INJECTED} is set")
    where = f"pod {pod_label(request)}"
    try:
        _check_owner(meta)
        uri = _storage_uri(request, meta, labels, annotations, policy)
        opts, grace = _options(annotations, uri, policy.defaults)
        if _from_pytorchjob(labels, pod):
            if opts.peers and "{node}" in opts.peers:
                raise InjectError(
                    f"{where}: a PyTorchJob's pods are <name>-master-0 and "
                    "<name>-worker-<rank-1>: give jitckpt.io/peers one URL per node, "
                    "comma-separated, not one with {node}"
                )
            if not opts.containers:
                opts = dataclasses.replace(opts, containers=(PYTORCHJOB_CONTAINER,))

        patched = copy.deepcopy(pod)
        spec = patched.get("spec")
        if isinstance(spec, dict) and (
            grace is not None or spec.get("terminationGracePeriodSeconds") == DEFAULT_GRACE
        ):
            spec["terminationGracePeriodSeconds"] = opts.grace_seconds
        report = Report()
        result, _ = inject_pod(spec, opts, where, report)  # type: ignore[arg-type]
        if opts.peers and _jobset_index_repeats(labels, spec):
            raise InjectError(
                f"{where}: a pod of a JobSet of several Jobs: each Job counts its completion "
                "index from 0, so jitckpt.io/peers needs PET_NODE_RANK in the training "
                "container's env set to the node's rank in the whole JobSet (e.g. from the "
                "jobset.sigs.k8s.io/job-global-index label when each Job has one pod)"
            )
    except JitckptError as exc:
        line = str(exc).removeprefix(f"{where}: ")
        for option in ANNOTATED:  # inject's advice names its flags; a pod has annotations
            line = line.replace(
                f"{option.flag} {option.metavar}", f"the annotation {annotation(option)}"
            )
            line = line.replace(option.flag, annotation(option))
        return Decision("not_injected", warnings=[f"not injected: {line}"], reason=line)
    if result == "unchanged":
        return Decision("already_injected", reason="its template was injected already")
    patched.setdefault("metadata", {}).setdefault("annotations", {})[INJECTED] = __version__
    warnings = [note.replace(f"{where}: ", "", 1) for note in report.notes]
    warnings += [
        f"annotation {key} is not one jitckpt reads; ignored"
        for key in annotations
        if key.startswith(ANNOTATION_PREFIX) and key not in KNOWN_ANNOTATIONS
    ]
    return Decision("injected", diff(pod, patched), warnings, f"storage {opts.storage_uri}")


_GRACE = next(o for o in ANNOTATED if o.field == "grace_seconds")
DEFAULT_GRACE = 30
"""What the API server fills in for a pod that sets no terminationGracePeriodSeconds: the
webhook cannot tell it from a choice, so it gives such pods inject's default (--grace-seconds)
as inject does; jitckpt.io/grace-seconds: "30" keeps 30."""
KNOWN_ANNOTATIONS = frozenset({STORAGE_URI, INJECTED, *(annotation(o) for o in ANNOTATED)})
WORKLOAD_OWNERS = frozenset(
    {"ReplicaSet", "StatefulSet", "DaemonSet", "ReplicationController", "Deployment"}
)
"""Controllers of long-running replicas, which inject refuses: their pods would share one
storage URI as unrelated runs."""


def _check_owner(meta: Mapping[str, Any]) -> None:
    for owner in meta.get("ownerReferences") or []:
        if (
            isinstance(owner, dict)
            and owner.get("controller")
            and owner.get("kind") in WORKLOAD_OWNERS
        ):
            raise InjectError(
                f"a pod of the {owner['kind']} {owner.get('name')!r}: its replicas would share "
                "one storage URI; run training in a Job, JobSet, TrainJob, PyTorchJob or Pod"
            )


def _is_pod_create(request: Mapping[str, Any]) -> bool:
    kind = _field(request, "kind")
    return (
        request.get("operation") == "CREATE"
        and kind.get("group", "") == ""
        and kind.get("kind") == "Pod"
        and not request.get("subResource")
    )


JOBSET_REPLICAS = (
    "jobset.sigs.k8s.io/replicatedjob-replicas",
    "jobset.sigs.k8s.io/global-replicas",
)
"""JobSet's labels on its pods: the Jobs of the pod's replicatedJob, and of the whole JobSet."""


def _jobset_index_repeats(labels: Mapping[str, Any], spec: Any) -> bool:
    """A pod of a JobSet of several Jobs whose sidecar (inject_pod's, in the patched `spec`)
    gets a Job's completion index for its node rank, which repeats across the Jobs."""
    if all(str(labels.get(label, "1")) == "1" for label in JOBSET_REPLICAS):
        return False
    return rank_source(sidecar_of(spec)) != "rank"


def _from_pytorchjob(labels: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """A Training Operator pod with several containers: its trainer is `pytorch`."""
    containers = _field(pod, "spec").get("containers")
    names = [c.get("name") for c in containers or [] if isinstance(c, dict)]
    return "training.kubeflow.org/job-name" in labels and PYTORCHJOB_CONTAINER in names


def _storage_uri(
    request: Mapping[str, Any],
    meta: Mapping[str, Any],
    labels: Mapping[str, Any],
    annotations: Mapping[str, Any],
    policy: Policy,
) -> str:
    """The annotation's URI, else <prefix>/<namespace>/<job name>; SettingError when neither."""
    own = annotations.get(STORAGE_URI)
    if own is not None:
        problem = shared.s3_uri_problem(str(own))
        if problem:
            raise _setting_error(STORAGE_URI, f"{own!r}{problem}")
        return str(own)
    if not policy.storage_uri_prefix:
        raise _setting_error(
            STORAGE_URI,
            "is not set and the webhook has no --storage-uri-prefix; set the annotation",
        )
    job = _job_name(meta, labels)
    if not job:
        raise _setting_error(
            STORAGE_URI,
            "is not set, and the pod belongs to no job (no owner and no job-name label) and has "
            "no name yet; set the annotation",
        )
    namespace = request.get("namespace") or meta.get("namespace") or "default"
    return f"{policy.storage_uri_prefix.rstrip('/')}/{namespace}/{job}"


def _job_name(meta: Mapping[str, Any], labels: Mapping[str, Any]) -> str:
    for label in JOB_LABELS:
        if labels.get(label):
            return str(labels[label])
    for owner in meta.get("ownerReferences") or []:
        if isinstance(owner, dict) and owner.get("controller") and owner.get("name"):
            return str(owner["name"])
    return str(meta.get("name") or "")


def _setting_error(key: str, rest: str) -> SettingError:
    return SettingError(f"annotation {key} ", rest)


def _options(
    annotations: Mapping[str, Any], storage_uri: str, defaults: Mapping[str, Any]
) -> tuple[Options, Optional[int]]:
    """inject's Options from the webhook's defaults and the pod's annotations, and the grace
    period the pod asked for with its annotation (None: keep the pod's own)."""
    values = {**defaults, "storage_uri": storage_uri}
    sources: dict[str, str] = {}
    for option in ANNOTATED:
        key = annotation(option)
        if key in annotations:
            raw = str(annotations[key])
            sources[option.field] = f"annotation {key}="
            parts = [p.strip() for p in raw.split(",") if p.strip()] if option.repeat else raw
            values[option.field] = option.convert(parts, sources[option.field])
    try:
        opts = Options(**values)
    except SettingError as exc:
        if exc.field not in sources:
            raise
        raise exc.named(sources[exc.field]) from None
    grace = opts.grace_seconds if _GRACE.field in sources else None
    return opts, grace


def diff(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """A JSONPatch (RFC 6902) from `old` to `new`: objects key by key, anything else replaced."""
    if isinstance(old, dict) and isinstance(new, dict):
        ops = [{"op": "remove", "path": f"{path}/{_escape(k)}"} for k in old if k not in new]
        for key, value in new.items():
            where = f"{path}/{_escape(key)}"
            if key not in old:
                ops.append({"op": "add", "path": where, "value": value})
            elif old[key] != value:
                ops.extend(diff(old[key], value, where))
        return ops
    return [] if old == new else [{"op": "replace", "path": path, "value": new}]


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def encode(answer: Mapping[str, Any]) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode()
