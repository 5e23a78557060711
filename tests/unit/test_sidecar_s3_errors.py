"""S3 failures become one line that names the fix and never a secret (in-process exceptions)."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, SSLError

from jitckpt_sidecar import s3
from jitckpt_sidecar.config import Config

CFG = Config(storage_uri="s3://bucket-1/run", s3_endpoint="https://user:hunter2@minio.local:9000")


def client_error(code: str, status: int = 400, op: str = "ListObjectsV2") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


@pytest.mark.parametrize(
    ("exc", "operation", "needle"),
    [
        (client_error("NoSuchBucket", 404), "ListObjectsV2", "bucket 'bucket-1' does not exist"),
        (client_error("InvalidAccessKeyId", 403), "ListObjectsV2", "check AWS_ACCESS_KEY_ID"),
        (client_error("SignatureDoesNotMatch", 403), "PutObject", "check AWS_SECRET_ACCESS_KEY"),
        (
            client_error("AccessDenied", 403),
            "DeleteObject",
            "grant the credentials s3:DeleteObject",
        ),
        (client_error("403", 403), "HeadObject", "s3:GetObject"),
        (client_error("PermanentRedirect", 301), "ListObjectsV2", "set AWS_DEFAULT_REGION"),
        (client_error("ExpiredToken", 400), "GetObject", "refresh the credentials"),
        (NoCredentialsError(), "ListObjectsV2", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        (EndpointConnectionError(endpoint_url="https://x"), "ListObjectsV2", "cannot connect"),
        (
            SSLError(endpoint_url="https://x", error="CERTIFICATE_VERIFY_FAILED"),
            "GetObject",
            "AWS_CA_BUNDLE",
        ),
        (client_error("InternalError", 500), "PutObject", "PutObject on s3://bucket-1/run at"),
        (
            client_error("XAmzContentSHA256Mismatch", 400),
            "PutObject",
            "set AWS_REQUEST_CHECKSUM_CALCULATION=when_required",
        ),
    ],
)
def test_each_failure_kind_names_its_fix_on_one_line_without_secrets(exc, operation, needle):
    """The description says what to fix, is one line, and hides credentials in the endpoint."""
    line = s3.describe(exc, CFG, operation, "s3://bucket-1/run")
    assert needle in line
    assert "\n" not in line
    assert "hunter2" not in line


def test_translate_turns_storage_errors_into_exit_code_3_and_leaves_others_alone():
    """Inside `translate`, a botocore error becomes StorageAccessError; a bug stays a bug."""
    from jitckpt_sidecar.errors import StorageAccessError

    with pytest.raises(StorageAccessError) as info, s3.translate(CFG, "PutObject", "s3://b/k"):
        raise client_error("AccessDenied", 403, "PutObject")
    assert info.value.exit_code == 3
    with pytest.raises(KeyError), s3.translate(CFG, "PutObject", "s3://b/k"):
        raise KeyError("x")


class FlakyBucket:
    """A client whose first `failures` list calls raise `error`; the rest of the probe works."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures, self.lists = error, failures, 0
        self.body = b""

    def list_objects_v2(self, **_: object) -> dict:
        self.lists += 1
        if self.lists <= self.failures:
            raise self.error
        return {}

    def put_object(self, Body: bytes, **_: object) -> None:  # noqa: N803 - boto3's name
        self.body = Body

    def get_object(self, **_: object) -> dict:
        import io

        return {"Body": io.BytesIO(self.body)}

    def delete_object(self, **_: object) -> None:
        pass


@pytest.mark.parametrize(
    "error",
    [client_error("SlowDown", 503), client_error("InternalError", 500), client_error("502", 502)],
)
def test_the_start_up_probe_rides_out_transient_failures(error):
    """A 5xx burst or throttling at start-up is retried with backoff, not a crash loop."""
    client, naps = FlakyBucket(error, failures=3), []
    s3.probe(client, CFG, sleep=naps.append, monotonic=lambda: sum(naps))
    assert client.lists == 4
    assert naps == [0.5, 1.0, 2.0]


def test_the_start_up_probe_gives_up_on_lasting_or_permanent_failures():
    """Permanent errors fail at once; transient ones after PROBE_PATIENCE seconds."""
    from jitckpt_sidecar.errors import StorageAccessError

    denied, naps = FlakyBucket(client_error("AccessDenied", 403), failures=99), []
    with pytest.raises(StorageAccessError):
        s3.probe(denied, CFG, sleep=naps.append, monotonic=lambda: sum(naps))
    assert (denied.lists, naps) == (1, [])
    down = FlakyBucket(client_error("ServiceUnavailable", 503), failures=99)
    with pytest.raises(StorageAccessError):
        s3.probe(down, CFG, sleep=naps.append, monotonic=lambda: sum(naps))
    assert sum(naps) <= s3.PROBE_PATIENCE
    refused = FlakyBucket(EndpointConnectionError(endpoint_url="https://x"), failures=99)
    with pytest.raises(StorageAccessError):
        s3.probe(refused, CFG, sleep=naps.append, monotonic=lambda: 0.0)
    assert refused.lists == 1
