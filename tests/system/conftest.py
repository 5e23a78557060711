"""Fixtures for whole-pod tests: pods on one machine against a real S3 server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.pod import Pod
from harness.s3 import Bucket
from harness.s3proxy import S3Proxy

PodFactory = Callable[..., Pod]


@pytest.fixture
def pods(tmp_path: Path, s3_bucket: Bucket) -> Iterator[PodFactory]:
    """`pods(train_args, **kwargs)` builds a fresh Pod (empty emptyDir) on the test's bucket;
    every pod's processes are killed at teardown and its output is printed on failure."""
    made: list[Pod] = []

    def make(train_args: list[str], **kwargs: Any) -> Pod:
        kwargs.setdefault("s3_env", s3_bucket.env({}))
        kwargs.setdefault("storage_uri", s3_bucket.uri)
        pod = Pod(tmp_path, f"pod-{len(made)}", train_args, **kwargs)
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.close()
    for pod in made:
        print(pod.output())


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[S3Proxy]:
    """A fault-injecting proxy in front of the test's S3 server (pods reach S3 through it when
    given `s3_env=s3_bucket.env({}, endpoint=proxy.url)`)."""
    p = s3_bucket.server.proxy().start()
    yield p
    p.stop()
