"""Kubernetes objects in tests: load YAML, find pod specs, validate against the bundled schemas.

kubernetes-validate bundles the core API schemas only. Custom resources (JobSet, TrainJob,
TrainingRuntime) are validated through the core types they embed: a JobSet's or a runtime's
job templates as batch/v1 Jobs, a TrainJob's trainer as a container of a v1 Pod.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from kubernetes_validate.utils import all_versions

from harness.procs import REPO

K8S = REPO / "k8s"
OLDEST = (1, 29)  # native sidecars are on by default from 1.29
VERSIONS = sorted(
    {v for v in all_versions() if tuple(int(p) for p in v.split(".")[:2]) >= OLDEST},
    key=lambda v: tuple(int(p) for p in v.split(".")),
)
CORE_API = (
    "v1",
    "batch/v1",
    "apps/v1",
    "policy/v1",
    "admissionregistration.k8s.io/v1",
    "rbac.authorization.k8s.io/v1",
)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[Path]:
    """Every Kubernetes YAML file under k8s/ (kustomizations are kustomize's input, not objects)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _name(doc: dict[str, Any]) -> str:
    return str((doc.get("metadata") or {}).get("name", "unnamed"))


def _job(name: str, spec: dict[str, Any], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"name": name, **{k: v for k, v in (metadata or {}).items() if k != "name"}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def core_objects(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:  # noqa: PLR0912
    """(label, core object) for `doc` itself or for the core types embedded in a CRD."""
    kind, api = doc["kind"], doc["apiVersion"]
    if kind == "List":
        for item in doc["items"]:
            yield from core_objects(item)
    elif api in CORE_API:
        yield f"{kind}/{_name(doc)}", doc
    elif kind == "JobSet":
        for rj in doc["spec"]["replicatedJobs"]:
            t = rj["template"]
            yield (
                f"JobSet/{_name(doc)} job {rj['name']}",
                _job(rj["name"], t["spec"], t.get("metadata")),
            )
    elif kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:
            t = rj["template"]
            yield (
                f"{kind}/{_name(doc)} job {rj['name']}",
                _job(rj["name"], t["spec"], t.get("metadata")),
            )
    elif kind == "PyTorchJob":  # each replica type's pod template, as the operator's pods
        for rtype, replica in doc["spec"]["pytorchReplicaSpecs"].items():
            t = replica["template"]
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {**t.get("metadata", {}), "name": f"{_name(doc)}-{rtype.lower()}"},
                   "spec": t["spec"]}  # fmt: skip
            yield f"PyTorchJob/{_name(doc)} {rtype}", pod
    elif kind == "TrainJob":
        trainer = doc["spec"]["trainer"]
        container = {"name": "node", "image": trainer.get("image", "runtime-image")}
        for key in ("command", "args", "env"):
            if key in trainer:
                container[key] = trainer[key]
        if "resourcesPerNode" in trainer:
            container["resources"] = trainer["resourcesPerNode"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": _name(doc)},
               "spec": {"containers": [container]}}  # fmt: skip
        yield f"TrainJob/{_name(doc)} trainer", pod
        for patch in doc["spec"].get("runtimePatches", []):
            jobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            for rj in jobs:
                spec = rj["template"]["spec"]["template"]["spec"]
                for c in spec.get("initContainers", []) + spec.get("containers", []):
                    # A container patch has no image; give it one to check the rest as a Container.
                    patched = {
                        "name": "patched",
                        "image": "patched",
                        **{k: v for k, v in c.items() if k != "name"},
                    }
                    yield (
                        f"TrainJob/{_name(doc)} runtimePatch {c['name']}",
                        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                         "spec": {"containers": [patched]}},
                    )  # fmt: skip


def validate(obj: dict[str, Any], version: str) -> str | None:
    """None when `obj` passes strict validation for `version`, else the error."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(str(p) for p in exc.caught.absolute_path)}: {exc.caught.message}"
    return None


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """(job spec or None, pod spec) for every pod template in a Pod, Job, JobSet, runtime or
    PyTorchJob (whose replica spec stands for the job spec)."""
    kind = doc["kind"]
    if kind == "Pod":
        yield None, doc["spec"]
    elif kind == "Job":
        yield doc["spec"], doc["spec"]["template"]["spec"]
    elif kind == "JobSet":
        for rj in doc["spec"]["replicatedJobs"]:
            yield rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    elif kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:
            yield rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    elif kind == "PyTorchJob":  # the replica spec (template, restartPolicy) stands for the job
        for replica in doc["spec"]["pytorchReplicaSpecs"].values():
            yield replica, replica["template"]["spec"]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod.get("containers", [])}
