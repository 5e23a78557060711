"""The real images (make image-test): built with podman on a local debootstrap base, then run.

podman runs with our own configuration (tests/harness/podman.py: runc, cgroupfs, the host's
ulimits, host networking). The pod test needs the sidecar's long-running mode and is skipped,
with the reason, until that lands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import images
from harness.podman import Podman, missing_tools
from harness.procs import REPO, Proc, free_port, wait_for
from harness.training import CHILDREN

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(bool(missing_tools()), reason=f"not installed: {missing_tools()}"),
]
TAG = "test"
BASE = f"localhost/jitckpt-base:{TAG}"
SIDECAR = f"localhost/jitckpt-sidecar:{TAG}"
OPENSHIFT_UID = "1000650000:0"  # an arbitrary UID from a namespace range, group 0
JIT_EXIT = 143
SIDECAR_BUDGET_MB = 250


@pytest.fixture(scope="session")
def pm() -> Podman:
    podman = Podman()
    torch_base = images.ensure_torch(podman)
    debian = images.ensure_debian(podman)
    images.build_targets(podman, torch_base, debian, TAG)
    return podman


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A host directory any container UID can write (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="jitckpt-img-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def container(pm: Podman) -> Iterator[str]:
    name = f"jitckpt-test-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    pm.run("rm", "--force", "--time", "0", name, check=False)


def inspect(pm: Podman, ref: str) -> dict[str, Any]:
    return json.loads(pm.run("image", "inspect", ref).stdout)[0]


def test_sidecar_image_is_lean_and_has_no_torch(pm):
    size_mb = pm.image_size(SIDECAR) / 1e6
    assert size_mb <= SIDECAR_BUDGET_MB, f"sidecar image is {size_mb:.0f} MB"
    probe = "import boto3, watchdog, psutil, prometheus_client, yaml, jitckpt_sidecar; import torch"
    out = pm.run("run", "--rm", "--entrypoint", "python3", SIDECAR, "-c", probe, check=False)
    assert out.returncode == 1
    assert "No module named 'torch'" in out.stderr


def test_images_are_non_root_and_declare_their_entrypoints(pm):
    base, sidecar = inspect(pm, BASE)["Config"], inspect(pm, SIDECAR)["Config"]
    assert base["User"] == sidecar["User"] == "1001:0"
    assert base["Entrypoint"] == ["jitckpt-entrypoint", "--"]
    assert sidecar["Entrypoint"] == ["jitckpt-sidecar"]
    assert "9402/tcp" in sidecar["ExposedPorts"]
    env = dict(e.split("=", 1) for e in base["Env"])
    assert env["JITCKPT_DIR"] == "/mnt/jitckpt"


def test_base_image_has_torch_transformers_and_the_entrypoint(pm):
    code = "import torch, transformers, accelerate, jitckpt_entrypoint; print(torch.__version__)"
    out = pm.run("run", "--rm", "--user", OPENSHIFT_UID, BASE, "python3", "-c", code)
    assert out.stdout.strip().startswith("2.13.0")


def test_swap_in_bundle_runs_in_a_foreign_image_as_an_arbitrary_uid(pm, shared_dir):
    """`install` from the sidecar image into a shared directory; then an image without
    jitckpt (the plain torch base) runs the bundle read-only as an OpenShift-style UID."""
    bundle = shared_dir / "bundle"
    bundle.mkdir(mode=0o777)
    bundle.chmod(0o777)
    pm.run("run", "--rm", "--user", "4242:0", "-v", f"{bundle}:/jitckpt", SIDECAR,
           "install", "/jitckpt")  # fmt: skip
    assert (bundle / "jitckpt-entrypoint").exists()
    child = "import sitecustomize; print('hook', sitecustomize.__file__)"
    out = pm.run(
        "run", "--rm", "--user", OPENSHIFT_UID, "--read-only",
        "-v", f"{bundle}:/jitckpt:ro", "--tmpfs", "/mnt/jitckpt",
        "-e", "JITCKPT_DIR=/mnt/jitckpt", images.TORCH,
        "python3", "/jitckpt/jitckpt-entrypoint", "--", "python3", "-c", child,
    )  # fmt: skip
    assert "hook /jitckpt/jitckpt_entrypoint/_site/sitecustomize.py" in out.stdout
    assert "disabled" not in out.stderr


def test_inject_runs_from_the_sidecar_image(pm):
    job = (REPO / "k8s" / "swap-in" / "job.orig.yaml").read_text()
    out = pm.run("run", "--rm", "-i", SIDECAR, "inject", "--storage-uri", "s3://bucket-a/p",
                 input_text=job)  # fmt: skip
    assert "Error" not in out.stderr  # e.g. a broken .pth in the venv
    doc = yaml.safe_load(out.stdout)
    names = [c["name"] for c in doc["spec"]["template"]["spec"]["initContainers"]]
    assert names == ["jitckpt-install", "jitckpt-sidecar"]


def test_podman_stop_commits_a_jit_checkpoint_and_exits_143(pm, shared_dir, container):
    """The base image's ENTRYPOINT wraps torchrun: `podman stop` (SIGTERM to PID 1) makes the
    workers finish the step, commit a JIT checkpoint and the container exit 143. Run as an
    arbitrary UID with a read-only root filesystem, as the k8s/ Jobs do."""
    pm.run(
        "run", "--detach", "--name", container, "--user", OPENSHIFT_UID, "--read-only",
        "-e", "HOME=/tmp", "-e", "HF_HUB_OFFLINE=1", "-e", "OMP_NUM_THREADS=1",
        "-e", "JITCKPT_GRACE_SECONDS=60",
        "-v", f"{CHILDREN}:/children:ro", "-v", f"{shared_dir}:/mnt/jitckpt",
        BASE,
        "torchrun", "--standalone", "--nproc-per-node=2", "/children/train_hf.py",
        "--max-steps", "2000", "--save-steps", "1000",
    )  # fmt: skip
    logs = Proc(pm.cmd("logs", "--follow", container), env=pm.env)
    try:
        logs.expect(r"^step 5 rank=0$", timeout=240)
        pm.run("stop", "--time", "60", container, timeout=120)
    finally:
        logs.kill_tree()
    state = json.loads(pm.run("inspect", container).stdout)[0]["State"]
    assert state["ExitCode"] == JIT_EXIT, pm.run("logs", container).stderr[-3000:]
    jit = json.loads((shared_dir / "status" / "jit.json").read_text())
    step = jit["step"]
    assert step >= 5
    manifest = shared_dir / "checkpoints" / f"checkpoint-{step}" / "jitckpt-manifest.node-0.json"
    assert json.loads(manifest.read_text())["kind"] == "jit"


# --- the pod: trainer + sidecar + S3 -------------------------------------------------------


def sidecar_has_long_running_mode(pm: Podman) -> bool:
    out = pm.run("run", "--rm", SIDECAR, "--help", check=False)
    return "restore" in out.stdout + out.stderr


PODMAN_FIELDS = ("metadata.name", "metadata.uid")
"""The downward API's fieldRef paths podman 4.3's kube play fills (and labels, annotations); it
refuses a pod with any other (spec.nodeName, metadata.namespace: the sidecar's notice watch,
which has no API server here anyway)."""


def without_unplayable_fields(container: dict[str, Any]) -> None:
    def playable(env: dict[str, Any]) -> bool:
        path = ((env.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        return (
            path is None
            or path in PODMAN_FIELDS
            or path.startswith(("metadata.labels", "metadata.annotations"))
        )

    container["env"] = [e for e in container.get("env", []) if playable(e)]


def pod_from_k8s(storage_uri: str, s3_endpoint: str, sidecar: str = SIDECAR) -> dict[str, Any]:
    """k8s/init-container/job.yaml's pod, made runnable by `podman kube play` here: local
    images, the tiny training script, S3 on the host's loopback (hostNetwork), no GPUs.

    The plain init-container variant, because podman 4.3 runs init containers to completion
    (no native sidecars)."""
    job = yaml.safe_load((REPO / "k8s" / "init-container" / "job.yaml").read_text())
    template = job["spec"]["template"]
    spec = template["spec"]
    spec["hostNetwork"] = True
    # The kubelet puts the pod's host name into /etc/hosts; podman 4.3 with host networking
    # copies the host's file and ignores hostAliases, and torchrun's rendezvous advertises the
    # host name: use one that resolves.
    spec["hostname"] = "localhost"
    spec["volumes"].append({"name": "children", "hostPath": {"path": str(CHILDREN)}})
    s3_env = [
        {"name": "AWS_ENDPOINT_URL", "value": s3_endpoint},
        {"name": "AWS_ACCESS_KEY_ID", "value": "testing"},
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "testing"},
        {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"},
    ]
    for c in spec["initContainers"] + spec["containers"]:
        # podman 4.3: port mappings are refused with host networking, and probes become
        # healthchecks that run curl inside the (curl-less) image; neither is under test here.
        for key in ("resources", "envFrom", "ports", "livenessProbe", "startupProbe"):
            c.pop(key, None)
        c["image"] = sidecar if c["image"].startswith("jitckpt-sidecar") else BASE
        without_unplayable_fields(c)
        for env in c.get("env", []):
            if env["name"] == "JITCKPT_STORAGE_URI":
                env["value"] = storage_uri
        if c["name"] != "trainer":
            c["env"] = c.get("env", []) + s3_env
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    trainer["args"] = ["torchrun", "--standalone", "--nproc-per-node=2", "/children/train_hf.py",
                       "--max-steps", "2000", "--save-steps", "1000"]  # fmt: skip
    trainer["env"] += [{"name": "HF_HUB_OFFLINE", "value": "1"},
                       {"name": "OMP_NUM_THREADS", "value": "1"}]  # fmt: skip
    trainer["volumeMounts"].append({"name": "children", "mountPath": "/children", "readOnly": True})
    trainer["volumeMounts"] = [m for m in trainer["volumeMounts"] if m["name"] != "dshm"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "dshm"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "jitckpt-kube-play", "labels": template["metadata"]["labels"]},
        "spec": spec,
    }


STUB_SIDECAR = f"localhost/jitckpt-sidecar-stub:{TAG}"
# Stands in for the sidecar until it lands: `restore` finds nothing, the long-running mode
# waits for SIGTERM. Only the trainer's half of the pod is under test with it.
STUB_SCRIPT = """#!/bin/sh
[ "$1" = restore ] && { echo "stub: nothing to restore"; exit 0; }
trap 'echo "stub: SIGTERM"; exit 0' TERM
while :; do sleep 1; done
"""


def test_kube_play_pod_from_k8s_trains_and_stops_with_a_jit_checkpoint(pm, tmp_path):
    """The k8s/ pod (init-container variant) under `podman kube play`, with a stub sidecar:
    the trainer runs through the base image's ENTRYPOINT, and `podman pod stop` (SIGTERM to
    every container) ends it with a committed JIT checkpoint and exit code 143."""
    (tmp_path / "jitckpt-sidecar").write_text(STUB_SCRIPT)
    (tmp_path / "Containerfile").write_text(
        f"FROM {SIDECAR}\nCOPY --chmod=755 jitckpt-sidecar /opt/jitckpt/bin/jitckpt-sidecar\n"
    )
    pm.build(["-t", STUB_SIDECAR, str(tmp_path)])
    pod_yaml = tmp_path / "pod.yaml"
    pod_yaml.write_text(
        yaml.safe_dump(pod_from_k8s("s3://ckpt/kube-play", "http://127.0.0.1:9", STUB_SIDECAR))
    )
    try:
        pm.run("kube", "play", str(pod_yaml), timeout=300)
        logs = Proc(pm.cmd("logs", "--follow", "jitckpt-kube-play-trainer"), env=pm.env)
        try:
            logs.expect(r"^step 5 rank=0$", timeout=240)
            pm.run("pod", "stop", "--time", "60", "jitckpt-kube-play", timeout=120)
        finally:
            logs.kill_tree()
        states = json.loads(
            pm.run(
                "inspect", "jitckpt-kube-play-trainer", "jitckpt-kube-play-jitckpt-sidecar"
            ).stdout
        )
        codes = {c["Name"]: c["State"]["ExitCode"] for c in states}
        trainer_log = pm.run("logs", "jitckpt-kube-play-trainer").stderr
        assert codes["jitckpt-kube-play-trainer"] == JIT_EXIT, trainer_log[-3000:]
        assert re.search(r"JIT checkpoint checkpoint-\d+ committed", trainer_log)
        assert codes["jitckpt-kube-play-jitckpt-sidecar"] == 0
    finally:
        pm.run("kube", "down", str(pod_yaml), check=False)


def test_kube_play_pod_uploads_the_jit_checkpoint_to_s3(pm, tmp_path):
    """The k8s/ pod under `podman kube play`: it trains, `podman pod stop` sends SIGTERM to
    every container, the trainer commits a JIT checkpoint and the sidecar uploads it to S3
    (moto's server on 127.0.0.1) before it exits."""
    if not sidecar_has_long_running_mode(pm):
        pytest.skip(
            "jitckpt-sidecar has no long-running mode yet (its --help lacks 'restore'); "
            "written against the sidecar contract, runs once the sidecar lands"
        )
    import boto3

    port = free_port()
    s3 = Proc(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    pod_yaml = tmp_path / "pod.yaml"
    pod_yaml.write_text(yaml.safe_dump(pod_from_k8s("s3://ckpt/kube-play", endpoint)))
    try:
        wait_for(lambda: _bucket(client), timeout=30, what="moto to create the bucket")
        pm.run("kube", "play", str(pod_yaml), timeout=300)
        logs = Proc(pm.cmd("logs", "--follow", "jitckpt-kube-play-trainer"), env=pm.env)
        logs.expect(r"^step 5 rank=0$", timeout=300)
        pm.run("pod", "stop", "--time", "120", "jitckpt-kube-play", timeout=180)
        logs.kill_tree()
        codes = {
            c["Name"]: c["State"]["ExitCode"]
            for c in json.loads(pm.run("inspect", "jitckpt-kube-play-trainer",
                                       "jitckpt-kube-play-jitckpt-sidecar").stdout)
        }  # fmt: skip
        assert codes["jitckpt-kube-play-trainer"] == JIT_EXIT
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt").get("Contents", [])]
        manifests = [k for k in keys if k.endswith("jitckpt-manifest.node-0.json")]
        assert manifests, keys
        assert json.loads(client.get_object(Bucket="ckpt", Key=manifests[-1])["Body"].read())[
            "kind"
        ] in ("jit", "periodic")
    finally:
        pm.run("kube", "down", str(pod_yaml), check=False)
        s3.send(signal.SIGTERM)
        s3.kill_tree()


def _bucket(client: Any) -> bool:
    try:
        client.create_bucket(Bucket="ckpt")
    except Exception as exc:  # noqa: BLE001 - moto still starting: connection refused
        return "BucketAlready" in type(exc).__name__ or "BucketAlready" in str(exc)
    return True


# --- the admission webhook: a PyTorchJob's pod, injected as the API server would have it ---------


def pytorchjob_pod_through_the_webhook(tmp_path: Path, s3_endpoint: str) -> dict[str, Any]:
    """k8s/pytorchjob/pytorchjob.orig.yaml's Master pod as the Training Operator creates it
    (its labels, owner and PET_* variables), labelled jitckpt.io/inject, sent to the real
    webhook over HTTPS; the JSONPatch applied, then made runnable by `podman kube play` as
    pod_from_k8s does. The container sidecar mode: podman 4.3 has no native sidecars."""
    import base64

    import jsonpatch

    from harness.admission import review, tls_pair
    from harness.checkpoints import SIDECAR as SIDECAR_CLI

    job = yaml.safe_load((REPO / "k8s" / "pytorchjob" / "pytorchjob.orig.yaml").read_text())
    template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    spec = template["spec"]
    [trainer] = spec["containers"]
    trainer.update(image=BASE, imagePullPolicy="Never", resources={}, args=[],
                   command=["torchrun", "--standalone", "--nproc-per-node=2",
                            "/children/train_hf.py", "--max-steps", "2000",
                            "--save-steps", "1000"])  # fmt: skip
    trainer["env"] = [{"name": "PET_NNODES", "value": "1"}, {"name": "PET_NODE_RANK", "value": "0"},
                      {"name": "MASTER_ADDR", "value": "localhost"},
                      {"name": "HF_HUB_OFFLINE", "value": "1"},
                      {"name": "OMP_NUM_THREADS", "value": "1"}]  # fmt: skip
    name = job["metadata"]["name"]
    labels = {**template["metadata"]["labels"], "jitckpt.io/inject": "true",
              "training.kubeflow.org/job-name": name,
              "training.kubeflow.org/replica-type": "master"}  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "jitckpt-webhook-play", "namespace": "ml", "labels": labels,
                        "annotations": {"jitckpt.io/sidecar-mode": "container"},
                        "ownerReferences": [{"apiVersion": "kubeflow.org/v1",
                                             "kind": "PyTorchJob", "name": name, "uid": "u1",
                                             "controller": True}]},
           "spec": {**spec, "restartPolicy": "OnFailure"}}  # fmt: skip

    cert, key = tls_pair(tmp_path)
    port = free_port()
    hook = Proc([*SIDECAR_CLI, "webhook", "--tls-cert-file", str(cert),
                 "--tls-private-key-file", str(key), "--address", "127.0.0.1",
                 "--port", str(port), "--storage-uri-prefix", "s3://ckpt/jit",
                 "--image", SIDECAR])  # fmt: skip
    try:
        import http.client
        import ssl

        context = ssl.create_default_context(cafile=str(cert))

        def answer() -> dict[str, Any] | None:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            try:
                conn.request("POST", "/mutate", body=json.dumps(review(pod)),
                             headers={"Content-Type": "application/json"})  # fmt: skip
                return json.loads(conn.getresponse().read())["response"]  # type: ignore[no-any-return]
            except ConnectionRefusedError:
                return None
            finally:
                conn.close()

        response: dict[str, Any] = {}
        wait_for(lambda: response.update(answer() or {}) or bool(response), timeout=30,
                 what="the webhook to answer")  # fmt: skip
    finally:
        hook.kill_tree()
    assert response["allowed"] is True
    ops = json.loads(base64.b64decode(response["patch"]))
    injected: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    assert injected["metadata"]["annotations"]["jitckpt.io/injected"]

    spec = injected["spec"]
    spec["hostNetwork"] = True
    spec["hostname"] = "localhost"
    spec["volumes"].append({"name": "children", "hostPath": {"path": str(CHILDREN)}})
    s3_env = [{"name": "AWS_ENDPOINT_URL", "value": s3_endpoint},
              {"name": "AWS_ACCESS_KEY_ID", "value": "testing"},
              {"name": "AWS_SECRET_ACCESS_KEY", "value": "testing"},
              {"name": "AWS_DEFAULT_REGION", "value": "us-east-1"}]  # fmt: skip
    for c in spec["initContainers"] + spec["containers"]:
        for key_ in ("resources", "ports", "livenessProbe", "startupProbe"):  # podman 4.3
            c.pop(key_, None)
        c["imagePullPolicy"] = "Never"
        without_unplayable_fields(c)
        if c["name"] in ("jitckpt-sidecar", "jitckpt-restore"):
            c["env"] = c.get("env", []) + s3_env
    mounts = next(c for c in spec["containers"] if c["name"] == "pytorch")["volumeMounts"]
    mounts.append({"name": "children", "mountPath": "/children", "readOnly": True})
    del injected["metadata"]["ownerReferences"], injected["metadata"]["namespace"]
    return injected


