"""Preconditions on an upload's writes: added to the PutObject and CompleteMultipartUpload
parameters of the keys an upload registered, while its scope lasts, whatever builds the call."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from jitckpt_sidecar import preconditions


def client():
    return boto3.client(
        "s3",
        region_name="us-east-1",
        aws_access_key_id="AKIAEXAMPLE",
        aws_secret_access_key="secret",
    )


def built(s3, operation: str, **params: str) -> dict[str, str]:
    """The parameters of `operation` after the client's parameter-building handlers ran."""
    s3.meta.events.emit(
        f"before-parameter-build.s3.{operation}",
        params=params,
        model=s3.meta.service_model.operation_model(operation),
        context={},
    )
    return params


def test_a_registered_key_carries_its_precondition_only_within_the_scope():
    """If-None-Match on the keys registered, nothing on another key or after the scope."""
    s3 = client()
    pre = preconditions.of(s3)
    assert preconditions.of(s3) is pre  # one per client, shared by every uploader over it
    with pre.scope("b") as scope:
        scope.require("k1", preconditions.FREE)
        scope.require("k2", preconditions.FREE)
        assert built(s3, "PutObject", Bucket="b", Key="k1") == {
            "Bucket": "b",
            "Key": "k1",
            "IfNoneMatch": "*",
        }
        assert built(s3, "PutObject", Bucket="b", Key="k2")["IfNoneMatch"] == "*"
        assert built(s3, "PutObject", Bucket="b", Key="k3") == {"Bucket": "b", "Key": "k3"}
        assert "IfNoneMatch" not in built(s3, "PutObject", Bucket="other", Key="k1")
        completed = built(s3, "CompleteMultipartUpload", Bucket="b", Key="k2", UploadId="u")
        assert completed["IfNoneMatch"] == "*"
    assert built(s3, "PutObject", Bucket="b", Key="k1") == {"Bucket": "b", "Key": "k1"}


@pytest.mark.parametrize(
    ("code", "status", "refused"),
    [
        ("PreconditionFailed", 412, True),
        ("ConditionalRequestConflict", 409, True),
        ("SlowDown", 503, False),
    ],
)
def test_refused_names_only_a_failed_precondition(code, status, refused):
    s3 = client()
    with Stubber(s3) as stub:
        stub.add_client_error("put_object", code, http_status_code=status)
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the ClientError, whatever its class
            s3.put_object(Bucket="b", Key="k", Body=b"x")
    assert preconditions.refused(caught.value) is refused
