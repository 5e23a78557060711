"""AdmissionReviews shaped like the API server's, for the webhook's tests.

The pods are what a controller creates from its template and the API server hands a mutating
webhook: defaults filled in (restartPolicy, dnsPolicy, terminationGracePeriodSeconds 30, the
containers' terminationMessagePath and imagePullPolicy), no name yet (generateName), the
controller's owner reference and labels, and the environment the controller adds (a PyTorchJob
operator's PET_* variables, an Indexed Job's completion index).
"""

from __future__ import annotations

import copy
import datetime
import itertools
from pathlib import Path
from typing import Any, Optional

import jsonpatch

from jitckpt_sidecar.webhook import admission

LABEL = {admission.LABEL: "true"}
_uids = itertools.count(1)


def container(name: str, command: Optional[list[str]] = None, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "image": "registry.example.com/team/train:1.0",
        "imagePullPolicy": "IfNotPresent",
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "resources": {},
    }
    if command is not None:
        c["command"] = command
    c.update(extra)
    return c


TORCHRUN = ["torchrun", "--nproc-per-node=2", "/app/train.py"]


def pod(
    containers: list[dict[str, Any]],
    *,
    labels: Optional[dict[str, str]] = None,
    annotations: Optional[dict[str, str]] = None,
    owner: Optional[tuple[str, str, str]] = None,
    name: str = "",
    generate_name: str = "train-",
    restart_policy: str = "Never",
) -> dict[str, Any]:
    """A defaulted v1 Pod; `owner` is (apiVersion, kind, name) of its controller."""
    meta: dict[str, Any] = {"namespace": "ml", "labels": dict(labels or {})}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = generate_name
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner:
        api, kind, owner_name = owner
        meta["ownerReferences"] = [
            {"apiVersion": api, "kind": kind, "name": owner_name, "uid": f"uid-{owner_name}",
             "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "containers": containers,
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "enableServiceLinks": True,
        },
    }


def job_pod(job: str = "llama", *, indexed: bool = False, **kw: Any) -> dict[str, Any]:
    """A pod of the batch/v1 Job `job` (an Indexed Job's pods carry the completion index)."""
    labels = {"batch.kubernetes.io/job-name": job, "job-name": job,
              "batch.kubernetes.io/controller-uid": f"uid-{job}", **LABEL,
              **kw.pop("labels", {})}  # fmt: skip
    env = []
    annotations = dict(kw.pop("annotations", {}))
    if indexed:
        labels["batch.kubernetes.io/job-completion-index"] = "1"
        annotations["batch.kubernetes.io/job-completion-index"] = "1"
        field = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": field}}}]
    containers = kw.pop("containers", None) or [container("trainer", TORCHRUN, env=env)]
    return pod(containers, labels=labels, annotations=annotations,
               owner=("batch/v1", "Job", job), generate_name=f"{job}-", **kw)  # fmt: skip


def jobset_pod(
    jobset: str = "llama", replicated_job: str = "node", index: int = 0
) -> dict[str, Any]:
    """A pod of JobSet `jobset` (or of a TrainJob, whose JobSet has its name): owned by the
    child Job <jobset>-<replicatedJob>-<index>."""
    job = f"{jobset}-{replicated_job}-{index}"
    labels = {"jobset.sigs.k8s.io/jobset-name": jobset,
              "jobset.sigs.k8s.io/replicatedjob-name": replicated_job,
              "jobset.sigs.k8s.io/job-index": str(index)}  # fmt: skip
    p = job_pod(job, labels=labels)
    p["spec"]["containers"][0]["name"] = "node"
    return p


def pytorchjob_pod(job: str = "llama", replica: str = "master", rank: int = 0) -> dict[str, Any]:
    """A PyTorchJob replica's pod as the Training Operator creates it: the `pytorch` container
    (with the operator's PET_* and MASTER_* variables) next to a log shipper."""
    env = [{"name": "PET_NNODES", "value": "3"}, {"name": "PET_NODE_RANK", "value": str(rank)},
           {"name": "PET_NPROC_PER_NODE", "value": "2"},
           {"name": "MASTER_ADDR", "value": f"{job}-master-0"},
           {"name": "MASTER_PORT", "value": "23456"}]  # fmt: skip
    labels = {"training.kubeflow.org/job-name": job,
              "training.kubeflow.org/operator-name": "pytorchjob-controller",
              "training.kubeflow.org/replica-type": replica,
              "training.kubeflow.org/replica-index": "0", **LABEL}  # fmt: skip
    containers = [container("pytorch", TORCHRUN, env=env),
                  container("log-shipper", ["fluent-bit"])]  # fmt: skip
    return pod(containers, labels=labels, owner=("kubeflow.org/v1", "PyTorchJob", job),
               name=f"{job}-{replica}-0", restart_policy="OnFailure")  # fmt: skip


def review(obj: Any, *, operation: str = "CREATE", namespace: str = "ml") -> dict[str, Any]:
    """An AdmissionReview admission.k8s.io/v1 request for `obj` (a pod)."""
    return {
        "apiVersion": admission.API_VERSION,
        "kind": "AdmissionReview",
        "request": {
            "uid": f"705ab4f5-6393-11e8-b7cc-{next(_uids):012d}",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def patched(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the response's JSONPatch applied by a JSON Patch library (unchanged without)."""
    import base64
    import json

    if "patch" not in response:
        return copy.deepcopy(obj)
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(obj, ops)  # type: ignore[no-any-return]


def tls_pair(directory: Path, name: str = "webhook", days: int = 2) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file
