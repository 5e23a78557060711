"""`jitckpt-sidecar inject`: rewrites into the swap-in form, idempotently, and refuses in one
line what it cannot rewrite safely. Every output validates strictly for Kubernetes 1.29+."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import yaml

from harness.k8s import VERSIONS, containers, core_objects, env_of, validate
from jitckpt_entrypoint.settings import SettingError
from jitckpt_sidecar import config as sidecar_config
from jitckpt_sidecar import inject
from jitckpt_sidecar.errors import InjectError

STORAGE = ["--storage-uri", "s3://ckpt/team-a/run-1"]

JOB = """\
apiVersion: batch/v1
kind: Job
metadata: {name: train}
spec:
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: train
        image: registry.example.com/team/trainer:1
        command: [torchrun, --nproc-per-node, "2", /app/train.py]
        args: [--lr, "1e-4"]
"""
POD = """\
apiVersion: v1
kind: Pod
metadata: {name: train}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 300
  containers:
  - name: train
    image: registry.example.com/team/trainer:1
    command: [python, /app/train.py]
    securityContext: {runAsUser: 1234}
"""
JOBSET = """\
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: train}
spec:
  replicatedJobs:
  - name: workers
    replicas: 2
    template:
      spec:
        parallelism: 1
        completions: 1
        template:
          spec:
            restartPolicy: Never
            containers:
            - name: train
              image: registry.example.com/team/trainer:1
              command: [torchrun, /app/train.py]
"""
TRAINJOB = """\
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: train}
spec:
  runtimeRef: {name: torch-distributed}
  trainer:
    image: registry.example.com/team/trainer:1
    command: [torchrun, /app/train.py]
"""
PYTORCHJOB = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: train}
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: ExitCode
      template:
        spec:
          containers:
          - name: pytorch
            image: registry.example.com/team/trainer:1
            command: [torchrun, --nproc-per-node=8, /app/train.py]
    Worker:
      replicas: 3
      template:
        spec:
          containers:
          - name: pytorch
            image: registry.example.com/team/trainer:1
            command: [torchrun, --nproc-per-node=8, /app/train.py]
          - {name: log-shipper, image: registry.example.com/logs:1}
"""
LIST = """\
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}, data: {a: b}}
- apiVersion: v1
  kind: Pod
  metadata: {name: p}
  spec:
    containers: [{name: t, image: i, command: [torchrun, x.py]}]
"""
SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: train}
spec: {clusterIP: None, selector: {job-name: train}}
"""


def run(text: str, *args: str, capsys, monkeypatch) -> tuple[int, str, str]:
    """inject.main with `text` on stdin: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = inject.main([*STORAGE, *args])
    out, err = capsys.readouterr()
    return code, out, err


def injected(text: str, *args: str) -> str:
    out, _ = inject.inject_text(text, options(*args))
    return out


def notes(text: str, *args: str) -> str:
    """The warnings and notes inject_text returns (the CLI prints them)."""
    _, report = inject.inject_text(text, options(*args))
    return "\n".join(report.notes)


def options(*args: str) -> inject.Options:
    extra = dict(zip(args[::2], args[1::2]))
    return inject.Options(storage_uri="s3://ckpt/team-a/run-1", **extra)


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def assert_valid(text: str) -> int:
    """Every core object (or the core types inside a CRD) validates for every version."""
    checked = 0
    for doc in docs(text):
        for label, obj in core_objects(doc):
            for version in VERSIONS:
                error = validate(obj, version)
                assert error is None, f"{label} @ {version}: {error}"
            checked += 1
    return checked


@pytest.mark.parametrize(
    "source", [JOB, POD, JOBSET, TRAINJOB, PYTORCHJOB, LIST, JOB + "---\n" + SERVICE]
)
@pytest.mark.parametrize("mode", ["native", "container"])
def test_output_validates_and_a_second_run_changes_nothing(source, mode):
    once = injected(source, "sidecar_mode", mode)
    assert once != yaml.safe_dump_all(docs(source))
    assert assert_valid(once) >= 1
    assert injected(once, "sidecar_mode", mode) == once


