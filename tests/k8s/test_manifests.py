"""k8s/ (make k8s-check): every object validates strictly for Kubernetes 1.29 to the newest
bundled schema, the settings that must agree do agree, and the monitoring objects reference
only metrics the sidecar exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from harness.k8s import (
    CORE_API,
    K8S,
    VERSIONS,
    containers,
    core_objects,
    env_of,
    load_all,
    manifest_files,
    pod_specs,
    validate,
)
from jitckpt_sidecar import inject
from jitckpt_sidecar.metric_names import LABEL_VALUES, METRICS, series_names
from jitckpt_sidecar.webhook import admission
from jitckpt_sidecar.webhook import cli as webhook_cli

FILES = manifest_files()
DOCS = [(p, d) for p in FILES for d in load_all(p)]
# *.orig.yaml: a team's YAML before inject (the input of the generated examples).
WORKLOADS = [(p, d) for p, d in DOCS if list(pod_specs(d)) and not p.name.endswith(".orig.yaml")]
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
RULES = yaml.safe_load((K8S / "monitoring" / "prometheusrule.yaml").read_text())
DASHBOARD = json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def rel(path: Path) -> str:
    return str(path.relative_to(K8S))


def test_the_versions_checked_span_1_29_to_the_newest_bundled_schema():
    """Native sidecars need 1.29; the newest kubernetes-validate knows must be included."""
    assert VERSIONS[0].startswith("1.29")
    assert len(VERSIONS) >= 9  # 1.29 ... 1.37 with kubernetes-validate 1.37.0


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    """Every core object, and every core type embedded in a custom resource, passes
    `kubernetes-validate --strict` for this Kubernetes version."""
    errors, checked = [], 0
    for path, doc in DOCS:
        for label, obj in core_objects(doc):
            checked += 1
            error = validate(obj, version)
            if error:
                errors.append(f"{rel(path)} {label}: {error}")
    assert not errors, "\n".join(errors)
    assert checked >= 10


def test_custom_resources_are_only_the_known_ones():
    """Anything not validated against a core schema is one of the CRDs we check by hand."""
    kinds = {d["kind"] for _, d in DOCS if d["apiVersion"] not in CORE_API}
    assert kinds <= {"TrainJob", "TrainingRuntime", "PyTorchJob", "PodMonitor", "PrometheusRule",
                     "Certificate", "Issuer", "ServiceMonitor"}  # fmt: skip


WEBHOOK = {(d["kind"], d["metadata"]["name"]): d
           for d in load_all(K8S / "webhook" / "webhook.yaml")
           + load_all(K8S / "webhook" / "certificate.yaml")}  # fmt: skip


def test_the_webhook_deployment_certificate_and_configuration_agree():
    """k8s/webhook/: the MutatingWebhookConfiguration selects the label the webhook injects,
    never blocks a pod (Ignore, 5 s, no side effects), reaches the Service that reaches the
    Deployment's port, and trusts the CA of the Certificate whose Secret the pods mount; two
    replicas under a PodDisruptionBudget, locked down, with arguments the webhook accepts."""
    config = WEBHOOK[("MutatingWebhookConfiguration", "jitckpt-webhook")]
    [hook] = config["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {admission.LABEL: "true"}}
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == (
        "Ignore",
        "None",
        5,
    )
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                              "resources": ["pods"], "scope": "Namespaced"}]  # fmt: skip
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == "/mutate"
    service = WEBHOOK[("Service", ref["name"])]
    assert service["metadata"]["namespace"] == ref["namespace"]
    [port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    deployment = WEBHOOK[("Deployment", "jitckpt-webhook")]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [c] = pod["spec"]["containers"]
    [named] = [p for p in c["ports"] if p["name"] == port["targetPort"]]
    cfg, policy, _ = webhook_cli.parse(c["args"][1:])
    assert c["args"][0] == "webhook"
    assert named["containerPort"] == cfg.port
    assert policy.storage_uri_prefix
    assert policy.defaults["image"].startswith("jitckpt-sidecar:")
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"] == {"scheme": "HTTPS", "path": "/healthz", "port": "https"}
    cert = WEBHOOK[("Certificate", "jitckpt-webhook")]
    namespace = ref["namespace"]
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{cert['metadata']['namespace']}/{cert['metadata']['name']}"
    )
    assert f"{ref['name']}.{namespace}.svc" in cert["spec"]["dnsNames"]
    [tls] = [v for v in pod["spec"]["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == cert["spec"]["secretName"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "tls"]
    assert cfg.tls_cert_file == f"{mount['mountPath']}/tls.crt"
    # Signed by a CA of its own (stable across renewals), not self-signed.
    issuer = WEBHOOK[("Issuer", cert["spec"]["issuerRef"]["name"])]
    ca = WEBHOOK[("Certificate", "jitckpt-webhook-ca")]
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert ca["spec"]["isCA"] is True
    assert "selfSigned" in WEBHOOK[("Issuer", ca["spec"]["issuerRef"]["name"])]["spec"]
    assert deployment["spec"]["replicas"] == 2
    pdb = WEBHOOK[("PodDisruptionBudget", "jitckpt-webhook")]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert not [d for d in WEBHOOK.values() if d["kind"] in ("Role", "ClusterRole")]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: rel(p) or ".")
def test_each_kustomization_builds_and_its_output_validates(directory):
    """`kubectl kustomize DIR` renders, and what it renders validates for the newest version."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs
    errors = [
        f"{label}: {err}"
        for d in docs
        for label, obj in core_objects(d)
        if (err := validate(obj, VERSIONS[-1]))
    ]
    assert not errors, "\n".join(errors)


def quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert match, text
    return int(match.group(1)) * QUANTITY.get(match.group(2) or "", 1)


def pods_with_sidecar():
    for path, doc in WORKLOADS:
        for job, pod in pod_specs(doc):
            if "jitckpt-sidecar" in containers(pod):
                yield path, doc, job, pod


POD_CASES = list(pods_with_sidecar())
POD_IDS = [f"{rel(p)}:{d['kind']}" for p, d, _, _ in POD_CASES]


PVC = K8S / "pvc"


def test_every_workload_but_pvc_mode_runs_the_sidecar():
    """Each Job and runtime in k8s/ carries the jitckpt sidecar; PVC mode (no S3) has none."""
    with_sidecar = {rel(p) for p, *_ in POD_CASES}
    assert {rel(p) for p, _ in WORKLOADS} - with_sidecar == {"pvc/job.yaml"}
    assert len(POD_CASES) >= 5


def trainers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in pod["containers"] if c["name"] != "jitckpt-sidecar"]


@pytest.mark.parametrize(("path", "doc", "job", "pod"), POD_CASES, ids=POD_IDS)
def test_settings_that_must_agree_do(path, doc, job, pod):
    """Grace period = JITCKPT_GRACE_SECONDS, sizeLimit = JITCKPT_STORAGE_CAPACITY, the same
    storage URI and JITCKPT_DIR on both sides, the ignored exit code = JITCKPT_EXIT_CODE (a Job
    whose trainers restart in place, restartPolicy OnFailure, may have no podFailurePolicy)."""
    sidecar = containers(pod)["jitckpt-sidecar"]
    side_env = env_of(sidecar)
    grace = pod["terminationGracePeriodSeconds"]
    assert side_env["JITCKPT_GRACE_SECONDS"] == str(grace)
    volume = next(v for v in pod["volumes"] if v["name"] == "jitckpt")
    assert quantity(volume["emptyDir"]["sizeLimit"]) == quantity(
        side_env["JITCKPT_STORAGE_CAPACITY"]
    )
    assert {"name": "jitckpt", "mountPath": side_env["JITCKPT_DIR"]} in sidecar["volumeMounts"]
    for trainer in trainers(pod):
        env = env_of(trainer)
        assert env["JITCKPT_GRACE_SECONDS"] == str(grace)
        assert env["JITCKPT_DIR"] == side_env["JITCKPT_DIR"]
        if doc["kind"] != "TrainingRuntime":  # a TrainJob sets it per job (trainjob.yaml)
            assert env["JITCKPT_STORAGE_URI"] == side_env["JITCKPT_STORAGE_URI"]
        assert any(m["mountPath"] == env["JITCKPT_DIR"] for m in trainer["volumeMounts"])
        if doc["kind"] == "PyTorchJob":  # the operator retries exit codes >= 128 (the JIT's)
            assert job["restartPolicy"] == "ExitCode"
            assert int(env.get("JITCKPT_EXIT_CODE", "143")) >= 128
            return
        if pod["restartPolicy"] == "OnFailure":
            assert "podFailurePolicy" not in job
            return
        rules = job["podFailurePolicy"]["rules"]
        assert {
            "action": action(doc),
            "onExitCodes": {
                "containerName": trainer["name"],
                "operator": "In",
                "values": [int(env.get("JITCKPT_EXIT_CODE", "143"))],
            },
        } in rules
    assert {
        "action": action(doc),
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    } in job["podFailurePolicy"]["rules"]
    assert pod["restartPolicy"] == "Never"


