"""The sidecar on a real store (Ceph RGW 16) set up as a new user would: only the endpoint, the
CA bundle (HTTPS) and the keys. RGW refuses botocore's default flexible checksums over HTTPS
(411 MissingContentLength on aws-chunked bodies); the sidecar notices at start-up, says so in
one line and works; over HTTP and on moto nothing needs switching."""

from __future__ import annotations

import statistics
import time

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    data,
    hf_files,
    log_line,
    sidecar_env,
    write_trainer,
)
from harness.s3 import Bucket
from jitckpt_entrypoint.protocol import validity
from jitckpt_sidecar import s3
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.remote import CHECKSUM_META

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw", "rgw-http")]
SWITCH = r"refuses S3's flexible checksums \(MissingContentLength\)"
BIG = 11 * 1024 * 1024  # three 5 MiB parts: the multipart path, and ranged GETs on restore


def refuses_checksums(bucket: Bucket) -> bool:
    """Which stores refuse botocore's default checksums (RGW 16 over HTTPS)."""
    return bucket.server.name == "rgw"


def test_check_reports_whether_the_store_needed_checksums_when_required(spawn, base_env, s3_bucket):
    """`check` passes on every store with nothing but endpoint, CA bundle and keys, and
    reports the switch to checksums "when required" exactly where the store needed it."""
    proc = spawn([*SIDECAR, "check"], env=s3_bucket.env(base_env))
    assert proc.wait(60) == 0, proc.output()
    assert proc.stdout[0].startswith("jitckpt-sidecar: ok: s3://"), proc.output()
    notes = [line for line in proc.stdout if "flexible checksums" in line]
    if refuses_checksums(s3_bucket):
        assert len(notes) == 1, proc.output()
        assert "MissingContentLength" in notes[0]
        assert "xxh128 checksums still verify every file" in notes[0]
    else:
        assert notes == [], proc.output()
    assert not [line for line in proc.stderr if "flexible checksums" in line]


def test_upload_then_restore_on_a_fresh_volume_is_byte_for_byte(
    spawn, base_env, s3_bucket, tmp_path
):
    """`run` uploads a checkpoint with a multipart shard and exits with the trainer; `restore`
    on an empty volume gets every byte back; each object keeps its checksum metadata; the
    checksum switch is logged once by each command where the store needs it."""
    root = tmp_path / "node"
    files = {**hf_files(10), "model-2.safetensors": data(BIG, 3)}
    commit([root], 10, [files])
    write_trainer(root, exited=True)
    up = spawn(
        SIDECAR,
        env=sidecar_env(
            s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}), JITCKPT_EXIT_WITH_TRAINER="1"
        ),
    )
    assert up.wait(120) == 0, up.output()
    log_line(up, r"uploaded checkpoint-10 \(node 0\) to s3://\S+: 6 files \(0 already there\)")
    head = s3_bucket.client.head_object(
        Bucket=s3_bucket.name, Key=s3_bucket.key("checkpoint-10", "model-2.safetensors")
    )
    assert head["ContentLength"] == BIG
    assert head["Metadata"][CHECKSUM_META].startswith("xxh128:")

    fresh = tmp_path / "fresh"
    down = spawn(
        [*SIDECAR, "restore"],
        env=sidecar_env(s3_bucket.env({**base_env, "JITCKPT_DIR": str(fresh)})),
    )
    assert down.wait(120) == 0, down.output()
    restored = fresh / "checkpoints" / "checkpoint-10"
    assert validity.committed(str(restored)) is not None
    for rel, content in files.items():
        assert isinstance(content, bytes)
        assert (restored / rel).read_bytes() == content, rel
    for proc in (up, down):
        switched = [line for line in proc.stderr if "flexible checksums" in line]
        assert len(switched) == (1 if refuses_checksums(s3_bucket) else 0), proc.output()


def test_a_user_who_chose_flexible_checksums_is_told_what_to_change(spawn, base_env, s3_bucket):
    """AWS_REQUEST_CHECKSUM_CALCULATION set by the user is kept; where the store refuses it,
    the sidecar exits 3 with one line naming the setting to change (elsewhere it just works)."""
    env = s3_bucket.env({**base_env, "AWS_REQUEST_CHECKSUM_CALCULATION": "when_supported"})
    proc = spawn([*SIDECAR, "check"], env=env)
    code = proc.wait(60)
    if not refuses_checksums(s3_bucket):
        assert code == 0, proc.output()
        return
    assert code == 3, proc.output()
    errors = [line for line in proc.stderr if " ERROR " in line]
    assert len(errors) == 1, proc.output()
    assert "PutObject" in errors[0]
    assert "(MissingContentLength)" in errors[0]
    assert "set AWS_REQUEST_CHECKSUM_CALCULATION=when_required" in errors[0]


@pytest.mark.s3_stores("rgw")
def test_an_https_endpoint_without_its_ca_bundle_names_aws_ca_bundle(spawn, base_env, s3_bucket):
    """A certificate from an internal CA, with AWS_CA_BUNDLE unset: exit 3 naming it."""
    env = s3_bucket.env(base_env)
    del env["AWS_CA_BUNDLE"]
    env.pop("SSL_CERT_FILE", None)
    proc = spawn([*SIDECAR, "check"], env=env)
    assert proc.wait(60) == 3, proc.output()
    assert any("set AWS_CA_BUNDLE" in line for line in proc.stderr), proc.output()


def test_small_responses_are_not_held_for_a_delayed_ack(monkeypatch, s3_bucket):
    """RGW's frontend (beast, Nagle's algorithm on by default) sends a response's headers and
    a small body as two segments and holds the second until the client ACKs the first, which
    Linux delays up to 40 ms on a kept-alive connection: each listing and small GET took 44 ms
    instead of 2 (quickack.py). The sidecar's clients ACK at once, on every store."""
    for name, value in s3_bucket.env({}).items():
        monkeypatch.setenv(name, value)
    cfg = Config(storage_uri=s3_bucket.uri, s3_endpoint=s3_bucket.server.endpoint)
    client = s3.make_client(cfg, s3.new_session(), checksums=s3.WHEN_REQUIRED)
    s3_bucket.put(b"{}" * 300, "small.json")
    key = s3_bucket.key("small.json")
    seconds = []
    for _ in range(15):
        start = time.perf_counter()
        client.list_objects_v2(Bucket=s3_bucket.name, Prefix=s3_bucket.prefix + "/")
        assert client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read() == b"{}" * 300
        seconds.append(time.perf_counter() - start)
    # A stall costs 40 ms per response, 80 per pair; a pair takes 3-10 ms without.
    assert statistics.median(seconds) < 0.06, seconds
