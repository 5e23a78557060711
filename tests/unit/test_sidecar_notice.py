"""The sidecar's notice watch (notice.py) against a small API server that speaks the watch
protocol (tests/harness/kube_api.py): a taint or a pod condition asks the trainer for a save
once; RBAC refusals and a missing cluster turn it off with one line, no retry storm."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from harness.kube_api import KubeApi
from harness.procs import wait_for
from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar import notice
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.notice import NoticeWatcher, node_notices, pod_notices

BASE = Config(storage_uri="s3://bucket/p")


@pytest.fixture
def api(tmp_path):
    server = KubeApi(tmp_path / "api")
    server.add_node("node-a")
    server.add_pod("training", "trainer-0")
    yield server
    server.stop()


def watcher(tmp_path, api: KubeApi, seen: list[str], **cfg) -> NoticeWatcher:
    (tmp_path / "status").mkdir(exist_ok=True)
    cfg = {
        "kube_credentials": str(api.credentials),
        "node_name": "node-a",
        "pod_name": "trainer-0",
        **cfg,
    }
    config = dataclasses.replace(BASE, **cfg)
    return NoticeWatcher(str(tmp_path / "status"), config, env=api.env(), on_notice=seen.append)


def asked(tmp_path) -> status.SaveAsk | None:
    return status.SAVE_ASK.read(str(tmp_path / "status"))


def test_which_taints_and_conditions_are_notices():
    taints = ("karpenter.sh/disrupted", "node.kubernetes.io/unschedulable")
    node = {"spec": {"taints": [{"key": "karpenter.sh/disrupted"}, {"key": "gpu"}]}}
    assert node_notices(node, taints) == ["karpenter.sh/disrupted"]
    assert node_notices({"spec": {"unschedulable": True}}, taints) == [
        "node.kubernetes.io/unschedulable"
    ]
    assert node_notices({}, taints) == []
    pod = {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True"}]}}
    assert pod_notices(pod, ("DisruptionTarget",)) == ["DisruptionTarget"]
    pod["status"]["conditions"][0]["status"] = "False"
    assert pod_notices(pod, ("DisruptionTarget",)) == []


def test_a_new_taint_asks_for_a_save_once_and_its_upload_is_timed(tmp_path, api, monkeypatch):
    monkeypatch.setattr(notice, "ASK_QUIET", 2.0)
    seen: list[str] = []
    watch = watcher(tmp_path, api, seen)
    assert watch.off is None
    watch.start()
    try:
        time.sleep(0.5)  # watching: nothing to say yet
        assert asked(tmp_path) is None
        api.taint("node-a", "karpenter.sh/disrupted")
        wait_for(lambda: asked(tmp_path) is not None, 10, "the ask")
        first = asked(tmp_path)
        assert first is not None
        assert first.reason == "node node-a: karpenter.sh/disrupted"
        api.taint("node-a", "some-other-taint")  # not a notice; the one in force stays
        api.condition("training", "trainer-0", "DisruptionTarget")  # within ASK_QUIET: asked
        time.sleep(1.0)
        assert asked(tmp_path) == first
        assert seen == ["node"]
        time.sleep(1.5)
        api.taint("node-a", "ToBeDeletedByClusterAutoscaler")  # a new notice, later
        wait_for(lambda: asked(tmp_path) != first, 10, "the second ask")
        second = asked(tmp_path)
        assert second is not None
        assert second.reason == "node node-a: ToBeDeletedByClusterAutoscaler"
        assert seen == ["node", "node"]

        # The trainer answers the second ask with step 12: timed once S3 holds step 12.
        status.SAVE_ANSWER.write(str(tmp_path / "status"), status.SaveAnswer(second.id, 12, 0.0))
        assert watch.durable(None) is None
        assert watch.durable(11) is None
        seconds = watch.durable(12)
        assert seconds is not None
        assert 0 <= seconds < 10
        assert watch.durable(13) is None  # once
    finally:
        watch.stop()


def test_a_pod_condition_asks_for_a_save(tmp_path, api):
    seen: list[str] = []
    watch = watcher(tmp_path, api, seen, node_name="")
    watch.start()
    try:
        api.condition("training", "trainer-0", "DisruptionTarget")
        wait_for(lambda: asked(tmp_path) is not None, 10, "the pod's ask")
        assert asked(tmp_path).reason == "pod trainer-0: DisruptionTarget"  # type: ignore[union-attr]
        assert seen == ["pod"]
    finally:
        watch.stop()


def test_dropped_and_expired_watches_back_off_and_start_again(tmp_path, api, monkeypatch):
    """A watch the server drops at once waits a backoff (no request loop); one from a version
    compacted away (410 Gone) starts again from the current state and still sees notices."""
    monkeypatch.setattr(notice, "WATCH_SECONDS", 1)  # the server's timeout, each second
    monkeypatch.setattr(notice, "SHORT_WATCH", 0.5)
    monkeypatch.setattr(notice, "BACKOFF_MIN", 0.25)
    watch = watcher(tmp_path, api, [], pod_name="")
    api.short_watches = True
    watch.start()
    try:
        wait_for(lambda: api.requests, 10, "the first watch")
        time.sleep(1.6)
        assert len(api.requests) <= 4, api.requests  # backoff 0.25 s, 0.5 s, ...: not a loop
        api.short_watches = False
        wait_for(lambda: "resourceVersion=" in api.requests[-1], 30, "a watch from a version")
        api.add_node("node-b")  # other objects change: node-a's version grows old
        api.compact()
        after = len(api.requests)
        fresh = lambda: any("resourceVersion=" not in r for r in api.requests[after:])  # noqa: E731
        wait_for(fresh, 30, "a watch from the current state after 410")
        api.taint("node-a", "karpenter.sh/disrupted")
        wait_for(lambda: asked(tmp_path) is not None, 10, "the ask after 410")
    finally:
        watch.stop()


def test_rbac_refusals_turn_each_watch_off_with_one_line_and_no_retries(tmp_path, api, caplog):
    api.forbidden = {"nodes", "pods"}
    watch = watcher(tmp_path, api, [])
    with caplog.at_level(logging.WARNING, logger="jitckpt.sidecar"):
        watch.start()
        time.sleep(2.0)
    refused = [r.getMessage() for r in caplog.records if "early notice off" in r.getMessage()]
    assert len(refused) == 2, refused
    assert "HTTP 403" in refused[0]
    assert len(api.requests) == 2  # one watch each, never again
    watch.stop()


def test_outside_a_cluster_or_without_names_the_watch_is_off(tmp_path, api):
    watch = watcher(tmp_path, api, [])
    assert watch._configure({}, notice_config(api)) == (
        "not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)"
    )
    off = watcher(tmp_path, api, [], node_name="", pod_name="")
    assert off.off == "nothing to watch"
    none = watcher(tmp_path, api, [], notice_taints="", notice_conditions="")
    assert none.off is not None
    assert "empty" in none.off
    tokenless = watcher(tmp_path, api, [], kube_credentials=str(tmp_path / "nowhere"))
    assert tokenless.off is not None
    assert "no service account token" in tokenless.off


def notice_config(api: KubeApi) -> Config:
    return dataclasses.replace(BASE, kube_credentials=str(api.credentials), node_name="node-a")