@pytest.mark.parametrize(("path", "doc", "job", "pod"), POD_CASES, ids=POD_IDS)
def test_a_memory_volume_is_the_same_on_both_sides_and_counted_in_the_trainers_memory(
    path, doc, job, pod
):
    """The RAM tier where a manifest has it: one JITCKPT_MEMORY_DIR for the trainer and the
    sidecar, the volume `medium: Memory`, read-only in the sidecar without the peer replica,
    and the trainer's memory request and limit above the volume's size (its pages count
    there)."""
    volume = next((v for v in pod["volumes"] if v["name"] == "jitckpt-memory"), None)
    if volume is None:
        assert all("JITCKPT_MEMORY_DIR" not in env_of(c) for c in pod["containers"])
        return
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity(volume["emptyDir"]["sizeLimit"])
    sidecar = containers(pod)["jitckpt-sidecar"]
    path_ = env_of(sidecar)["JITCKPT_MEMORY_DIR"]
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "jitckpt-memory")
    assert mount["mountPath"] == path_
    assert mount.get("readOnly") is ("JITCKPT_PEERS" not in env_of(sidecar) or None)
    for trainer in trainers(pod):
        assert env_of(trainer)["JITCKPT_MEMORY_DIR"] == path_
        assert {"name": "jitckpt-memory", "mountPath": path_} in trainer["volumeMounts"]
        for kind in ("requests", "limits"):
            assert quantity(trainer["resources"][kind]["memory"]) > size, kind


def action(doc: dict[str, Any]) -> str:
    """A Job ignores a preemption and a JIT exit; a JobSet's Job fails on them, and the JobSet
    restarts every Job without counting it (test_a_jobset_restarts_on_preemption...)."""
    return "FailJob" if doc["kind"] in ("TrainingRuntime", "ClusterTrainingRuntime") else "Ignore"