def test_kube_play_pytorchjob_pod_injected_by_the_webhook_checkpoints_and_resumes(pm, tmp_path):
    """The webhook's rewrite of a PyTorchJob Master pod (the one inject gives every replica),
    under `podman kube play`: SIGTERM (`podman pod stop`) ends the trainer with a committed JIT
    checkpoint, exit 143, which the sidecar uploads under the job's URI; the pod played again
    (a new volume, as a recreated replica gets) restores it from S3 and resumes at its step."""
    import boto3

    port = free_port()
    s3 = Proc([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
               "-p", str(port)])  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    pod_yaml = tmp_path / "pod.yaml"
    name = "jitckpt-webhook-play"
    try:
        wait_for(lambda: _bucket(client), timeout=30, what="moto to create the bucket")
        pod_yaml.write_text(yaml.safe_dump(pytorchjob_pod_through_the_webhook(tmp_path, endpoint)))
        pm.run("kube", "play", str(pod_yaml), timeout=300)
        logs = Proc(pm.cmd("logs", "--follow", f"{name}-pytorch"), env=pm.env)
        try:
            logs.expect(r"^step 5 rank=0$", timeout=300)
            pm.run("pod", "stop", "--time", "120", name, timeout=180)
        finally:
            logs.kill_tree()
        state = json.loads(pm.run("inspect", f"{name}-pytorch", f"{name}-jitckpt-sidecar").stdout)
        codes = {c["Name"]: c["State"]["ExitCode"] for c in state}
        trainer_log = pm.run("logs", f"{name}-pytorch").stderr
        assert codes[f"{name}-pytorch"] == JIT_EXIT, trainer_log[-3000:]
        step = int(re.findall(r"JIT checkpoint checkpoint-(\d+) committed", trainer_log)[-1])
        assert codes[f"{name}-jitckpt-sidecar"] == 0, pm.run(
            "logs", f"{name}-jitckpt-sidecar"
        ).stderr[-3000:]
        prefix = "jit/ml/llama-finetune-ddp/"
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpt", Prefix=prefix)["Contents"]]
        assert f"{prefix}checkpoint-{step}/jitckpt-manifest.node-0.json" in keys, keys

        pm.run("kube", "down", str(pod_yaml), check=False)
        assert pm.run("volume", "ls", "--quiet").stdout.strip() == ""  # the emptyDirs went too
        pm.run("kube", "play", str(pod_yaml), timeout=300)
        logs = Proc(pm.cmd("logs", "--follow", f"{name}-pytorch"), env=pm.env)
        try:  # a new pod's emptyDir is empty: this step came from S3 (podman 4.3 removes the
            # restore init container once it has run, with its log)
            logs.expect(rf"^begin rank=0 pid=\d+ step={step}$", timeout=300)
        finally:
            logs.kill_tree()
    finally:
        pm.run("kube", "down", str(pod_yaml), check=False)
        s3.send(signal.SIGTERM)
        s3.kill_tree()
