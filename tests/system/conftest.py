"""Fixtures for whole-pod tests: pods on one machine against a real S3 server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.pod import Pod
from harness.s3 import Bucket

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