def test_a_jobset_restarts_on_preemption_and_jit_exits_without_counting_them():
    """The runtime's JobSet rule names exactly its Jobs' two FailJob rules, by index, in the
    Kubernetes Job controller's failure messages (`Pod ns/name has condition DisruptionTarget
    matching FailJob rule at index 0`, `Container node for pod ns/name failed with exit code
    143 matching FailJob rule at index 1`); a crash fails the Job at once and is counted."""
    runtime = load_all(K8S / "trainjob" / "runtime.yaml")[0]
    jobset = runtime["spec"]["template"]["spec"]
    (rule,) = jobset["failurePolicy"]["rules"]
    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
    assert (rule["action"], rule["onJobFailureReasons"]) == (
        "RestartJobSetAndIgnoreMaxRestarts",
        ["PodFailurePolicy"],
    )
    assert jobset["failurePolicy"]["maxRestarts"] >= 1
    for replicated in jobset["replicatedJobs"]:
        job = replicated["template"]["spec"]
        assert job["backoffLimit"] == 0
        pod = job["template"]["spec"]
        messages = []
        for index, r in enumerate(job["podFailurePolicy"]["rules"]):
            if "onPodConditions" in r:
                (condition,) = r["onPodConditions"]
                messages.append(
                    f"Pod ns/p has condition {condition['type']} matching {r['action']} rule "
                    f"at index {index}"
                )
            else:
                codes = r["onExitCodes"]
                (code,) = codes["values"]
                messages.append(
                    f"Container {codes['containerName']} for pod ns/p failed with exit code "
                    f"{code} matching {r['action']} rule at index {index}"
                )
                assert code == int(env_of(trainers(pod)[0]).get("JITCKPT_EXIT_CODE", "143"))
        patterns = rule["onJobFailureMessagePatterns"]
        assert len(messages) == len(patterns) == 2
        for message, pattern in zip(messages, patterns):
            assert re.search(pattern, message), (pattern, message)
        assert not any(re.search(p, messages[0].replace("index 0", "index 2")) for p in patterns)


@pytest.mark.parametrize(("path", "doc", "job", "pod"), POD_CASES, ids=POD_IDS)
def test_the_sidecar_gates_training_on_the_restore(path, doc, job, pod):
    """A native sidecar has a startupProbe on /readyz; without native sidecars a `restore`
    init container runs first and the sidecar exits with the trainer."""
    sidecar = containers(pod)["jitckpt-sidecar"]
    port = next(p for p in sidecar["ports"] if p["name"] == "jitckpt-metrics")
    assert str(port["containerPort"]) == env_of(sidecar)["JITCKPT_METRICS_PORT"] == "9402"
    if sidecar in pod.get("initContainers", []):
        assert sidecar["restartPolicy"] == "Always"
        assert sidecar["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "jitckpt-metrics"}
    else:
        restore = containers(pod)["jitckpt-restore"]
        assert restore["command"] == ["jitckpt-sidecar", "restore"]
        assert env_of(sidecar)["JITCKPT_EXIT_WITH_TRAINER"] == "1"
        assert env_of(sidecar)["JITCKPT_RESTART_POLICY"] == pod["restartPolicy"]
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"


def pvc_job() -> tuple[dict[str, Any], dict[str, Any]]:
    (doc,) = load_all(PVC / "job.yaml")
    ((job, pod),) = list(pod_specs(doc))
    return job, pod


@pytest.mark.parametrize(
    ("path", "doc", "job", "pod"),
    [*POD_CASES, (PVC / "job.yaml", None, *pvc_job())],
    ids=[*POD_IDS, "pvc/job.yaml:Job"],
)
def test_containers_are_locked_down(path, doc, job, pod):
    """Our containers and base-image trainers: non-root, no privilege escalation, no
    capabilities, read-only root filesystem. A swap-in trainer keeps its image and user."""
    pod_ctx = pod.get("securityContext", {})
    for name, c in containers(pod).items():
        ctx = c.get("securityContext", {})
        if not c["image"].startswith("jitckpt-"):
            continue  # the team's own image and user (swap-in): not ours to change
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, name
        assert ctx["allowPrivilegeEscalation"] is False, name
        assert ctx["capabilities"] == {"drop": ["ALL"]}, name
        assert ctx["readOnlyRootFilesystem"] is True, name
        if name not in ("jitckpt-sidecar", "jitckpt-restore", "jitckpt-install"):
            assert env_of(c)["HOME"] == "/tmp"  # the read-only root has no writable home
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_base_image_jobs_pass_the_command_as_args():
    """With the base image, `command:` would replace the ENTRYPOINT (jitckpt-entrypoint --)."""
    for path, doc in WORKLOADS:
        for _, pod in pod_specs(doc):
            for c in trainers(pod):
                if c["image"].startswith("jitckpt-base"):
                    assert "command" not in c, rel(path)
                    assert c["args"][0] == "torchrun", rel(path)


def test_kueue_queue_name_label_is_on_every_job():
    for path, doc in WORKLOADS:
        if doc["kind"] == "Job":
            assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], rel(path)


