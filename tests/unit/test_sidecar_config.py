"""Sidecar config: flags over env over platform fallbacks, quantities, one-line errors."""

from __future__ import annotations

import pytest

from jitckpt_entrypoint.settings import SettingError, parse_quantity
from jitckpt_sidecar.config import Config

URI = {"JITCKPT_STORAGE_URI": "s3://bucket-1/run"}


def test_defaults_match_the_documented_table():
    """With only a storage URI every setting has its documented default."""
    cfg = Config.from_env(URI)
    assert (cfg.dir, cfg.metrics_port) == ("/mnt/jitckpt", 9402)
    assert cfg.metrics_host == "0.0.0.0"  # noqa: S104 - the documented default: the pod IP
    assert (cfg.s3_keep, cfg.storage_capacity, cfg.disk_pressure_threshold) == (0, None, 0.85)
    assert (cfg.grace_seconds, cfg.rescan_seconds, cfg.exit_with_trainer) == (30, 30.0, False)
    assert (cfg.s3_verify_tls, cfg.s3_addressing, cfg.s3_endpoint) == (True, "auto", "")
    assert (cfg.upload_concurrency, cfg.download_concurrency) == (8, 8)
    assert (cfg.multipart_chunk, cfg.download_chunk) == (16 * 1024**2, 256 * 1024**2)
    assert cfg.uri.bucket == "bucket-1"
    assert cfg.uri.prefix == "run"


def test_a_flag_wins_over_its_variable():
    """--s3-keep overrides JITCKPT_S3_KEEP."""
    assert Config.from_env({**URI, "JITCKPT_S3_KEEP": "3"}, {"s3_keep": "5"}).s3_keep == 5


@pytest.mark.parametrize(
    ("env", "uri"),
    [
        ({"AWS_S3_BUCKET": "data-conn"}, "s3://data-conn/jitckpt"),
        ({"AWS_S3_BUCKET": "data-conn", "JITCKPT_STORAGE_URI": ""}, "s3://data-conn/jitckpt"),
        ({"AWS_S3_BUCKET": "data-conn", "JITCKPT_STORAGE_URI": "s3://own/p"}, "s3://own/p"),
    ],
)
def test_an_empty_storage_uri_falls_back_to_the_data_connection_bucket(env, uri):
    """AWS_S3_BUCKET (OpenShift AI data connection) gives s3://$AWS_S3_BUCKET/jitckpt."""
    assert Config.from_env(env).storage_uri == uri


@pytest.mark.parametrize(
    ("env", "endpoint"),
    [
        ({"AWS_S3_ENDPOINT": "https://minio:9000"}, "https://minio:9000"),
        ({"AWS_S3_ENDPOINT": "https://a", "AWS_ENDPOINT_URL": "http://b"}, "http://b"),
        ({"AWS_ENDPOINT_URL": "http://b", "AWS_ENDPOINT_URL_S3": "http://c"}, "http://c"),
        ({"AWS_ENDPOINT_URL": "http://b", "JITCKPT_S3_ENDPOINT": "http://d"}, "http://d"),
        ({}, ""),
    ],
)
def test_the_endpoint_follows_boto3_then_openshift_conventions(env, endpoint):
    """JITCKPT_S3_ENDPOINT, then AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_S3_ENDPOINT."""
    assert Config.from_env({**URI, **env}).s3_endpoint == endpoint


def test_aws_max_attempts_sets_the_tries_per_request():
    """boto3's AWS_MAX_ATTEMPTS is honoured unless JITCKPT_S3_MAX_ATTEMPTS is set."""
    assert Config.from_env({**URI, "AWS_MAX_ATTEMPTS": "3"}).s3_max_attempts == 3
    both = {**URI, "AWS_MAX_ATTEMPTS": "3", "JITCKPT_S3_MAX_ATTEMPTS": "5"}
    assert Config.from_env(both).s3_max_attempts == 5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("50Gi", 50 * 1024**3),
        ("500M", 500 * 10**6),
        ("1.5G", 1_500_000_000),
        ("64Mi", 64 * 1024**2),
        ("12e6", 12_000_000),
        ("1Ki", 1024),
        ("100", 100),
        ("1500m", 2),
        ("+2k", 2000),
    ],
)
def test_kubernetes_quantities_become_whole_bytes(text, expected):
    """Binary and decimal suffixes, exponents and fractions (rounded up) are understood."""
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["50GB", "-1Gi", "Gi", "", "1.2.3", "5 Gi", "1e"])
def test_malformed_quantities_are_rejected(text):
    """Anything that is not a Kubernetes quantity raises ValueError."""
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity(text)


PEER = {
    "JITCKPT_PEERS": "http://job-{node}.job:9402",
    "JITCKPT_PEER_TOKEN": "peer-secret",
    "JITCKPT_MEMORY_DIR": "/mnt/m",
    "JITCKPT_NODE_RANK": "1",
    "JITCKPT_NNODES": "2",
}


