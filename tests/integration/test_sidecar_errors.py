"""Bad inputs end the sidecar with one line that names the fix, no secret, and a non-zero code."""

from __future__ import annotations

import json
import socket

import pytest

from harness.checkpoints import SIDECAR, sidecar_env
from harness.procs import free_port
from harness.s3 import FAKE_CREDENTIALS, MotoServer, s3_env

pytestmark = pytest.mark.integration
SECRET = FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]


def run_and_expect(spawn, env, argv, code, *needles):
    proc = spawn([*SIDECAR, *argv], env=env)
    assert proc.wait(60) == code, proc.output()
    lines = [line for line in proc.stderr if line.strip()]
    assert len(lines) == 1, proc.output()
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert SECRET not in proc.output()
    return lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "needles"),
    [
        ("JITCKPT_STORAGE_URI", "s3:/bucket/x", ["JITCKPT_STORAGE_URI='s3:/bucket/x'", "s3://"]),
        ("JITCKPT_STORAGE_URI", "s3://Bad_Bucket/x", ["not a valid bucket name"]),
        ("JITCKPT_STORAGE_CAPACITY", "50GB", ["JITCKPT_STORAGE_CAPACITY='50GB'", "50Gi"]),
        ("JITCKPT_METRICS_PORT", "99999", ["JITCKPT_METRICS_PORT=99999", "0 to 65535"]),
        ("JITCKPT_METRICS_PORT", "http", ["JITCKPT_METRICS_PORT='http' is not an integer"]),
        (
            "JITCKPT_DISK_PRESSURE_THRESHOLD",
            "85",
            ["JITCKPT_DISK_PRESSURE_THRESHOLD=85.0", "(0, 1]"],
        ),
        ("JITCKPT_MULTIPART_CHUNK", "1Mi", ["JITCKPT_MULTIPART_CHUNK=1048576", "5Mi to 5Gi"]),
        ("JITCKPT_EXIT_WITH_TRAINER", "maybe", ["JITCKPT_EXIT_WITH_TRAINER='maybe'", "1 or 0"]),
        ("JITCKPT_S3_ENDPOINT", "minio:9000", ["JITCKPT_S3_ENDPOINT='minio:9000'", "http"]),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable_and_exit_2(
    spawn, base_env, s3_bucket, variable, value, needles
):
    """Malformed URI, capacity, port, threshold, chunk, boolean or endpoint: exit 2, one line."""
    env = s3_bucket.env(base_env)
    env[variable] = value
    run_and_expect(spawn, env, ["check"], 2, *needles)


def test_a_flag_wins_and_is_named_in_its_error(spawn, base_env, s3_bucket):
    """A bad flag value is reported under the flag's name."""
    run_and_expect(spawn, s3_bucket.env(base_env), ["run", "--s3-keep", "-1"], 2, "--s3-keep -1")


def test_a_missing_storage_uri_names_both_ways_to_set_it(spawn, base_env, moto_server):
    """Without JITCKPT_STORAGE_URI or AWS_S3_BUCKET the error says how to set either."""
    env = {k: v for k, v in base_env.items() if k != "JITCKPT_STORAGE_URI"}
    run_and_expect(spawn, env, ["check"], 2, "JITCKPT_STORAGE_URI=''", "AWS_S3_BUCKET")


def test_a_missing_bucket_is_exit_3(spawn, base_env, s3_bucket):
    """A bucket that does not exist: exit 3, naming the bucket and the endpoint."""
    env = s3_bucket.env(base_env)
    env["JITCKPT_STORAGE_URI"] = "s3://no-such-bucket-here/x"
    run_and_expect(spawn, env, ["check"], 3, "'no-such-bucket-here' does not exist", "127.0.0.1")


def test_rejected_credentials_are_exit_3_without_the_secret(spawn, base_env, tmp_path):
    """An S3 server that checks credentials refuses ours: exit 3, the fix named, no secret."""
    server = MotoServer(auth=True).start()
    try:
        env = {**base_env, "JITCKPT_STORAGE_URI": "s3://some-bucket/x"}
        line = run_and_expect(
            spawn,
            s3_env(server.endpoint, env),
            ["check"],
            3,
            "InvalidAccessKeyId",
            "AWS_ACCESS_KEY_ID",
        )
        assert FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"] not in line
    finally:
        server.stop()


def test_an_unreachable_endpoint_is_exit_3(spawn, base_env, s3_bucket):
    """Nothing listens at the endpoint: exit 3, naming the endpoint and the variables."""
    dead = f"http://127.0.0.1:{free_port()}"
    env = s3_bucket.env(base_env, endpoint=dead)
    run_and_expect(
        spawn, env, ["check"], 3, f"cannot connect to the S3 endpoint {dead}", "AWS_ENDPOINT_URL"
    )


def test_a_taken_metrics_port_is_exit_2(spawn, base_env, s3_bucket):
    """The metrics port is in use: exit 2, naming JITCKPT_METRICS_PORT."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = sidecar_env(s3_bucket.env(base_env), JITCKPT_METRICS_PORT=str(taken.getsockname()[1]))
        run_and_expect(spawn, env, ["run"], 2, "cannot listen on 127.0.0.1", "JITCKPT_METRICS_PORT")


def test_an_unwritable_volume_is_exit_2(spawn, base_env, s3_bucket, tmp_path):
    """JITCKPT_DIR that cannot be written: exit 2, naming the variable."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(blocker / "sub")})
    run_and_expect(spawn, env, ["restore"], 2, "JITCKPT_DIR=", "not writable")


def test_an_unknown_command_is_exit_2(spawn, base_env):
    """A typo in the command: exit 2 and the list of commands."""
    run_and_expect(
        spawn, base_env, ["restor"], 2, "unknown command 'restor'", "run, restore, check"
    )


def test_check_passes_on_a_healthy_bucket_and_aws_s3_bucket_gives_the_uri(
    spawn, base_env, s3_bucket
):
    """`check` succeeds and exits 0; AWS_S3_BUCKET alone (a data connection) is enough."""
    env = {k: v for k, v in s3_bucket.env(base_env).items() if k != "JITCKPT_STORAGE_URI"}
    env["AWS_S3_BUCKET"] = s3_bucket.name
    env["AWS_S3_ENDPOINT"] = env.pop("AWS_ENDPOINT_URL")
    proc = spawn([*SIDECAR, "check"], env=env)
    assert proc.wait(60) == 0, proc.output()
    expected = (
        f"jitckpt-sidecar: ok: s3://{s3_bucket.name}/jitckpt at {env['AWS_S3_ENDPOINT']}: "
        "list, write, read and delete work"
    )
    assert proc.stdout == [expected]


def test_with_json_logs_the_error_is_one_json_line(spawn, base_env, s3_bucket):
    """JITCKPT_LOG_FORMAT=json: the one error line is a JSON object naming the component."""
    env = s3_bucket.env(base_env)
    env.update(JITCKPT_STORAGE_URI="s3://no-such-bucket-here/x", JITCKPT_LOG_FORMAT="json")
    line = run_and_expect(spawn, env, ["check"], 3, "does not exist")
    entry = json.loads(line)
    assert (entry["level"], entry["component"]) == ("error", "jitckpt-sidecar")
    assert "'no-such-bucket-here' does not exist" in entry["msg"]
