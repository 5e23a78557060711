"""Bad inputs to either component fail fast, in one line that names the fix, and harm nothing.

The cross-component, end-to-end data-safety check (tests/unit/test_config.py,
tests/unit/test_sidecar_config.py, tests/integration/test_entrypoint.py and
tests/integration/test_sidecar_errors.py check messages one component at a time): every case
runs the real `jitckpt-entrypoint` or `jitckpt-sidecar` against a shared volume that already
holds a committed checkpoint, a committed-and-staged one and a half-written one, and a bucket
that holds a committed checkpoint, a half-uploaded one and another team's object. Each bad
input must end the process with the documented code (2 configuration, 3 S3 access) and one
jitckpt line on stderr naming what to change, before the training command runs or anything
is restored, uploaded or pruned: the volume's files (path, size, mtime), the bucket's objects
and the list of buckets are the same afterwards, and the secret key never appears in output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, cast

import pytest

from harness.checkpoints import SIDECAR, commit, hf_files, sidecar_env, upload_directly
from harness.procs import ENTRYPOINT
from harness.s3 import Bucket, MotoServer, free_port

pytestmark = pytest.mark.integration

SECRET = "jitckpt-BAD-INPUTS-secret-4f9c1e"  # noqa: S105 - fake; output must not show it
"""AWS_SECRET_ACCESS_KEY in every case: it must never reach stdout or stderr."""
CASE_SECONDS = 15.0
"""A bad input is reported at start-up; the S3 probe gives up after two quick tries."""
_buckets = itertools.count(1)
RUN = ("--", "{script}")
"""The training command: a script that creates the marker file if it ever runs."""
WEBHOOK = ("webhook", "--tls-cert-file", "/no/tls.crt", "--tls-private-key-file", "/no/tls.key")
"""The webhook's flags are checked before its certificate is read."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: the process, its arguments and environment, and what it must say."""

    component: str
    """entrypoint or sidecar."""
    argv: tuple[str, ...]
    """Arguments; {script}, {file}, {noexec}, {secret}, {port}, {bucket} are filled in."""
    env: Mapping[str, Optional[str]]
    """Changes to the environment (None removes a variable); placeholders as in argv."""
    code: int
    """The documented exit code: 2 configuration, 3 S3 access."""
    needles: tuple[str, ...]
    """Substrings of the one error line: what is wrong and what to change."""


def ep(
    argv: tuple[str, ...], env: Mapping[str, Optional[str]], *needles: str, code: int = 2
) -> Case:
    return Case("entrypoint", argv, env, code, needles)


def sc(
    argv: tuple[str, ...], env: Mapping[str, Optional[str]], *needles: str, code: int = 2
) -> Case:
    return Case("sidecar", argv, env, code, needles)