def test_the_peer_replica_takes_a_template_or_a_url_per_node():
    assert Config.from_env({**URI, **PEER}).peers == PEER["JITCKPT_PEERS"]
    listed = {**PEER, "JITCKPT_PEERS": "http://10.0.0.1:9402,http://10.0.0.2:9402"}
    assert Config.from_env({**URI, **listed}).peer_token == PEER["JITCKPT_PEER_TOKEN"]


@pytest.mark.parametrize(
    ("env", "flags", "message"),
    [
        ({}, {}, "JITCKPT_STORAGE_URI='' is invalid; use s3://bucket/prefix (or set AWS_S3_BUCKET"),
        (
            {"JITCKPT_STORAGE_URI": "gs://b/x"},
            {},
            "JITCKPT_STORAGE_URI='gs://b/x' is not an S3 URI",
        ),
        ({"AWS_S3_BUCKET": "Bad_B"}, {}, "JITCKPT_STORAGE_URI (from AWS_S3_BUCKET)='s3://Bad_B/"),
        ({**URI, "JITCKPT_STORAGE_CAPACITY": "lots"}, {}, "JITCKPT_STORAGE_CAPACITY='lots' is not"),
        ({**URI, "JITCKPT_STORAGE_CAPACITY": "0"}, {}, "JITCKPT_STORAGE_CAPACITY=0 is invalid"),
        ({**URI, "JITCKPT_METRICS_PORT": "70000"}, {}, "JITCKPT_METRICS_PORT=70000 is invalid"),
        ({**URI}, {"metrics_port": "x"}, "--metrics-port 'x' is not an integer"),
        ({**URI, "JITCKPT_DISK_PRESSURE_THRESHOLD": "0"}, {}, "use a ratio in (0, 1]"),
        ({**URI, "JITCKPT_GRACE_SECONDS": "0"}, {}, "JITCKPT_GRACE_SECONDS=0 is invalid"),
        ({**URI, "JITCKPT_UPLOAD_CONCURRENCY": "0"}, {}, "use a number from 1 to 64"),
        ({**URI, "JITCKPT_MULTIPART_CHUNK": "6Gi"}, {}, "use a quantity from 5Mi to 5Gi"),
        ({**URI, "JITCKPT_DOWNLOAD_CHUNK": "1Mi"}, {}, "JITCKPT_DOWNLOAD_CHUNK=1048576 is"),
        ({**URI, "JITCKPT_S3_ADDRESSING": "dns"}, {}, "use one of auto, path, virtual"),
        (
            {**URI, "JITCKPT_S3_VERIFY_TLS": "nah"},
            {},
            "JITCKPT_S3_VERIFY_TLS='nah' is not a boolean",
        ),
        ({**URI, "AWS_S3_ENDPOINT": "minio:9000"}, {}, "AWS_S3_ENDPOINT='minio:9000' is invalid"),
        ({**URI, "JITCKPT_LOG_FORMAT": "xml"}, {}, "JITCKPT_LOG_FORMAT='xml' is invalid"),
        ({**URI, "JITCKPT_RESCAN_SECONDS": "0"}, {}, "use seconds from 0.1 to 3600"),
        ({**URI, "JITCKPT_PEERS": "ftp://a:1"}, {}, "JITCKPT_PEERS='ftp://a:1' is invalid"),
        ({**URI, **PEER, "JITCKPT_PEER_TOKEN": ""}, {}, "needs JITCKPT_PEER_TOKEN"),
        ({**URI, **PEER, "JITCKPT_MEMORY_DIR": ""}, {}, "needs JITCKPT_MEMORY_DIR"),
        ({**URI, **PEER, "JITCKPT_NNODES": "1"}, {}, "needs the node rank and a node count of 2"),
        ({**URI, **PEER, "JITCKPT_PEERS": "http://a:1"}, {}, "names 1 URLs for 2 nodes"),
    ],
)
def test_bad_values_are_one_line_errors_naming_their_source(env, flags, message):
    """Each bad value names the variable or flag it came from and the accepted values."""
    with pytest.raises(SettingError) as info:
        Config.from_env(env, flags)
    assert message in str(info.value)
    assert "peer-secret" not in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2


def test_the_drain_ends_a_margin_before_the_grace_period():
    """The drain budget leaves 10 % of the grace period, 2 to 5 s, for a clean exit."""
    assert Config.from_env({**URI, "JITCKPT_GRACE_SECONDS": "30"}).drain_seconds == 27
    assert Config.from_env({**URI, "JITCKPT_GRACE_SECONDS": "4"}).drain_seconds == 2
    assert Config.from_env({**URI, "JITCKPT_GRACE_SECONDS": "600"}).drain_seconds == 595