def test_a_job_gets_the_install_the_native_sidecar_the_volumes_and_the_failure_policy():
    job = docs(injected(JOB))[0]
    pod = job["spec"]["template"]["spec"]
    train = containers(pod)["train"]
    assert train["command"] == [
        "python3", "/jitckpt/jitckpt-entrypoint", "--", "torchrun", "--nproc-per-node", "2",
        "/app/train.py",
    ]  # fmt: skip
    assert train["args"] == ["--lr", "1e-4"]  # Kubernetes appends args to the command
    assert [c["name"] for c in pod["initContainers"]] == ["jitckpt-install", "jitckpt-sidecar"]
    install, sidecar = pod["initContainers"]
    assert install["command"] == ["jitckpt-sidecar", "install", "/jitckpt"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    env = env_of(sidecar)
    assert env["JITCKPT_GRACE_SECONDS"] == env_of(train)["JITCKPT_GRACE_SECONDS"] == "120"
    assert pod["terminationGracePeriodSeconds"] == 120
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["volumes"]}
    assert sizes["jitckpt"] == env["JITCKPT_STORAGE_CAPACITY"] == "50Gi"
    assert env["JITCKPT_STORAGE_URI"] == env_of(train)["JITCKPT_STORAGE_URI"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[1]["onExitCodes"] == {"containerName": "train", "operator": "In", "values": [143]}


def test_a_pods_own_grace_period_is_kept_and_its_uid_is_shared_with_the_sidecar():
    pod = docs(injected(POD, "secret", "aws-connection-ckpt"))[0]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 300
    sidecar = containers(pod)["jitckpt-sidecar"]
    assert env_of(sidecar)["JITCKPT_GRACE_SECONDS"] == "300"
    assert sidecar["securityContext"]["runAsUser"] == 1234
    assert sidecar["envFrom"] == [{"secretRef": {"name": "aws-connection-ckpt"}}]


def test_container_mode_restores_in_an_init_container_and_runs_the_sidecar_beside_the_trainer():
    pod = docs(injected(JOB, "sidecar_mode", "container"))[0]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["jitckpt-install", "jitckpt-restore"]
    assert [c["name"] for c in pod["containers"]] == ["train", "jitckpt-sidecar"]
    sidecar = pod["containers"][1]
    assert "restartPolicy" not in sidecar
    assert env_of(sidecar)["JITCKPT_EXIT_WITH_TRAINER"] == "1"
    assert env_of(sidecar)["JITCKPT_RESTART_POLICY"] == "Never"  # the Job's pods'


@pytest.mark.parametrize(
    ("source", "policy"),
    [
        (POD.replace("restartPolicy: Never", "restartPolicy: OnFailure"), "OnFailure"),
        (POD.replace("  restartPolicy: Never\n", ""), "Always"),  # Kubernetes' default
        (PYTORCHJOB, "Never"),  # Master's ExitCode: the operator recreates the pod
        (PYTORCHJOB.replace("restartPolicy: ExitCode", "restartPolicy: Always"), "Always"),
    ],
)
def test_a_plain_container_sidecar_is_told_the_pods_restart_policy(source, policy):
    """It exits with the trainer only once no restart can follow (drain.py): it needs the pods'
    restartPolicy, as the pod spec, Kubernetes' default or the operator sets it."""
    doc = docs(injected(source, "sidecar_mode", "container"))[0]
    if doc["kind"] == "PyTorchJob":
        pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        worker = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        sidecar = containers(worker)["jitckpt-sidecar"]
        assert env_of(sidecar)["JITCKPT_RESTART_POLICY"] == "OnFailure"  # the operator's default
    else:
        pod = doc["spec"]
    assert env_of(containers(pod)["jitckpt-sidecar"])["JITCKPT_RESTART_POLICY"] == policy
    native = docs(injected(source))[0]
    assert "JITCKPT_RESTART_POLICY" not in yaml.safe_dump(native)  # SIGTERM tells it


def test_users_jitckpt_settings_win_over_ours():
    source = JOB.replace(
        "args:", 'env: [{name: JITCKPT_SAVE_STEPS, value: "50"}, {name: JITCKPT_EXIT_CODE, '
        'value: "42"}]\n        args:',
    )  # fmt: skip
    train = containers(docs(injected(source))[0]["spec"]["template"]["spec"])["train"]
    assert env_of(train)["JITCKPT_SAVE_STEPS"] == "50"
    assert env_of(train)["JITCKPT_EXIT_CODE"] == "42"


def test_a_jobset_is_injected_in_every_replicated_job():
    jobset = docs(injected(JOBSET))[0]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert "jitckpt-sidecar" in containers(job["template"]["spec"])
    assert job["podFailurePolicy"]["rules"][1]["onExitCodes"]["containerName"] == "train"


def test_with_container_a_jobset_leaves_jobs_without_that_container_alone():
    launcher = JOBSET.replace(
        "  replicatedJobs:\n",
        "  replicatedJobs:\n  - name: launcher\n    template:\n      spec:\n        template:\n"
        "          spec:\n            restartPolicy: Never\n"
        "            containers: [{name: launch, image: l, command: [launch]}]\n",
    )
    jobs = docs(injected(launcher, "containers", ("train",)))[0]["spec"]["replicatedJobs"]
    assert "initContainers" not in jobs[0]["template"]["spec"]["template"]["spec"]
    assert "jitckpt-sidecar" in containers(jobs[1]["template"]["spec"]["template"]["spec"])


def test_a_trainjob_is_pointed_at_the_jitckpt_runtime_with_its_storage_uri_patched_in():
    trainjob = docs(injected(TRAINJOB))[0]
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {
        "name": "torch-distributed-jitckpt", "kind": "TrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }  # fmt: skip
    assert spec["trainer"]["command"][:3] == ["python3", "/jitckpt/jitckpt-entrypoint", "--"]
    patch = spec["runtimePatches"][0]
    assert patch["manager"] == "jitckpt.io/inject"
    rj = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    sidecar = rj["template"]["spec"]["template"]["spec"]["initContainers"][0]
    assert env_of(sidecar)["JITCKPT_STORAGE_URI"] == "s3://ckpt/team-a/run-1"
    assert "runtimeRef 'torch-distributed' replaced" in notes(TRAINJOB)


def test_passthrough_objects_are_kept_as_they_are():
    out = docs(injected(JOB + "---\n" + SERVICE))
    assert out[1] == docs(SERVICE)[0]


def test_yaml_aliases_are_expanded_so_an_edit_does_not_leak_into_another_container():
    source = textwrap.dedent("""\
        apiVersion: v1
        kind: Pod
        metadata: {name: p}
        spec:
          containers:
          - name: train
            image: i
            command: [torchrun, x.py]
            env: &common [{name: A, value: "1"}]
          - name: logger
            image: j
            command: [tail, -f, /dev/null]
            env: *common
        """)
    pod = docs(injected(source, "containers", ("train",)))[0]["spec"]
    assert "JITCKPT_DIR" in env_of(containers(pod)["train"])
    assert env_of(containers(pod)["logger"]) == {"A": "1"}


def test_a_shell_command_is_wrapped_with_a_warning_about_exec():
    source = JOB.replace(
        'command: [torchrun, --nproc-per-node, "2", /app/train.py]',
        'command: [/bin/sh, -c, "pip install -e . && torchrun /app/train.py"]',
    )
    out = injected(source)
    assert "exec torchrun" in notes(source)
    assert docs(out)[0]["spec"]["template"]["spec"]["containers"][0]["command"][3] == "/bin/sh"


def test_restart_policy_on_failure_gets_no_failure_policy_and_a_note():
    source = JOB.replace("restartPolicy: Never", "restartPolicy: OnFailure")
    job = docs(injected(source))[0]
    assert "podFailurePolicy" not in job["spec"]
    assert "restartPolicy is 'OnFailure'" in notes(source)


CMD = 'command: [torchrun, --nproc-per-node, "2", /app/train.py]'
NO_CMD = TRAINJOB.replace("    command: [torchrun, /app/train.py]\n", "")


def job_with(command: str) -> str:
    return JOB.replace(CMD, f"command: [{command}, torchrun, /app/train.py]")


MOUNT = "volumeMounts: [{name: d, mountPath: /mnt/jitckpt}]\n        args:"
SIDE = "  containers:\n  - {name: side, image: s, command: [x]}\n"
REFUSALS = [
    ("no command", JOB.replace(f"        {CMD}\n", ""), "has no command"),
    ("tini", job_with("/usr/bin/tini, --"), "init wrapper 'tini'"),
    ("base-image entrypoint", job_with("jitckpt-entrypoint, --"),
     "already runs jitckpt-entrypoint"),
    ("other bundle path", job_with("python3, /opt/x/jitckpt-entrypoint, --"),
     "already runs a jitckpt-entrypoint from '/opt/x/jitckpt-entrypoint'"),
    ("deployment", JOB.replace("batch/v1", "apps/v1").replace("kind: Job", "kind: Deployment"),
     "apps/v1 Deployment is not supported"),
    ("unknown kind", "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n",
     "Widget is not supported"),
    ("two containers", POD.replace("  containers:\n", SIDE),
     "the pod has 2 containers (side, train)"),
    ("volume name taken", JOB + "      volumes: [{name: jitckpt, emptyDir: {}}]\n",
     "partially injected"),
    ("mount path taken",
     JOB.replace("args:", MOUNT) + "      volumes: [{name: d, emptyDir: {}}]\n",
     "/mnt/jitckpt is already a mount point"),
    ("trainjob without command", NO_CMD, "no spec.trainer.command"),
    ("not an object", "- just\n- a list\n", "not a Kubernetes object"),
    ("bad yaml", "kind: Job\n  metadata: [\n", "not valid YAML at line"),
    ("empty", "---\n---\n", "no Kubernetes objects"),
    ("no pod template", "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\nspec: {}\n",
     "no pod template"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("source", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_refusals_are_one_line_exit_1_and_write_nothing(source, message, capsys, monkeypatch):
    code, out, err = run(source, capsys=capsys, monkeypatch=monkeypatch)
    assert (code, out) == (1, "")
    assert err.startswith("jitckpt-sidecar inject: error: <stdin>")
    assert message in err
    assert err.count("\n") == 1


def test_a_partially_injected_pod_is_refused(capsys, monkeypatch):
    pod = docs(injected(POD))[0]
    pod["spec"]["initContainers"] = [
        c for c in pod["spec"]["initContainers"] if c["name"] != "jitckpt-sidecar"
    ]
    code, _, err = run(yaml.safe_dump(pod), capsys=capsys, monkeypatch=monkeypatch)
    assert code == 1
    assert "partially injected" in err


def test_the_whole_stream_is_refused_when_one_document_is(capsys, monkeypatch):
    code, out, err = run(
        JOB + "---\n" + NO_CMD,
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    assert (code, out) == (1, "")
    assert "document 2 (TrainJob/train)" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--storage-uri", "http://x"], "is not an S3 URI"),
        (["--capacity", "lots"], "is not a Kubernetes quantity"),
        (["--sidecar-mode", "maybe"], "invalid choice"),
        (["--trainjob-runtime", "torch"], "use TrainingRuntime/NAME"),
    ],
)
def test_bad_options_are_usage_errors(args, message, capsys):
    assert inject.main([*STORAGE, *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_storage_uri_is_required(capsys):
    assert inject.main([]) == 2
    assert "--storage-uri" in capsys.readouterr().err


def test_reports_one_line_per_object_on_stderr(capsys, monkeypatch):
    code, out, err = run(JOB + "---\n" + SERVICE, capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0
    assert len(docs(out)) == 2
    assert err.splitlines() == [
        (
            "jitckpt-sidecar inject: <stdin>: document 1 (Job/train): injected "
            "(trainer container train)"
        ),
        "jitckpt-sidecar inject: <stdin>: document 2 (Service/train): Service passed through",
    ]


def test_the_jitckpt_sidecar_command_reads_a_file_and_writes_yaml(tmp_path):
    """Through the console script, as users run it: `jitckpt-sidecar inject -f FILE`."""
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from jitckpt_sidecar.cli import main; sys.exit(main())",
         "inject", "-f", str(path), *STORAGE],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert docs(result.stdout)[0]["kind"] == "Job"


@pytest.mark.parametrize("capacity", ["50Gi", "1e9", "500m", "+1Gi", "1.5G", "0", "50GB", "1.2.3"])
def test_capacity_is_accepted_exactly_when_the_sidecar_accepts_what_inject_writes(
    capacity, capsys, monkeypatch
):
    """--capacity goes through the sidecar's own quantity parser and check: inject never
    writes a JITCKPT_STORAGE_CAPACITY that makes the sidecar exit 2, nor refuses one it takes."""
    code, out, err = run(JOB, "--capacity", capacity, capsys=capsys, monkeypatch=monkeypatch)
    try:
        sidecar_config.Config.from_env(
            {"JITCKPT_STORAGE_URI": "s3://ckpt/x", "JITCKPT_STORAGE_CAPACITY": capacity}
        )
        accepted = True
    except SettingError:
        accepted = False
    assert code == (0 if accepted else 2), err
    if accepted:
        sidecar = containers(docs(out)[0]["spec"]["template"]["spec"])["jitckpt-sidecar"]
        # The env inject wrote, as read there (the kubelet fills the downward API's values).
        written = {k: v for k, v in env_of(sidecar).items() if isinstance(v, str)}
        sidecar_config.Config.from_env(written)
    else:
        assert f"--capacity {capacity!r}" in err


def test_the_command_line_prints_the_rewriters_warnings_even_when_quiet(capsys, monkeypatch):
    """Core functions return warnings; the CLI prints them (also with -q)."""
    source = JOB.replace(CMD, 'command: [/bin/sh, -c, "torchrun /app/train.py"]')
    code, _, err = run(source, "-q", capsys=capsys, monkeypatch=monkeypatch)
    assert code == 0
    warning = (
        "jitckpt-sidecar inject: warning: <stdin>: Job/train: container 'train' runs a shell; "
        "make its last command `exec torchrun ...` so SIGTERM reaches torchrun"
    )
    assert err.splitlines() == [warning]


def test_the_sidecar_gets_the_trainers_node_rank_and_node_count():
    """With them it restores only what its node's ranks load (a sharded checkpoint)."""
    text = JOB.replace(
        '        args: [--lr, "1e-4"]\n',
        '        args: [--lr, "1e-4"]\n'
        "        env:\n"
        '        - {name: PET_NNODES, value: "4"}\n'
        "        - name: PET_NODE_RANK\n"
        "          valueFrom: {fieldRef: {fieldPath: \"metadata.annotations['batch.kubernetes.io/"
        "job-completion-index']\"}}\n",
    )
    pod = docs(injected(text))[0]["spec"]["template"]["spec"]
    sidecar = containers(pod)["jitckpt-sidecar"]
    by_name = {v["name"]: v for v in sidecar["env"]}
    assert by_name["JITCKPT_NNODES"] == {"name": "JITCKPT_NNODES", "value": "4"}
    assert by_name["JITCKPT_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith(
        "job-completion-index']"
    )
    assert "JITCKPT_NODE_RANK" not in env_of(containers(pod)["train"])


def test_a_pytorchjob_gets_a_sidecar_in_every_replica_type_with_one_storage_uri():
    """Master and Worker pods are each wrapped (the operator's `pytorch` container, even beside
    another one), with the operator's restart semantics in a note, not a podFailurePolicy."""
    job = docs(injected(PYTORCHJOB))[0]
    uris = set()
    for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
        pod = replica["template"]["spec"]
        by_name = containers(pod)
        assert by_name["pytorch"]["command"][:3] == ["python3", "/jitckpt/jitckpt-entrypoint", "--"]
        assert "command" not in by_name.get("log-shipper", {}), rtype
        assert [c["name"] for c in pod["initContainers"]] == ["jitckpt-install", "jitckpt-sidecar"]
        uris.add(env_of(by_name["jitckpt-sidecar"])["JITCKPT_STORAGE_URI"])
        uris.add(env_of(by_name["pytorch"])["JITCKPT_STORAGE_URI"])
    assert uris == {"s3://ckpt/team-a/run-1"}
    assert "podFailurePolicy" not in job["spec"]
    said = notes(PYTORCHJOB)
    assert "Worker: restartPolicy OnFailure: the container restarts in place" in said
    assert "Master: restartPolicy" not in said  # ExitCode: the JIT exit 143 is retried
    never = notes(PYTORCHJOB.replace("restartPolicy: ExitCode", "restartPolicy: Never"))
    assert "Master: restartPolicy Never: a JIT exit fails the PyTorchJob" in never


def test_memory_adds_a_memory_backed_volume_for_snapshots_and_raises_the_memory_limit():
    limited = POD.replace(
        "    securityContext: {runAsUser: 1234}\n",
        "    securityContext: {runAsUser: 1234}\n"
        "    resources: {limits: {memory: 64Gi}, requests: {memory: 64Gi}}\n",
    )
    text = injected(limited, "memory", "24Gi")
    assert assert_valid(text) >= 1
    pod = docs(text)[0]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "jitckpt-memory")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "24Gi"}
    train = containers(pod)["train"]
    assert {"name": "jitckpt-memory", "mountPath": "/mnt/jitckpt-memory"} in train["volumeMounts"]
    assert env_of(train)["JITCKPT_MEMORY_DIR"] == "/mnt/jitckpt-memory"
    sidecar = containers(pod)["jitckpt-sidecar"]  # it writes out what a killed trainer left
    mount = {"name": "jitckpt-memory", "mountPath": "/mnt/jitckpt-memory", "readOnly": True}
    assert mount in sidecar["volumeMounts"]
    assert env_of(sidecar)["JITCKPT_MEMORY_DIR"] == "/mnt/jitckpt-memory"
    assert train["resources"]["limits"]["memory"] == "88Gi"
    assert train["resources"]["requests"]["memory"] == "88Gi"  # the scheduler counts it too
    assert "memory limit raised to 88Gi" in notes(limited, "memory", "24Gi")
    assert injected(text, "memory", "24Gi") == text  # a second run changes nothing
    assert "has no memory limit" in notes(POD, "memory", "24Gi")
    with pytest.raises(InjectError, match="already injected with --memory"):
        injected(text)
    with pytest.raises(InjectError, match="already injected without --memory"):
        injected(injected(POD), "memory", "24Gi")
    assert "not applied to a TrainJob" in notes(TRAINJOB, "memory", "24Gi")
    plain = docs(injected(POD))[0]["spec"]  # without --memory: no RAM tier
    assert "jitckpt-memory" not in [v["name"] for v in plain["volumes"]]
    assert "JITCKPT_MEMORY_DIR" not in env_of(containers(plain)["train"])
    assert "JITCKPT_MEMORY_DIR" not in env_of(containers(plain)["jitckpt-sidecar"])


PEERS = "http://train-{node}.train:9402"


def test_peers_set_up_the_peer_replica_in_the_sidecar_with_its_token_from_a_secret():
    """--peers with --memory and --peer-secret: the sidecar gets JITCKPT_PEERS and the token
    from the Secret's key `token` (never a value in the YAML), writes the memory volume (the
    peer's snapshot, its own restored from it) and has the volume's size on top of its memory
    limit; a node count missing from the trainer's env is a warning. Without --memory or the
    Secret: one line, as the sidecar would say at start."""
    text = JOB.replace(
        '        args: [--lr, "1e-4"]\n',
        '        args: [--lr, "1e-4"]\n        env:\n        - {name: PET_NNODES, value: "2"}\n',
    ).replace("spec:\n  template:", "spec:\n  completionMode: Indexed\n  template:")
    args = ("memory", "24Gi", "peers", PEERS, "peer_secret", "jitckpt-peer")
    out = injected(text, *args)
    assert assert_valid(out) >= 1
    pod = docs(out)[0]["spec"]["template"]["spec"]
    sidecar = containers(pod)["jitckpt-sidecar"]
    by_name = {v["name"]: v for v in sidecar["env"]}
    assert by_name["JITCKPT_PEERS"]["value"] == PEERS
    token = {"secretKeyRef": {"name": "jitckpt-peer", "key": "token"}}
    assert by_name["JITCKPT_PEER_TOKEN"] == {"name": "JITCKPT_PEER_TOKEN", "valueFrom": token}
    assert {"name": "jitckpt-memory", "mountPath": "/mnt/jitckpt-memory"} in sidecar["volumeMounts"]
    assert sidecar["resources"]["limits"]["memory"] == "25Gi"
    assert sidecar["resources"]["requests"]["memory"] == "256Mi"
    said = notes(text, *args)
    assert "the peer replica: jitckpt-sidecar's memory limit is 25Gi" in said
    assert "needs the node count" not in said
    assert "helps when the other nodes' trainers restart in place" in said  # Never, no restarts
    restarting = text.replace(
        'command: [torchrun, --nproc-per-node, "2"',
        'command: [torchrun, --max-restarts=3, --nproc-per-node, "2"',
    )
    assert "restart in place" not in notes(restarting, *args)
    indexed = JOB.replace("spec:\n  template:", "spec:\n  completionMode: Indexed\n  template:")
    assert "needs the node count" in notes(indexed, *args)
    assert injected(out, *args) == out  # a second run changes nothing
    with pytest.raises(InjectError, match="already injected with --peers 'http"):
        injected(out, "memory", "24Gi")
    with pytest.raises(InjectError, match="--peer-secret 'jitckpt-peer'"):
        injected(out, "memory", "24Gi", "peers", PEERS, "peer_secret", "other")
    with pytest.raises(InjectError, match="already injected with no --peers"):
        injected(injected(text, "memory", "24Gi"), *args)
    # No node rank for each pod: a plain Job, a PyTorchJob's templates (the webhook's job).
    with pytest.raises(InjectError, match="needs each pod's node rank"):
        injected(JOB, *args)
    with pytest.raises(InjectError, match="use the webhook"):
        injected(PYTORCHJOB, *args)
    # A JobSet of several Jobs: each counts its completion index from 0 (not a node rank).
    indexed_set = JOBSET.replace("        parallelism: 1\n", "        completionMode: Indexed\n")
    with pytest.raises(InjectError, match="needs each pod's node rank"):
        injected(indexed_set, *args)
    index_as_rank = indexed_set.replace(
        "              command: [torchrun, /app/train.py]\n",
        "              command: [torchrun, /app/train.py]\n"
        "              env:\n"
        "              - name: PET_NODE_RANK\n"
        '                valueFrom: {fieldRef: {fieldPath: "metadata.annotations'
        "['batch.kubernetes.io/job-completion-index']\"}}\n",
    )
    with pytest.raises(InjectError, match="needs each pod's node rank"):
        injected(index_as_rank, *args)
    ranked = JOB.replace(
        '        args: [--lr, "1e-4"]\n',
        '        args: [--lr, "1e-4"]\n        env:\n        - {name: PET_NODE_RANK, value: "0"}\n',
    )
    assert "JITCKPT_PEERS" in injected(ranked, *args)
    with pytest.raises(SettingError, match="needs --memory"):
        options("peers", PEERS, "peer_secret", "jitckpt-peer")
    with pytest.raises(SettingError, match="needs --peer-secret"):
        options("memory", "24Gi", "peers", PEERS)
    with pytest.raises(SettingError, match=r"--peer-secret=.* needs --peers"):
        options("memory", "24Gi", "peer_secret", "jitckpt-peer")
    with pytest.raises(SettingError, match="peers"):
        options("memory", "24Gi", "peers", "train-0:9402", "peer_secret", "jitckpt-peer")

    # Sidecar-as-container mode: the restore init container asks the peer before the trainer.
    plain = docs(injected(text, *args, "sidecar_mode", "container"))[0]["spec"]["template"]
    restore = containers(plain["spec"])["jitckpt-restore"]
    assert {v["name"] for v in restore["env"]} >= {"JITCKPT_PEERS", "JITCKPT_PEER_TOKEN"}
    assert {"name": "jitckpt-memory", "mountPath": "/mnt/jitckpt-memory"} in restore["volumeMounts"]
    assert restore["resources"]["limits"]["memory"] == "25Gi"
    no_peers = docs(injected(text, "memory", "24Gi", "sidecar_mode", "container"))[0]
    restore = containers(no_peers["spec"]["template"]["spec"])["jitckpt-restore"]
    assert "jitckpt-memory" not in [v["name"] for v in restore["volumeMounts"]]

    # The sidecar starts with what inject wrote (the Secret's value and the pod's node rank).
    env = {v["name"]: v.get("value", "") for v in sidecar["env"] if "value" in v}
    env.update(JITCKPT_PEER_TOKEN="t", JITCKPT_NODE_RANK="1", JITCKPT_NNODES="2")
    cfg = sidecar_config.Config.from_env(env)
    assert (cfg.peers, cfg.memory_dir) == (PEERS, "/mnt/jitckpt-memory")
