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


class RefusingPuts(FlakyBucket):
    """A client whose every PutObject fails with `error` (lists, reads and deletes work)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error, failures=0)
        self.puts = 0

    def put_object(self, Body: bytes, **_: object) -> None:  # noqa: N803 - boto3's name
        self.puts += 1
        raise self.error


@pytest.mark.parametrize(
    "code", ["MissingContentLength", "XAmzContentSHA256Mismatch", "NotImplemented"]
)
def test_a_store_that_refuses_flexible_checksums_gets_a_when_required_client(code):
    """A refusal of botocore's checksums makes the probe try again with the fallback client;
    when that passes, the probe returns the refusal's code (the caller switches every client)."""
    refusing = RefusingPuts(client_error(code, 411 if code == "MissingContentLength" else 400))
    accepting = FlakyBucket(client_error("x", 500), failures=0)
    made = []

    def fallback():
        made.append(accepting)
        return accepting

    assert s3.probe(refusing, CFG, fallback=fallback, sleep=pytest.fail) == code
    assert (refusing.puts, len(made), accepting.body) == (1, 1, b"jitckpt sidecar access probe\n")


def test_the_checksum_fallback_is_tried_once_and_only_for_checksum_refusals():
    """A store that refuses the fallback client too fails with that client's error (no advice
    to set what was just tried); other refusals (AccessDenied) never try the fallback; without a
    fallback (the user chose the checksum setting) the error names the setting."""
    from jitckpt_sidecar.errors import StorageAccessError

    refusing = RefusingPuts(client_error("MissingContentLength", 411, "PutObject"))
    still = RefusingPuts(client_error("MissingContentLength", 411, "PutObject"))
    with pytest.raises(StorageAccessError) as info:
        s3.probe(refusing, CFG, fallback=lambda: still, sleep=pytest.fail)
    assert (refusing.puts, still.puts) == (1, 1)
    assert "MissingContentLength" in str(info.value)
    assert "AWS_REQUEST_CHECKSUM_CALCULATION" not in str(info.value)

    denied = RefusingPuts(client_error("AccessDenied", 403, "PutObject"))
    with pytest.raises(StorageAccessError, match="grant the credentials s3:PutObject"):
        s3.probe(denied, CFG, fallback=pytest.fail, sleep=pytest.fail)

    with pytest.raises(StorageAccessError, match="AWS_REQUEST_CHECKSUM_CALCULATION=when_required"):
        s3.probe(RefusingPuts(client_error("MissingContentLength", 411)), CFG, sleep=pytest.fail)


def test_the_fallback_client_sends_checksums_only_where_required(monkeypatch):
    """make_client(checksums=WHEN_REQUIRED) sets both of botocore's checksum settings on that
    client alone; without it, the environment's (boto3's default) settings stand."""
    monkeypatch.delenv("AWS_REQUEST_CHECKSUM_CALCULATION", raising=False)
    monkeypatch.delenv("AWS_RESPONSE_CHECKSUM_VALIDATION", raising=False)
    session = s3.new_session()
    cfg = Config(storage_uri="s3://bucket-1/run", s3_endpoint="http://127.0.0.1:9")
    fallback = s3.make_client(cfg, session, checksums=s3.WHEN_REQUIRED).meta.config
    assert fallback.request_checksum_calculation == "when_required"
    assert fallback.response_checksum_validation == "when_required"
    default = s3.make_client(cfg, session).meta.config
    assert default.request_checksum_calculation == "when_supported"
    assert "payload_signing_enabled" not in default.s3


def test_without_flexible_checksums_payloads_go_unsigned_over_tls_only(monkeypatch):
    """Over HTTPS the when_required client skips botocore's SHA-256 of every upload body (TLS
    and the restore's xxh128 guard the bytes); over plain HTTP the signature is kept."""
    monkeypatch.delenv("AWS_REQUEST_CHECKSUM_CALCULATION", raising=False)
    session = s3.new_session()
    for endpoint, signed in (("https://rgw.local", False), ("http://127.0.0.1:9", None)):
        cfg = Config(storage_uri="s3://bucket-1/run", s3_endpoint=endpoint)
        client = s3.make_client(cfg, session, checksums=s3.WHEN_REQUIRED)
        assert client.meta.config.s3.get("payload_signing_enabled") is signed
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    cfg = Config(storage_uri="s3://bucket-1/run", s3_endpoint="https://rgw.local")
    assert s3.make_client(cfg, session).meta.config.s3["payload_signing_enabled"] is False
