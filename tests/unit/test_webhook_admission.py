"""The webhook's decisions (jitckpt_sidecar.webhook.admission), on AdmissionReviews shaped like
the API server's; the patches applied with a JSON Patch library. The HTTPS server around it is
tests/integration/test_webhook.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest

from harness.admission import (
    LABEL,
    TORCHRUN,
    container,
    job_pod,
    jobset_pod,
    patched,
    pod,
    pytorchjob_pod,
    review,
)
from jitckpt_sidecar.inject import Options, inject_text
from jitckpt_sidecar.inject.rewrite import Report, inject_pod
from jitckpt_sidecar.webhook import admission
from jitckpt_sidecar.webhook import cli as webhook_cli

IMAGE = "registry.example.com/platform/jitckpt-sidecar:0.1.0"
POLICY = admission.Policy({"image": IMAGE}, "s3://ckpt-bucket/jit")


def run(obj: Any, policy: admission.Policy = POLICY, **kw: Any) -> tuple[Any, dict, Any]:
    """(decision, the AdmissionResponse, the pod with its patch applied)."""
    rev = review(obj, **kw)
    decision = admission.decide(rev["request"], policy)
    answer = admission.respond(rev, decision)
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == rev["request"]["uid"]
    assert response["allowed"] is True
    return decision, response, patched(obj, response)


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def sidecar(p: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in p["spec"]["initContainers"] if c["name"] == "jitckpt-sidecar")


def test_a_labelled_job_pod_gets_exactly_injects_rewrite() -> None:
    """One implementation, two front doors: the patched pod is what inject_pod makes of it."""
    original = job_pod("llama")
    decision, response, result = run(original)
    assert decision.outcome == "injected", decision
    expected = copy.deepcopy(original)  # as written: 30 is the API server's default
    del expected["spec"]["terminationGracePeriodSeconds"]
    opts = Options(storage_uri="s3://ckpt-bucket/jit/ml/llama", image=IMAGE)
    inject_pod(expected["spec"], opts, "pod", Report())
    assert result["spec"] == expected["spec"]
    assert result["metadata"]["annotations"] == {admission.INJECTED: "0.1.0"}
    trainer = result["spec"]["containers"][0]
    assert trainer["command"][:3] == ["python3", "/jitckpt/jitckpt-entrypoint", "--"]
    assert env(sidecar(result))["JITCKPT_STORAGE_URI"] == "s3://ckpt-bucket/jit/ml/llama"
    # The patch touches what it adds and nothing else (a JSONPatch, not a replaced pod).
    ops = json.loads(__import__("base64").b64decode(response["patch"]))
    assert {op["path"] for op in ops} == {
        "/metadata/annotations", "/spec/containers", "/spec/initContainers", "/spec/volumes",
        "/spec/terminationGracePeriodSeconds",
    }  # fmt: skip
    assert result["spec"]["terminationGracePeriodSeconds"] == 120  # inject's default
    assert "warnings" not in response


def test_an_injected_pod_is_never_injected_again() -> None:
    _, _, once = run(job_pod())
    decision, response, twice = run(once)
    assert decision.outcome == "already_injected"
    assert "patch" not in response
    assert twice == once
    # Another webhook added a container after ours (reinvocationPolicy: IfNeeded): still ours.
    once["spec"]["containers"].append(container("istio-proxy", ["pilot-agent"]))
    assert run(once)[0].outcome == "already_injected"


def test_a_pod_from_a_template_inject_already_rewrote_is_left_alone() -> None:
    pod_spec = {"restartPolicy": "Never", "containers": [container("trainer", TORCHRUN)]}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "llama"},
           "spec": {"template": {"spec": pod_spec}}}  # fmt: skip
    text, _ = inject_text(json.dumps(job), Options(storage_uri="s3://ckpt-bucket/x"))
    import yaml

    spec = yaml.safe_load(text)["spec"]["template"]["spec"]
    p = job_pod("llama")
    p["spec"].update(spec)
    decision, response, _ = run(p)
    assert decision.outcome == "already_injected"
    assert "patch" not in response


@pytest.mark.parametrize(
    ("pods", "uri"),
    [
        ([job_pod("llama"), job_pod("llama")], "s3://ckpt-bucket/jit/ml/llama"),
        # A JobSet's (and a TrainJob's) pods are owned by several child Jobs: one URI anyway.
        ([jobset_pod("sft", "node", 0), jobset_pod("sft", "node", 1), jobset_pod("sft", "head")],
         "s3://ckpt-bucket/jit/ml/sft"),
        ([pytorchjob_pod("ddp", "master", 0), pytorchjob_pod("ddp", "worker", 1)],
         "s3://ckpt-bucket/jit/ml/ddp"),
        ([pod([container("t", TORCHRUN)], labels=LABEL, name="solo")],
         "s3://ckpt-bucket/jit/ml/solo"),
    ],
    ids=["job", "jobset-or-trainjob", "pytorchjob", "bare-pod"],
)  # fmt: skip
def test_all_pods_of_one_job_share_one_storage_uri(pods: list[Any], uri: str) -> None:
    for p in pods:
        decision, _, result = run(p)
        assert decision.outcome == "injected", decision
        assert env(sidecar(result))["JITCKPT_STORAGE_URI"] == uri
        trainer = next(c for c in result["spec"]["containers"] if "JITCKPT_STORAGE_URI" in env(c))
        assert env(trainer)["JITCKPT_STORAGE_URI"] == uri


def test_the_storage_uri_annotation_wins_over_the_prefix() -> None:
    p = job_pod("llama", annotations={"jitckpt.io/storage-uri": "s3://team-bucket/runs/7"})
    _, _, result = run(p)
    assert env(sidecar(result))["JITCKPT_STORAGE_URI"] == "s3://team-bucket/runs/7"


def test_a_pytorchjob_pod_trains_in_pytorch_and_its_sidecar_knows_the_node_rank() -> None:
    """The operator sets PET_* in the pod it creates: unlike inject (which sees only the
    template), the webhook hands them to the sidecar, so a node restores only its share."""
    decision, _, result = run(pytorchjob_pod("ddp", "worker", 2))
    assert decision.outcome == "injected"
    pytorch, shipper = result["spec"]["containers"]
    assert pytorch["command"][1] == "/jitckpt/jitckpt-entrypoint"
    assert shipper["command"] == ["fluent-bit"]
    assert "env" not in shipper
    assert env(sidecar(result))["JITCKPT_NODE_RANK"] == "2"
    assert env(sidecar(result))["JITCKPT_NNODES"] == "3"


def test_an_indexed_job_pod_gives_its_sidecar_the_completion_index() -> None:
    _, _, result = run(job_pod("llama", indexed=True))
    assert env(sidecar(result))["JOB_COMPLETION_INDEX"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }


def test_annotations_set_injects_options() -> None:
    p = job_pod(
        "llama",
        annotations={
            "jitckpt.io/capacity": "200Gi",
            "jitckpt.io/grace-seconds": "300",
            "jitckpt.io/sidecar-mode": "container",
            "jitckpt.io/secret": "s3-creds",
        },
    )
    decision, response, result = run(p)
    assert decision.outcome == "injected"
    spec = result["spec"]
    assert spec["terminationGracePeriodSeconds"] == 300
    assert "warnings" not in response
    assert [c["name"] for c in spec["initContainers"]] == ["jitckpt-install", "jitckpt-restore"]
    side = next(c for c in spec["containers"] if c["name"] == "jitckpt-sidecar")
    assert env(side)["JITCKPT_STORAGE_CAPACITY"] == "200Gi"
    assert side["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert side["image"] == IMAGE  # the platform's image: a pod cannot pick another
    volume = next(v for v in spec["volumes"] if v["name"] == "jitckpt")
    assert volume["emptyDir"]["sizeLimit"] == "200Gi"


def test_peer_annotations_set_up_the_peer_replica_and_need_the_memory_and_the_secret() -> None:
    """jitckpt.io/peers and jitckpt.io/peer-secret (a job's own: no webhook-wide defaults)."""
    peers = {"jitckpt.io/peers": "http://llama-{node}.llama:9402"}
    full = {**peers, "jitckpt.io/memory": "8Gi", "jitckpt.io/peer-secret": "llama-peer"}
    decision, _, result = run(job_pod("llama", indexed=True, annotations=full))
    assert decision.outcome == "injected", decision
    side = next(c for c in result["spec"]["initContainers"] if c["name"] == "jitckpt-sidecar")
    assert env(side)["JITCKPT_PEERS"] == "http://llama-{node}.llama:9402"
    assert any(v["name"] == "JITCKPT_PEER_TOKEN" and "valueFrom" in v for v in side["env"])
    decision, _, _ = run(job_pod("llama", annotations=full))  # no node rank: not an Indexed Job
    assert decision.outcome == "not_injected"
    assert "needs each pod's node rank" in decision.reason, decision
    lacking = {**peers, "jitckpt.io/memory": "8Gi"}
    decision, _, _ = run(job_pod("llama", indexed=True, annotations=lacking))
    assert decision.outcome == "not_injected"
    assert "jitckpt.io/peers='http://llama-{node}.llama:9402' needs jitckpt.io/peer-secret" in (
        decision.reason
    )
    assert not {"--peers", "--peer-secret"} & {o.flag for o in webhook_cli.DEFAULTS}
    jobset = job_pod("llama", indexed=True, annotations=full,
                     labels={"jobset.sigs.k8s.io/replicatedjob-replicas": "2"})  # fmt: skip
    decision, _, _ = run(jobset)  # each Job's completion index starts at 0
    assert "needs PET_NODE_RANK" in decision.reason, decision
    global_only = {"jobset.sigs.k8s.io/replicatedjob-replicas": "1",
                   "jobset.sigs.k8s.io/global-replicas": "2"}  # fmt: skip
    decision, _, _ = run(job_pod("llama", indexed=True, annotations=full, labels=global_only))
    assert "needs PET_NODE_RANK" in decision.reason, decision  # two replicatedJobs of one Job
    index = {
        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-completion-index']"}
    }
    by_index = [{"name": "PET_NODE_RANK", "valueFrom": index}]
    sidekick = [{"name": "PET_NODE_RANK", "value": "3"}]
    for containers in (
        [container("trainer", TORCHRUN, env=by_index)],  # the index again
        [container("trainer", TORCHRUN), container("proxy", ["envoy"], env=sidekick)],
    ):
        other = {**full, "jitckpt.io/container": "trainer"}
        pod_ = job_pod("llama", indexed=True, annotations=other, containers=containers,
                       labels={"jobset.sigs.k8s.io/replicatedjob-replicas": "2"})  # fmt: skip
        decision, _, _ = run(pod_)
        assert decision.outcome == "not_injected", decision
        assert "PET_NODE_RANK" in decision.reason, decision
    own = [container("trainer", TORCHRUN, env=[{"name": "PET_NODE_RANK", "value": "3"}])]
    two = {"jobset.sigs.k8s.io/replicatedjob-replicas": "2"}
    decision, _, _ = run(job_pod("llama", annotations=full, containers=own, labels=two))
    assert decision.outcome == "injected", decision
    rank = [{"name": "PET_NODE_RANK", "value": "1"}]  # the Training Operator's, on each pod
    operators = job_pod(
        "llama",
        labels={"training.kubeflow.org/job-name": "llama"},
        containers=[container("pytorch", TORCHRUN, env=rank)],
        annotations=full,
    )
    decision, _, _ = run(operators)  # master-0, worker-0, ...: no one {node} names them
    assert "one URL per node" in decision.reason, decision
    urls = "http://llama-master-0.llama:9402,http://llama-worker-0.llama:9402"
    operators["metadata"]["annotations"]["jitckpt.io/peers"] = urls
    decision, _, _ = run(operators)
    assert decision.outcome == "injected", decision


def test_the_container_annotation_picks_the_trainer() -> None:
    p = job_pod(containers=[container("trainer", TORCHRUN), container("proxy", ["envoy"])],
                annotations={"jitckpt.io/container": "trainer"})  # fmt: skip
    decision, _, result = run(p)
    assert decision.outcome == "injected"
    assert result["spec"]["containers"][1]["command"] == ["envoy"]


@pytest.mark.parametrize(
    ("obj", "needles"),
    [
        (job_pod(containers=[container("trainer", TORCHRUN), container("proxy", ["envoy"])]),
         ["2 containers (trainer, proxy)", "jitckpt.io/container"]),
        (job_pod(containers=[container("trainer")]), ["has no command"]),
        (job_pod(containers=[container("trainer", ["tini", "--", *TORCHRUN])]), ["'tini'"]),
        (job_pod(annotations={"jitckpt.io/capacity": "lots"}), ["annotation jitckpt.io/capacity="]),
        (job_pod(annotations={"jitckpt.io/grace-seconds": "0"}),
         ["annotation jitckpt.io/grace-seconds=", "is invalid"]),
        (job_pod(annotations={"jitckpt.io/storage-uri": "https://x/y"}),
         ["annotation jitckpt.io/storage-uri"]),
        (job_pod(annotations={"jitckpt.io/container": "nope"}), ["no container named nope"]),
        (pod([container("t", TORCHRUN)], labels=LABEL), ["belongs to no job"]),
        (pod([container("t", TORCHRUN)], labels=LABEL, owner=("apps/v1", "StatefulSet", "db")),
         ["a pod of the StatefulSet 'db'", "run training in a Job"]),
        (pod([container("t", TORCHRUN)], labels=LABEL, owner=("apps/v1", "ReplicaSet", "w-5d")),
         ["a pod of the ReplicaSet 'w-5d'"]),
        (job_pod(annotations={"jitckpt.io/storage-uri": ""}),
         ["annotation jitckpt.io/storage-uri"]),
        (job_pod(annotations={"jitckpt.io/python": "python3 -X dev"}),
         ["annotation jitckpt.io/python=", "no spaces"]),
    ],
    ids=["two-containers", "no-command", "tini", "bad-capacity", "bad-grace", "bad-uri",
         "unknown-container", "unnamed-bare-pod", "statefulset", "replicaset", "empty-uri",
         "python-with-spaces"],
)  # fmt: skip
def test_a_pod_it_cannot_inject_safely_is_allowed_unchanged_with_a_warning(
    obj: Any, needles: list[str]
) -> None:
    decision, response, result = run(obj)
    assert decision.outcome == "not_injected"
    assert "patch" not in response
    assert result == obj
    [warning] = response["warnings"]
    assert warning.startswith("jitckpt: not injected: ")
    for needle in needles:
        assert needle in warning
    assert "--container" not in warning


def test_without_a_prefix_a_pod_needs_the_annotation() -> None:
    decision, response, _ = run(job_pod(), admission.Policy({}, None))
    assert decision.outcome == "not_injected"
    assert "jitckpt.io/storage-uri" in response["warnings"][0]
    annotated = job_pod(annotations={"jitckpt.io/storage-uri": "s3://team-bucket/a"})
    assert run(annotated, admission.Policy({}, None))[0].outcome == "injected"


@pytest.mark.parametrize(
    ("obj", "kw"),
    [
        (job_pod(labels={admission.LABEL: "false"}), {}),
        ({**job_pod(), "metadata": {"generateName": "x-", "labels": {}}}, {}),
        (job_pod(), {"operation": "UPDATE"}),
        ({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}, {}),
    ],
    ids=["label-false", "no-label", "update", "not-a-pod"],
)
def test_pods_not_selected_pass_without_a_patch_or_warning(obj: Any, kw: dict) -> None:
    rev = review(obj, **kw)
    if obj["kind"] != "Pod":
        rev["request"]["kind"] = {"group": "", "version": "v1", "kind": "ConfigMap"}
    decision = admission.decide(rev["request"], POLICY)
    assert decision.outcome == "not_selected"
    response = admission.respond(rev, decision)["response"]
    assert response == {"uid": rev["request"]["uid"], "allowed": True}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "not JSON"),
        (json.dumps({**review(job_pod()), "apiVersion": "admission.k8s.io/v1beta1"}).encode(),
         "admissionReviewVersions: [v1]"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(),
         "no request with a uid"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ],
    ids=["not-json", "not-object", "not-utf8", "v1beta1", "no-request", "deep"],
)  # fmt: skip
def test_a_body_that_is_not_an_admission_review_is_refused(body: bytes, needle: str) -> None:
    with pytest.raises(
        admission.BadReviewError, match=needle.replace("[", r"\[").replace("]", r"\]")
    ):
        admission.parse(body)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"a": 1}, {"a": 1}),
        ({"a": {"b/c": 1, "d~e": [1]}}, {"a": {"b/c": 2, "d~e": [1, 2], "f": None}}),
        ({"a": [1, 2], "gone": {"x": 1}}, {"a": {"now": "a map"}}),
        ({}, {"metadata": {"annotations": {"jitckpt.io/injected": "1"}}}),
    ],
)
def test_diff_is_a_json_patch_from_old_to_new(old: Any, new: Any) -> None:
    ops = admission.diff(old, new)
    assert jsonpatch.apply_patch(copy.deepcopy(old), ops) == new
    assert (ops == []) == (old == new)