CASES = [
    # --- jitckpt-entrypoint ---------------------------------------------------------------
    pytest.param(
        ep(("--grace-second", "60", *RUN), {}, "unrecognized arguments: --grace-second"),
        id="entrypoint-unknown-flag",
    ),
    pytest.param(
        ep(("--grace\nseconds", "60", *RUN), {}, "unrecognized arguments: --grace\\nseconds"),
        id="entrypoint-unknown-flag-with-newline",
    ),
    pytest.param(
        ep(("--exit-code", *RUN), {}, "argument --exit-code: expected one argument"),
        id="entrypoint-flag-without-value",
    ),
    pytest.param(
        ep(("--grace-seconds", "60", "{script}"), {}, "missing '--' before the training command"),
        id="entrypoint-no-double-dash",
    ),
    pytest.param(
        ep(("--",), {}, "missing the training command after '--'"),
        id="entrypoint-missing-command",
    ),
    pytest.param(
        ep(("--", "no-such-trainer-xyz"), {}, "command not found on PATH: 'no-such-trainer-xyz'"),
        id="entrypoint-command-not-found",
    ),
    pytest.param(
        ep(("--", "{noexec}"), {}, "not executable", "train-noexec.sh"),
        id="entrypoint-command-not-executable",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_GRACE_SECONDS": "30s"}, "JITCKPT_GRACE_SECONDS='30s' is not an integer"),
        id="entrypoint-grace-not-integer",
    ),
    pytest.param(
        ep(("--grace-seconds", "0", *RUN), {}, "--grace-seconds 0 is invalid", ">= 1"),
        id="entrypoint-grace-zero",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_GRACE_SECONDS": "-5"}, "JITCKPT_GRACE_SECONDS=-5 is invalid"),
        id="entrypoint-grace-negative",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_EXIT_CODE": "0"}, "JITCKPT_EXIT_CODE=0 is invalid", "1 to 255"),
        id="entrypoint-exit-code-zero",
    ),
    pytest.param(
        ep(("--exit-code", "256", *RUN), {}, "--exit-code 256 is invalid", "1 to 255"),
        id="entrypoint-exit-code-256",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_EXIT_CODE": "143.0"}, "JITCKPT_EXIT_CODE='143.0' is not an integer"),
        id="entrypoint-exit-code-not-integer",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_DIR": "{file}"}, "JITCKPT_DIR=", "is not writable", "set JITCKPT_DIR"),
        id="entrypoint-dir-is-a-file",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_DIR": "{file}/sub"}, "JITCKPT_DIR=", "is not writable"),
        id="entrypoint-dir-unwritable",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_DIR": "mnt/jitckpt"}, "JITCKPT_DIR='mnt/jitckpt'", "absolute path"),
        id="entrypoint-dir-relative",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_STORAGE_URI": "gs://ckpts/run"}, "is not an S3 URI", "s3://bucket"),
        id="entrypoint-storage-uri-not-s3",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_STORAGE_URI": "s3:///run"}, "'' is not a valid bucket name"),
        id="entrypoint-storage-uri-no-bucket",
    ),
    pytest.param(
        ep(
            RUN,
            {"JITCKPT_STORAGE_URI": "s3a://AKIAJITCKPTTESTKEY01:{secret}@ckpts/run"},
            "JITCKPT_STORAGE_URI='s3a://***@ckpts/run' carries credentials",
            "AWS_SECRET_ACCESS_KEY",
        ),
        id="entrypoint-storage-uri-with-credentials",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_SAVE_STEPS": "0"}, "JITCKPT_SAVE_STEPS=0 is invalid", ">= 1"),
        id="entrypoint-save-steps-zero",
    ),
    pytest.param(
        ep(
            ("--save-strategy", "hourly", *RUN),
            {},
            "--save-strategy 'hourly' is invalid",
            "no, steps, epoch",
        ),
        id="entrypoint-save-strategy",
    ),
    pytest.param(
        ep(RUN, {"JITCKPT_JIT": "maybe"}, "JITCKPT_JIT='maybe' is not a boolean", "1 or 0"),
        id="entrypoint-bad-boolean",
    ),
    # --- jitckpt-sidecar --------------------------------------------------------------------
    pytest.param(
        sc(("run",), {"JITCKPT_STORAGE_URI": None}, "JITCKPT_STORAGE_URI=''", "AWS_S3_BUCKET"),
        id="sidecar-missing-storage-uri",
    ),
    pytest.param(
        sc(
            ("restore",),
            {"JITCKPT_STORAGE_URI": "s3:/{bucket}/run"},
            "JITCKPT_STORAGE_URI='s3:/",
            "is not an S3 URI",
        ),
        id="sidecar-malformed-storage-uri",
    ),
    pytest.param(
        sc(("restor",), {}, "unknown command 'restor'", "run, restore, check"),
        id="sidecar-unknown-command",
    ),
    pytest.param(
        sc(("install",), {}, "give exactly one DIR", "install DIR"),
        id="sidecar-install-without-a-directory",
    ),
    pytest.param(
        sc(
            ("run", "--upload-concurency", "4"),
            {},
            "unrecognized arguments: --upload-concurency",
        ),
        id="sidecar-unknown-flag",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_UPLOAD_CONCURRENCY": "0"},
            "JITCKPT_UPLOAD_CONCURRENCY=0 is invalid",
            "1 to 64",
        ),
        id="sidecar-concurrency-zero",
    ),
    pytest.param(
        sc(
            ("restore", "--download-concurrency", "four"),
            {},
            "--download-concurrency 'four' is not an integer",
        ),
        id="sidecar-concurrency-not-integer",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_MULTIPART_CHUNK": "16MB"},
            "JITCKPT_MULTIPART_CHUNK='16MB' is not a Kubernetes quantity",
            "64Mi",
        ),
        id="sidecar-chunk-unit",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_DISK_PRESSURE_THRESHOLD": "1.5"},
            "JITCKPT_DISK_PRESSURE_THRESHOLD=1.5 is invalid",
            "(0, 1]",
        ),
        id="sidecar-pressure-threshold-above-1",
    ),
    pytest.param(
        sc(("run",), {"JITCKPT_METRICS_PORT": "70000"}, "JITCKPT_METRICS_PORT=70000 is invalid"),
        id="sidecar-metrics-port-out-of-range",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_METRICS_PORT": "{port}"},
            "cannot listen on 127.0.0.1:{port}",
            "JITCKPT_METRICS_PORT",
        ),
        id="sidecar-metrics-port-taken",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_S3_ADDRESSING": "vhost"},
            "JITCKPT_S3_ADDRESSING='vhost' is invalid",
            "auto, path, virtual",
        ),
        id="sidecar-s3-addressing",
    ),
    pytest.param(
        sc(("run",), {"JITCKPT_S3_KEEP": "-1"}, "JITCKPT_S3_KEEP=-1 is invalid", ">= 0"),
        id="sidecar-s3-keep-negative",
    ),
    pytest.param(
        sc(("restore",), {"JITCKPT_DIR": "{file}/sub"}, "JITCKPT_DIR=", "is not writable"),
        id="sidecar-dir-unwritable",
    ),
    pytest.param(
        sc(("run",), {"JITCKPT_DIR": "mnt/jitckpt"}, "JITCKPT_DIR='mnt/jitckpt'", "absolute"),
        id="sidecar-dir-relative",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_S3_ENDPOINT": "http://127.0.0.1:notaport"},
            "JITCKPT_S3_ENDPOINT='http://127.0.0.1:notaport' is invalid",
            "port",
        ),
        id="sidecar-endpoint-bad-port",
    ),
    pytest.param(
        sc(
            ("check",),
            {"AWS_ENDPOINT_URL": "http://minio_s3:9000"},
            "AWS_ENDPOINT_URL='http://minio_s3:9000' is invalid",
            "host name",
        ),
        id="sidecar-endpoint-bad-host",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_S3_ENDPOINT": "ftp://AKIAJITCKPTTESTKEY01:{secret}@127.0.0.1:9000"},
            "JITCKPT_S3_ENDPOINT='ftp://***@127.0.0.1:9000' is invalid",
            "http://",
        ),
        id="sidecar-endpoint-with-credentials",
    ),
    pytest.param(
        sc(
            ("run",),
            {"AWS_DEFAULT_REGION": "us east 1"},
            "'us east 1' is not a region name",
            "AWS_DEFAULT_REGION",
        ),
        id="sidecar-bad-region",
    ),
    # --- jitckpt-sidecar webhook: refused at start, before it listens -------------------
    pytest.param(
        sc(("webhook",), {}, "required: --tls-cert-file, --tls-private-key-file"),
        id="sidecar-webhook-without-a-certificate",
    ),
    pytest.param(
        sc(
            ("webhook", "--tls-cert-file", "{file}", "--tls-private-key-file", "{file}"),
            {},
            "cannot load the TLS certificate {file}",
            "check --tls-cert-file and --tls-private-key-file",
        ),
        id="sidecar-webhook-certificate-not-pem",
    ),
    pytest.param(
        sc(
            (*WEBHOOK, "--storage-uri-prefix", "s3://b/jitckpt"),
            {},
            "--storage-uri-prefix 's3://b/jitckpt'",
            "not a valid bucket name",
        ),
        id="sidecar-webhook-bad-prefix",
    ),
    pytest.param(
        sc((*WEBHOOK, "--capacity", "lots"), {}, "--capacity 'lots' is not a Kubernetes quantity"),
        id="sidecar-webhook-bad-capacity",
    ),
    pytest.param(
        sc((*WEBHOOK, "--port", "70000"), {}, "--port 70000 is invalid", "1-65535"),
        id="sidecar-webhook-bad-port",
    ),
    pytest.param(
        sc(
            ("install", "{file}/sub"),
            {},
            "cannot write the entrypoint bundle into",
            "mount a writable volume",
        ),
        id="sidecar-install-unwritable",
    ),
    pytest.param(
        sc(
            ("run",),
            {"JITCKPT_STORAGE_URI": "s3://jitckpt-no-such-bucket/run"},
            "bucket 'jitckpt-no-such-bucket' does not exist",
            "JITCKPT_STORAGE_URI",
            code=3,
        ),
        id="sidecar-missing-bucket",
    ),
    pytest.param(
        sc(
            ("restore",),
            {"AWS_ENDPOINT_URL": "{auth}"},
            "InvalidAccessKeyId",
            "check AWS_ACCESS_KEY_ID",
            code=3,
        ),
        id="sidecar-credentials-refused",
    ),
    pytest.param(
        sc(
            ("run",),
            {"AWS_ENDPOINT_URL": "{dead}"},
            "cannot connect to the S3 endpoint {dead}",
            "AWS_ENDPOINT_URL",
            code=3,
        ),
        id="sidecar-endpoint-unreachable",
    ),
]