def service_and_job(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {d["kind"]: d for d in load_all(K8S / directory / "service.yaml")}
    docs |= {d["kind"]: d for d in load_all(K8S / directory / "job.yaml")}
    return docs["Service"], docs["Job"]


@pytest.mark.parametrize("directory", ["multi-node", "pvc", "peer-replica"])
def test_multi_node_rendezvous_matches_the_headless_service(directory):
    """Pods find node 0 as <job>-0.<service>: subdomain = Service, PET_NNODES = completions."""
    svc, job = service_and_job(directory)
    pod = job["spec"]["template"]["spec"]
    env = env_of(pod["containers"][0])
    assert svc["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert job["spec"]["completionMode"] == "Indexed"
    assert env["PET_NNODES"] == str(job["spec"]["completions"]) == str(job["spec"]["parallelism"])
    assert env["PET_MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert env["PET_MASTER_PORT"] == str(svc["spec"]["ports"][0]["port"])
    assert "job-completion-index" in env["PET_NODE_RANK"]["fieldRef"]["fieldPath"]


def test_the_peer_replica_finds_every_node_and_the_trainers_restart_in_place():
    """peer-replica/: JITCKPT_PEERS names every pod's sidecar through the headless Service
    (<job>-<node>.<service>, the sidecar's port, which the Service lists), the token comes
    from the key `token` of the Secret whose example is beside it, the sidecar knows its node
    and the node count, and the trainers restart in their pods (the memory volume stays)."""
    svc, job = service_and_job("peer-replica")
    pod = job["spec"]["template"]["spec"]
    sidecar = containers(pod)["jitckpt-sidecar"]
    env = env_of(sidecar)
    port = next(p for p in sidecar["ports"] if p["name"] == "jitckpt-metrics")["containerPort"]
    nodes = job["spec"]["completions"]
    assert env["JITCKPT_NNODES"] == str(nodes) == env_of(trainers(pod)[0])["PET_NNODES"]
    assert "job-completion-index" in env["JITCKPT_NODE_RANK"]["fieldRef"]["fieldPath"]
    for node in range(nodes):
        assert env["JITCKPT_PEERS"].format(node=node) == (
            f"http://{job['metadata']['name']}-{node}.{svc['metadata']['name']}:{port}"
        )
    assert port in [p["targetPort"] for p in svc["spec"]["ports"]]
    assert svc["spec"]["publishNotReadyAddresses"] is True  # asked before a trainer is ready
    (secret,) = load_all(K8S / "peer-replica" / "peer-token.example.yaml")
    ref = env["JITCKPT_PEER_TOKEN"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "token"}
    assert set(secret["stringData"]) == {"token"}
    assert pod["restartPolicy"] == "OnFailure"
    (kustomization,) = load_all(K8S / "peer-replica" / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == ["job.yaml", "service.yaml"]  # no placeholder


def test_pvc_mode_shares_one_readwritemany_claim_as_jitckpt_dir():
    """Every node mounts the same ReadWriteMany claim at JITCKPT_DIR; no storage URI (nothing
    is uploaded) and no sidecar; the grace period and the ignored exit code agree with the
    trainer's settings, and disruptions do not count against backoffLimit."""
    (claim,) = load_all(PVC / "pvc.yaml")
    job, pod = pvc_job()
    assert claim["kind"] == "PersistentVolumeClaim"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (trainer,) = pod["containers"]
    assert not pod.get("initContainers")
    env = env_of(trainer)
    assert "JITCKPT_STORAGE_URI" not in env
    volume = next(v for v in pod["volumes"] if v["name"] == "jitckpt")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert {"name": "jitckpt", "mountPath": env["JITCKPT_DIR"]} in trainer["volumeMounts"]
    assert env["JITCKPT_GRACE_SECONDS"] == str(pod["terminationGracePeriodSeconds"])
    rules = job["podFailurePolicy"]["rules"]
    assert {
        "action": "Ignore",
        "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]},
    } in rules
    assert {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    } in rules
    assert pod["restartPolicy"] == "Never"
    output = next(a for a in trainer["args"] if a.startswith("--output_dir="))
    assert output.split("=", 1)[1].startswith(env["JITCKPT_DIR"] + "/")  # kept on the volume


@pytest.mark.parametrize(
    ("generated", "original", "args"),
    [
        ("swap-in/job.yaml", "swap-in/job.orig.yaml",
         ["--image", "jitckpt-sidecar:0.1.0", "--storage-uri", "s3://my-bucket/jitckpt/llama-finetune",
          "--secret", "aws-connection-jitckpt"]),
        ("trainjob/trainjob.yaml", "trainjob/trainjob.orig.yaml",
         ["--storage-uri", "s3://my-bucket/jitckpt/llama-finetune"]),
        ("pytorchjob/pytorchjob.yaml", "pytorchjob/pytorchjob.orig.yaml",
         ["--image", "jitckpt-sidecar:0.1.0", "--storage-uri",
          "s3://my-bucket/jitckpt/llama-finetune-ddp", "--secret", "aws-connection-jitckpt"]),
        ("peer-replica/job.yaml", "peer-replica/job.orig.yaml",
         ["--image", "jitckpt-sidecar:0.1.0", "--storage-uri", "s3://my-bucket/jitckpt/llama-ddp",
          "--secret", "aws-connection-jitckpt", "--memory", "48Gi",
          "--peers", "http://llama-ddp-{node}.llama-ddp:9402",
          "--peer-secret", "jitckpt-peer-token"]),
    ],
)  # fmt: skip
def test_generated_examples_are_injects_current_output(generated, original, args, capsys):
    """The committed swap-in examples are exactly what inject makes of their originals."""
    assert inject.main(["-q", "-f", str(K8S / original), *args]) == 0
    out = capsys.readouterr().out
    assert list(yaml.safe_load_all(out)) == load_all(K8S / generated)


def test_trainjob_runtime_is_the_one_inject_points_at():
    runtime = load_all(K8S / "trainjob" / "runtime.yaml")[0]
    trainjob = load_all(K8S / "trainjob" / "trainjob.yaml")[0]
    assert f"{runtime['kind']}/{runtime['metadata']['name']}" == inject.DEFAULT_TRAINJOB_RUNTIME
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert trainjob["spec"]["runtimeRef"]["kind"] == runtime["kind"]


# --- monitoring --------------------------------------------------------------------------


def selectors(expr: promql_parser.Expr) -> list[Any]:
    found: list[Any] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(expr, visit)
    return found


def check_references(expr_text: str) -> list[str]:
    """Parse `expr_text`; return the problems with the metrics and label values it uses."""
    expr = promql_parser.parse(expr_text)
    problems, series = [], series_names()
    found = selectors(expr)
    if not found:
        problems.append(f"{expr_text}: selects no metric")
    for sel in found:
        if sel.name not in series:
            problems.append(f"{sel.name} is not exported by the sidecar")
            continue
        metric = series[sel.name]
        for matcher in sel.matchers.matchers:
            allowed = LABEL_VALUES.get((metric, matcher.name))
            if allowed is not None and matcher.value not in allowed:
                problems.append(f"{metric}{{{matcher.name}={matcher.value!r}}}: not in {allowed}")
    return problems


def test_podmonitor_scrapes_the_port_and_label_the_jobs_use():
    monitor = load_all(K8S / "monitoring" / "podmonitor.yaml")[0]
    labels = monitor["spec"]["selector"]["matchLabels"]
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    for path, _doc, job, pod in POD_CASES:
        template = (job or {}).get("template", {})
        assert labels.items() <= template.get("metadata", {}).get("labels", {}).items(), rel(path)
        ports = [p["name"] for p in containers(pod)["jitckpt-sidecar"]["ports"]]
        assert endpoint["port"] in ports


def test_alert_expressions_parse_and_use_only_exported_metrics():
    """Every rule's PromQL parses (promql-parser) and selects only the sidecar's series."""
    rules = [r for g in RULES["spec"]["groups"] for r in g["rules"]]
    problems = [p for r in rules for p in check_references(r["expr"])]
    assert not problems, problems
    assert all(r["labels"]["severity"] in ("warning", "critical") for r in rules)


def test_alerts_cover_disk_pressure_upload_lag_upload_and_restore_failures():
    """Each alert reads the measure it is about; disk pressure compares with the threshold the
    sidecar exports (configurable), not a copy of its default."""
    rules = {r["alert"]: r["expr"] for g in RULES["spec"]["groups"] for r in g["rules"]}
    assert "jitckpt_storage_pressure_ratio" in rules["JitckptDiskPressure"]
    assert "jitckpt_storage_pressure_threshold_ratio" in rules["JitckptDiskPressure"]
    assert "0.85" not in rules["JitckptDiskPressure"]
    assert "jitckpt_upload_oldest_pending_age_seconds" in rules["JitckptUploadLag"]
    assert 'jitckpt_uploads_total{result="failure"}' in rules["JitckptUploadFailures"]
    assert 'jitckpt_restores_total{result="failure"}' in rules["JitckptRestoreFailed"]
    assert "jitckpt_sidecar_ready" in rules["JitckptSidecarNotReady"]
    assert 'jitckpt_work_at_risk_seconds{durability="s3"}' in rules["JitckptWorkAtRisk"]


def test_a_broken_expression_is_caught():
    """The parser really rejects bad PromQL, so the checks above can fail."""
    with pytest.raises(ValueError, match="unclosed"):
        promql_parser.parse("max by (pod (jitckpt_upload_lag_seconds)")
    assert check_references("rate(jitckpt_made_up_total[5m])")


GRAFANA_VARS = {"$__rate_interval": "5m", "$namespace": "ns", "$pod": ".*"}


def dashboard_exprs() -> list[str]:
    exprs = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            exprs.append(expr)
    return exprs


def test_dashboard_queries_use_only_exported_metrics():
    """Each panel's PromQL parses once Grafana's variables are filled in, and selects only
    series the sidecar exports."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    problems = [p for e in exprs for p in check_references(e)]
    assert not problems, problems
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            metric = re.search(r"label_values\((\w+)", var["definition"]).group(1)
            assert metric in METRICS


def test_dashboard_shows_every_exported_metric():
    used = {
        series_names()[s.name] for e in dashboard_exprs() for s in selectors(promql_parser.parse(e))
    }
    assert used == set(METRICS)


def test_no_pod_fixes_the_user_or_group_ids_that_openshift_assigns():
    """OpenShift's restricted-v2 SCC rejects a runAsUser, runAsGroup or fsGroup outside the
    namespace's range and assigns its own: no workload or webhook pod sets one (the images run
    as 1001:0 by their USER)."""
    fixed, pods = [], 0
    for path, doc in DOCS:
        specs = [pod for _, pod in pod_specs(doc)]
        if doc["kind"] == "Deployment":
            specs.append(doc["spec"]["template"]["spec"])
        for pod in specs:
            pods += 1
            every = [*pod.get("initContainers", []), *pod["containers"]]
            contexts = [pod.get("securityContext") or {}]
            contexts += [c.get("securityContext") or {} for c in every]
            for context in contexts:
                fixed += [
                    f"{rel(path)}: {key}"
                    for key in ("runAsUser", "runAsGroup", "fsGroup")
                    if key in context
                ]
    assert not fixed, fixed
    assert pods > 10