def test_the_webhook_and_inject_give_a_pytorchjob_replica_the_same_pod() -> None:
    """k8s/pytorchjob/pytorchjob.orig.yaml through inject, and its Master pod (as the operator
    creates it, before its own environment) through the webhook: the same pod spec, so the
    `podman kube play` run of the webhook's pod (tests/images) stands for inject's too."""
    import yaml

    from harness.procs import REPO

    text = (REPO / "k8s" / "pytorchjob" / "pytorchjob.orig.yaml").read_text()
    opts = Options(storage_uri="s3://ckpt-bucket/jit/ml/llama-finetune-ddp", image=IMAGE)
    injected = yaml.safe_load(inject_text(text, opts)[0])
    original = yaml.safe_load(text)
    for replica in ("Master", "Worker"):
        template = original["spec"]["pytorchReplicaSpecs"][replica]["template"]
        labels = {**template["metadata"]["labels"], **LABEL,
                  "training.kubeflow.org/job-name": "llama-finetune-ddp"}  # fmt: skip
        p = pod(template["spec"]["containers"], labels=labels,
                owner=("kubeflow.org/v1", "PyTorchJob", "llama-finetune-ddp"),
                name=f"llama-finetune-ddp-{replica.lower()}-0")  # fmt: skip
        p["spec"] = {**template["spec"]}
        decision, _, result = run(p)
        assert decision.outcome == "injected"
        expected = injected["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
        assert result["spec"] == expected, replica


def test_an_unknown_jitckpt_annotation_is_a_warning_not_a_silent_default() -> None:
    p = job_pod(annotations={"jitckpt.io/grace-second": "300", "jitckpt.io/image": "evil:1"})
    decision, response, result = run(p)
    assert decision.outcome == "injected"
    assert result["spec"]["terminationGracePeriodSeconds"] == 120
    assert sidecar(result)["image"] == IMAGE
    assert sorted(response["warnings"]) == [
        "jitckpt: annotation jitckpt.io/grace-second is not one jitckpt reads; ignored",
        "jitckpt: annotation jitckpt.io/image is not one jitckpt reads; ignored",
    ]


def test_a_grace_period_the_pod_chose_is_kept_and_30_becomes_injects_default() -> None:
    """The API server writes 30 where a template sets nothing: like inject, the webhook gives
    such pods --grace-seconds; another value is the pod's own; the annotation wins over both."""
    chosen = job_pod()
    chosen["spec"]["terminationGracePeriodSeconds"] = 600
    assert run(chosen)[2]["spec"]["terminationGracePeriodSeconds"] == 600
    policy = admission.Policy({"image": IMAGE, "grace_seconds": 240}, "s3://ckpt-bucket/jit")
    assert run(job_pod(), policy)[2]["spec"]["terminationGracePeriodSeconds"] == 240
    keep = job_pod(annotations={"jitckpt.io/grace-seconds": "30"})
    result = run(keep)[2]
    assert result["spec"]["terminationGracePeriodSeconds"] == 30
    assert env(sidecar(result))["JITCKPT_GRACE_SECONDS"] == "30"


def test_the_webhook_takes_injects_flags_but_those_that_have_no_use_for_pods() -> None:
    from jitckpt_sidecar.webhook import cli

    text = cli._parser().format_help()
    for flag in ("--image", "--secret", "--capacity", "--grace-seconds", "--sidecar-mode"):
        assert flag in text
    for flag in ("--storage-uri ", "--container ", "--trainjob-runtime"):
        assert flag not in text