@pytest.fixture(scope="module")
def auth_server() -> Iterator[MotoServer]:
    """An S3 server that checks credentials and knows none of ours."""
    server = MotoServer(auth=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_client(moto_server: MotoServer) -> Any:
    """One client for the module: s3_bucket builds a boto3 session per test (~0.3 s), which
    over 40-odd cases would be most of the suite's time."""
    return moto_server.client()


@pytest.fixture
def bucket(moto_server: MotoServer, s3_client: Any) -> Iterator[Bucket]:
    """A fresh bucket for one case, like s3_bucket's (the same Bucket helper and prefix)."""
    name = f"jitckpt-bad-inputs-{next(_buckets)}"
    s3_client.create_bucket(Bucket=name)
    yield Bucket(moto_server, name, s3_client)
    listed = s3_client.list_objects_v2(Bucket=name).get("Contents", [])
    if listed:
        keys = [{"Key": obj["Key"]} for obj in listed]
        s3_client.delete_objects(Bucket=name, Delete={"Objects": keys})
    s3_client.delete_bucket(Bucket=name)


@pytest.fixture(scope="module")
def uploaded(
    moto_server: MotoServer, s3_client: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Bucket]:
    """checkpoint-30 committed in S3 by the sidecar's own uploader, once; each case copies it."""
    name = "jitckpt-bad-inputs-template"
    s3_client.create_bucket(Bucket=name)
    template = Bucket(moto_server, name, s3_client)
    node = tmp_path_factory.mktemp("uploaded-node")
    commit([node], 30, [hf_files(30, big=4096)])
    upload_directly(template, node, 30)
    yield template
    for key in sorted(template.keys()):
        template.delete(key)
    s3_client.delete_bucket(Bucket=name)


def populate(jdir: Path, bucket: Bucket, uploaded: Bucket) -> None:
    """A volume and a bucket worth protecting: local checkpoint-10 committed, checkpoint-20
    committed and staged for upload, checkpoint-25 half-written; in S3 a committed
    checkpoint-30 (newer: a restore would fetch it), a half-uploaded checkpoint-40 (retention
    or cleanup would touch it) and an object outside the prefix."""
    commit([jdir], 10, [hf_files(10, big=4096)], staged=False)
    commit([jdir], 20, [hf_files(20, big=4096)])
    partial = jdir / "checkpoints" / "checkpoint-25"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a shard")
    for key in sorted(uploaded.keys()):  # server-side copies keep the uploader's metadata
        source = {"Bucket": uploaded.name, "Key": uploaded.key(key)}
        bucket.client.copy_object(Bucket=bucket.name, Key=bucket.key(key), CopySource=source)
    bucket.put(b"half an upload", "checkpoint-40", "model.safetensors")
    bucket.client.put_object(Bucket=bucket.name, Key="another-team/data.bin", Body=b"theirs")


def tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every file (size, mtime) and directory under `root`."""
    out: dict[str, tuple[Any, ...]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        rel = str(path.relative_to(root))
        out[rel] = ("dir",) if stat.S_ISDIR(info.st_mode) else (info.st_size, info.st_mtime_ns)
    return out


def objects(bucket: Bucket) -> dict[str, tuple[Any, ...]]:
    """Every object of the bucket (size, ETag, last modified) and the server's bucket names."""
    out: dict[str, tuple[Any, ...]] = {
        "buckets": tuple(sorted(b["Name"] for b in bucket.client.list_buckets()["Buckets"]))
    }
    for page in bucket.client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = (obj["Size"], obj["ETag"], obj["LastModified"])
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_fails_fast_in_one_line_before_anything_runs_and_harms_nothing(
    case: Case,
    request: pytest.FixtureRequest,
    spawn: Any,
    base_env: dict[str, str],
    jdir: Path,
    bucket: Bucket,
    uploaded: Bucket,
    tmp_path: Path,
) -> None:
    """Exit 2 (config) or 3 (S3 access), one jitckpt line naming the fix, no secret, the
    command never ran, and the volume and the bucket are exactly as they were."""
    populate(jdir, bucket, uploaded)
    assert len(bucket.keys("checkpoint-30")) == len(uploaded.keys())
    marker = tmp_path / "training-ran"
    script = tmp_path / "train.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    noexec = tmp_path / "train-noexec.sh"
    noexec.write_text(script.read_text())
    noexec.chmod(0o644)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    cwd = tmp_path / "cwd"  # a relative JITCKPT_DIR would land here
    cwd.mkdir()

    with contextlib.ExitStack() as stack:
        values = {
            "script": str(script),
            "noexec": str(noexec),
            "file": str(a_file),
            "secret": SECRET,
            "bucket": bucket.name,
            "dead": f"http://127.0.0.1:{free_port()}",
            "port": "",
            "auth": "",
        }
        if "{port}" in str(case.env):
            taken = stack.enter_context(socket.socket())
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            values["port"] = str(taken.getsockname()[1])
        if "{auth}" in str(case.env):
            values["auth"] = request.getfixturevalue("auth_server").endpoint

        def fill(text: str) -> str:
            for name, value in values.items():
                text = text.replace("{" + name + "}", value)
            return text

        env = sidecar_env(bucket.env(base_env))
        env["AWS_SECRET_ACCESS_KEY"] = SECRET
        termination = tmp_path / "termination-log"  # the kubelet's file, not on the volume
        env["JITCKPT_TERMINATION_LOG"] = str(termination)
        for name, value in case.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = fill(value)
        program = ENTRYPOINT if case.component == "entrypoint" else SIDECAR
        argv = [*program, *(fill(arg) for arg in case.argv)]

        volume_before, bucket_before = tree(jdir), objects(bucket)
        started = time.monotonic()
        proc = spawn(argv, env=env, cwd=cwd)
        code = proc.wait(CASE_SECONDS)
        elapsed = time.monotonic() - started

    output = proc.output()
    assert code == case.code, output
    assert elapsed < CASE_SECONDS, output
    lines = [line for line in proc.stderr if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith(f"jitckpt-{case.component}"), output
    for needle in case.needles:
        assert fill(needle) in lines[0], output
    assert proc.stdout == [], output
    assert SECRET not in output
    assert not marker.exists(), "the training command ran"
    assert os.listdir(cwd) == [], "something was created in the working directory"
    assert tree(jdir) == volume_before, "the shared volume changed"
    assert objects(bucket) == bucket_before, "the bucket changed"
    if termination.exists():  # a sidecar failure after its settings were read: the same line
        message = termination.read_text()
        assert message.count("\n") == 1, message
        assert message.split(": ", 1)[1].strip() in lines[0], (message, output)


def test_with_good_inputs_the_same_checks_see_training_and_a_restore(
    spawn: Any,
    base_env: dict[str, str],
    jdir: Path,
    bucket: Bucket,
    uploaded: Bucket,
    tmp_path: Path,
) -> None:
    """The control: valid settings run the command (the marker appears) and restore
    checkpoint-30 into the volume (its snapshot changes), so the checks above can fail."""
    populate(jdir, bucket, uploaded)
    env = sidecar_env(bucket.env(base_env))
    env["AWS_SECRET_ACCESS_KEY"] = SECRET
    marker = tmp_path / "training-ran"
    before = tree(jdir)
    restore = spawn([*SIDECAR, "restore"], env=env)
    assert restore.wait(CASE_SECONDS) == 0, restore.output()
    train = spawn([*ENTRYPOINT, "--", "sh", "-c", f"touch {marker}"], env=env)
    assert train.wait(CASE_SECONDS) == 0, train.output()
    assert marker.exists()
    after = tree(jdir)
    assert after != before
    assert "checkpoints/checkpoint-30/model.safetensors" in after
    assert SECRET not in restore.output() + train.output()


def test_the_table_covers_both_components() -> None:
    """At least a dozen distinct bad inputs per component, each with an expected message."""
    cases = [cast(Case, param.values[0]) for param in CASES]
    assert len({param.id for param in CASES}) == len(CASES)
    for component in ("entrypoint", "sidecar"):
        assert sum(c.component == component for c in cases) >= 12
    assert all(c.needles and c.code in (2, 3) for c in cases)
