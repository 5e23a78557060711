"""Monitoring that tells the truth: a real Prometheus (Debian's 2.42) scrapes real sidecars
every second with the alert rules of k8s/monitoring/prometheusrule.yaml at 60x speed (a minute
of a `for:` or of a range window is a second; JitckptUploadLag's 15 min is 15 s).

Four scenarios run at once, each under its own pod label: a normal run (train, SIGTERM, a
fresh pod restores from S3 and trains on), an S3 outage while training keeps saving (then S3
comes back), disk pressure (an emptyDir about one checkpoint big) and a restore that S3 refuses
(its sidecar restarted once in the same pod, as the kubelet would). Each alert fires in its
scenario and never in the others; every dashboard query returns data for the normal run (whose
first pod gets the cluster's notice before its SIGTERM: a Kubernetes API of tests/harness). The
alert and panel tables are printed (`-s`) for the record.

JitckptWorkAtRisk has a small test of its own (a sidecar and the trainer's status files, no
torchrun): its threshold needs an outage longer than the outage scenario's; the normal run
must not fire it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from harness.checkpoints import commit, hf_files, scrape, upload_directly, write_trainer
from harness.kube_api import KubeApi
from harness.pod import Pod
from harness.procs import wait_for
from harness.prometheus import DASHBOARD, Prometheus, needs_prometheus, rule_file, rule_groups
from harness.s3 import Bucket
from harness.s3proxy import S3Proxy
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name, step_of
from jitckpt_sidecar import staging

pytestmark = [pytest.mark.integration, needs_prometheus]

NS = "jitckpt-test"
SPEEDUP = 60
FAST = {"JitckptUploadLag": ("> 900", "> 15")}  # 15 min at 60x
ARGS = ["--max-steps", "100000", "--save-steps", "50"]
"""A save every few seconds here: uploads keep up with it even on a loaded 2-core machine (at a
save every 2 s they did not, and JitckptUploadLag rightly fired in the normal run)."""
NODE = "node-a"
"""The normal run's first pod's node, which Karpenter taints (the sidecar's notice watch)."""
EXPECTED = {
    "normal": set(),
    "outage": {"JitckptUploadLag", "JitckptUploadFailures"},
    "disk": {"JitckptDiskPressure"},
    "restore": {"JitckptRestoreFailed", "JitckptSidecarNotReady"},
}
OWN_TEST = {"JitckptWorkAtRisk", "JitckptNoPeerReplica"}
"""Alerts with a test of their own (below); the scenarios here check only that the normal run
does not fire them."""
BOOT_PENDING = {"JitckptSidecarNotReady"}
"""Alerts whose condition is briefly true at every start (not ready until the restore is done):
their `for:` keeps them from firing."""
Metric = tuple[str, tuple[tuple[str, str], ...]]
RESTORE_FAILED: Metric = ("jitckpt_restores_total", (("result", "failure"),))
PEER_PANEL = "Peer replica: age and bytes of the snapshot each sidecar keeps of its peer"
"""A panel of a feature the scenarios do not use (JITCKPT_PEERS): its own test shows it."""


@dataclasses.dataclass
class Run:
    """What one scenario did, in time.time() seconds."""

    name: str
    pods: list[str]
    started: float = 0.0
    fault: Optional[float] = None
    ended: float = 0.0
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


def value(port: int, metric: Metric) -> Optional[float]:
    try:
        return scrape(port).get(metric)
    except OSError:
        return None


def manifest_put(method: str, key: str, _query: dict[str, str]) -> bool:
    return method == "PUT" and m.is_manifest_name(key.rsplit("/", 1)[-1])


def du(path: Path) -> int:
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


# --- the scenarios ------------------------------------------------------------------------


def normal(run: Run, first: Pod, second: Pod, proxy: S3Proxy, api: KubeApi) -> None:
    """Train and upload; the cluster's notice (Karpenter taints the first pod's node: a save
    asked for and uploaded); SIGTERM (JIT checkpoint, its upload 2 s long as a real one would
    be, so the terminating sidecar is scraped with it); a fresh pod restores it and trains on."""
    uploaded: Metric = ("jitckpt_last_uploaded_step", ())
    run.started = time.time()
    first.start()
    wait_for(lambda: (value(first.metrics_port, uploaded) or 0) >= 150, 240, "three uploads")
    api.taint(NODE, "karpenter.sh/disrupted")
    notice: Metric = ("jitckpt_notice_to_durable_seconds", ())
    wait_for(lambda: value(first.metrics_port, notice) is not None, 60, "the notice's save in S3")
    time.sleep(2.0)  # scraped once a second
    slow = proxy.delay(manifest_put, 2.0, times=None)
    out = first.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), first.output()
    jit = json.loads((first.jdir / "status" / "jit.json").read_text())["step"]
    slow.times = slow.hits
    second.start()
    ready = json.loads((second.jdir / "status" / status.SIDECAR_READY.name).read_text())
    assert (ready["restore"], ready["step"]) == ("s3", jit)
    wait_for(lambda: (value(second.metrics_port, uploaded) or 0) > jit + 50, 240, "two uploads")
    proxy.delay(manifest_put, 2.0, times=None)
    out = second.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), second.output()
    run.ended = time.time()
    run.notes["jit"] = jit


def outage(run: Run, pod: Pod, proxy: S3Proxy, prom: Prometheus) -> None:
    """Every S3 request answers 500 while training keeps committing, until JitckptUploadLag
    fires; then S3 comes back and the newest checkpoint is committed in S3 first."""
    run.started = time.time()
    pod.start()
    wait_for(lambda: value(pod.metrics_port, ("jitckpt_last_uploaded_step", ())), 240, "an upload")
    run.fault = time.time()
    dead = proxy.fail(lambda _m, _k, _q: True, 500, times=None)
    prom.wait_firing("JitckptUploadLag", 240, pod=run.pods[0])
    during = scrape(pod.metrics_port)
    run.notes["oldest pending s"] = during[("jitckpt_upload_oldest_pending_age_seconds", ())]
    run.notes["newest pending s"] = during[("jitckpt_upload_lag_seconds", ())]
    run.notes["queued"] = during[("jitckpt_upload_queue_length", ())]
    newest = max(staging.scan(Layout(str(pod.jdir))))
    mark = len(proxy.log())
    dead.times = dead.hits  # S3 is back
    run.notes["back"] = time.time()
    wait_for(
        lambda: not prom.firing("JitckptUploadLag", pod=run.pods[0]), 240, "the lag alert to end"
    )
    run.notes["resolved"] = time.time()
    commits = [
        step_of(r.key.split("/")[-2])
        for r in proxy.log()[mark:]
        if r.writes_object and manifest_put(r.method, r.key, r.query)
    ]
    run.notes["first commits after the outage"] = commits[:4]
    run.notes["newest pending at recovery"] = newest
    assert commits, "nothing was committed in S3 after the outage"
    assert commits[0] >= newest, f"after the outage {commits[:5]} went first, newest {newest}"
    out = pod.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), pod.output()
    run.ended = time.time()


def disk(run: Run, pod: Pod, model_of: Pod, prom: Prometheus) -> None:
    """A volume 5 % larger than one checkpoint (measured on the normal run's first one): the
    newest checkpoint alone is above the threshold, so pruning cannot relieve it."""
    root = model_of.jdir / "checkpoints"
    step = wait_for(lambda: validity.newest_committed(str(root)), 240, "a checkpoint to measure")
    capacity = int(du(root / checkpoint_name(step)) * 1.05)
    pod.env["JITCKPT_STORAGE_CAPACITY"] = str(capacity)
    run.notes["capacity"] = capacity
    run.started = time.time()
    pod.start()
    volume = str(pod.jdir / "checkpoints")
    wait_for(lambda: validity.newest_committed(volume), 240, "the first checkpoint")
    run.fault = time.time()  # above the threshold from the first checkpoint on
    prom.wait_firing("JitckptDiskPressure", 240, pod=run.pods[0])
    assert pod.sidecar is not None
    assert any("no local checkpoint can be deleted" in line for line in pod.sidecar.stderr)
    run.notes["pressure"] = scrape(pod.metrics_port)[("jitckpt_storage_pressure_ratio", ())]
    out = pod.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), pod.output()
    run.ended = time.time()


def restore(run: Run, pod: Pod, prom: Prometheus) -> None:
    """S3 refuses the reads (AccessDenied): the sidecar stays up, not ready, and keeps trying;
    SIGTERM (the startupProbe gave up) ends it with exit 1 and its termination message; the
    kubelet's restart in the same pod fails again, and the alert stays on throughout."""
    run.started = run.fault = time.time()
    pod.start_sidecar()
    prom.wait_firing("JitckptRestoreFailed", 120, pod=run.pods[0])
    prom.wait_firing("JitckptSidecarNotReady", 240, pod=run.pods[0])
    assert pod.sidecar is not None
    pod.sidecar.send(signal.SIGTERM)
    assert pod.sidecar.wait(20) == 1, pod.output()
    message = (pod.dir / "sidecar-termination-log").read_text()
    assert message.startswith("jitckpt-sidecar: restore failed: access denied: GetObject"), message
    run.notes["termination message"] = message.strip()
    run.notes["restarted"] = time.time()
    pod.start_sidecar()
    wait_for(lambda: value(pod.metrics_port, RESTORE_FAILED) == 1, 120, "the restart to fail")
    seen = time.time()
    wait_for(lambda: prom.up(pod.metrics_port) and time.time() > seen + 3, 60, "scrapes")
    pod.sidecar.send(signal.SIGTERM)
    assert pod.sidecar.wait(20) == 1, pod.output()
    run.ended = time.time()


# --- the test -----------------------------------------------------------------------------


def test_each_alert_fires_in_its_scenario_only_and_the_dashboard_shows_the_normal_run(
    pods: Callable[..., Pod], s3_bucket: Bucket, proxy: S3Proxy, tmp_path: Path
) -> None:
    began = time.monotonic()
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"]}
    assert set().union(*EXPECTED.values()) == alerts - OWN_TEST
    rules = rule_file(tmp_path / "rules.yaml", speedup=SPEEDUP, replace=FAST)
    prom = Prometheus(tmp_path / "prometheus", rules).start()
    api = KubeApi(tmp_path / "kube")
    api.add_node(NODE)
    flaky = s3_bucket.server.proxy().start()
    refusing = s3_bucket.server.proxy().start()
    try:
        uri = f"s3://{s3_bucket.name}"
        via = {p: s3_bucket.env({}, endpoint=p.url) for p in (proxy, flaky, refusing)}
        kube = {
            **api.env(),
            "JITCKPT_KUBE_CREDENTIALS": str(api.credentials),
            "JITCKPT_NODE_NAME": NODE,
        }
        made = {
            "normal-0": pods(ARGS, s3_env=via[proxy], storage_uri=f"{uri}/normal", env=kube),
            "normal-1": pods(ARGS, s3_env=via[proxy], storage_uri=f"{uri}/normal"),
            "outage": pods(
                ARGS,
                s3_env=via[flaky],
                storage_uri=f"{uri}/outage",
                env={"JITCKPT_S3_MAX_ATTEMPTS": "2"},
            ),
            "disk": pods(ARGS, storage_uri=f"{uri}/disk"),
            "restore": pods(ARGS, s3_env=via[refusing], storage_uri=f"{uri}/restore"),
        }
        prom.targets({p.metrics_port: {"namespace": NS, "pod": name} for name, p in made.items()})
        wait_for(lambda: len(prom.query(f'up{{namespace="{NS}"}}')) == len(made), 30, "targets")
        seed = tmp_path / "seed"  # a committed checkpoint in S3 that the restore cannot read
        commit([seed], 40, [hf_files(40)])
        upload_directly(s3_bucket, seed, 40, uri=f"{uri}/restore")
        refusing.fail(
            lambda method, key, _q: method == "GET" and "/checkpoint-" in key,
            403,
            times=None,
            code="AccessDenied",
        )

        runs = {
            "normal": Run("normal", ["normal-0", "normal-1"]),
            "outage": Run("outage", ["outage"]),
            "disk": Run("disk", ["disk"]),
            "restore": Run("restore", ["restore"]),
        }
        with ThreadPoolExecutor(len(runs)) as pool:
            futures = [
                pool.submit(normal, runs["normal"], made["normal-0"], made["normal-1"], proxy, api),
                pool.submit(outage, runs["outage"], made["outage"], flaky, prom),
                pool.submit(disk, runs["disk"], made["disk"], made["normal-0"], prom),
                pool.submit(restore, runs["restore"], made["restore"], prom),
            ]
            for future in futures:
                future.result()
        end = time.time()
        start = min(r.started for r in runs.values()) - 5

        # -- alerts: the first firing (and pending) moment of each alert for each scenario
        scenario_of = {pod: r.name for r in runs.values() for pod in r.pods}
        first: dict[tuple[str, str, str], float] = {}
        for series in prom.query_range(f'ALERTS{{namespace="{NS}"}}', start, end):
            labels = series["metric"]
            key = (labels["alertname"], scenario_of[labels["pod"]], labels["alertstate"])
            at = float(series["values"][0][0])
            first[key] = min(first.get(key, at), at)
        table = ["alert | scenario | fires? | seconds from the fault"]
        for alert in sorted(alerts):
            for name, run in runs.items():
                fired = first.get((alert, name, "firing"))
                since = run.fault if run.fault is not None else run.started
                when = "" if fired is None else f"{fired - since:.1f}"
                table.append(f"{alert} | {name} | {'yes' if fired else 'no'} | {when}")
        print("\n".join(table))
        for name, run in runs.items():
            print(f"{name}: {run.ended - run.started:.0f} s, {run.notes}")
        for alert in alerts - OWN_TEST:
            for name in runs:
                fired = (alert, name, "firing") in first
                assert fired == (alert in EXPECTED[name]), f"{alert} in {name}: fired={fired}"
                if alert not in EXPECTED[name] and alert not in BOOT_PENDING:
                    assert (alert, name, "pending") not in first, f"{alert} pending in {name}"
        for alert in OWN_TEST:
            assert (alert, "normal", "firing") not in first, f"{alert} in normal"

        # -- the restore alert stayed on across the sidecar's restart
        on = prom.query_range(
            'ALERTS{alertname="JitckptRestoreFailed", alertstate="firing", pod="restore"}',
            first[("JitckptRestoreFailed", "restore", "firing")],
            runs["restore"].ended,
        )
        assert len(on) == 1
        stamps = [float(t) for t, _ in on[0]["values"]]
        assert max(b - a for a, b in zip(stamps, stamps[1:])) <= 1.5, "a gap in the alert"

        # -- every dashboard query returns data for the normal run
        normal_run = runs["normal"]
        panels = ["panel | query | series | max"]
        empty = []
        for title, expr in (q for q in dashboard_queries() if q[0] != PEER_PANEL):
            series = prom.query_range(expr, normal_run.started, normal_run.ended + 1)
            values = [float(v) for s in series for _, v in s["values"]]
            finite = [v for v in values if math.isfinite(v)]
            panels.append(f"{title} | {expr[:70]} | {len(series)} | {max(finite, default='-')}")
            if not finite:
                empty.append(f"{title}: {expr}")
        print("\n".join(panels))
        assert not empty, empty
        namespaces = prom.api("label/namespace/values", **{"match[]": "jitckpt_sidecar_ready"})
        assert NS in namespaces
        print(f"monitoring system test: {time.monotonic() - began:.0f} s")
    finally:
        flaky.stop()
        refusing.stop()
        prom.stop()
        api.stop()
        print(prom.output())


def dashboard_queries(pods: str = "normal-.*") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, with Grafana's variables filled in for `pods`
    (the normal run's; 15 s for $__rate_interval: four 1 s scrapes and then some)."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {"$__rate_interval": "15s", "$namespace": NS, "$pod": pods}
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, text in variables.items():
                expr = expr.replace(var, text)
            out.append((panel["title"], expr))
    return out


RISK_FAST = {"JitckptWorkAtRisk": ("> 1800", "> 8")}
"""30 min of training not in S3 -> 8 s (its `for: 10m` is 10 s at 60x)."""
RISK: Metric = ("jitckpt_work_at_risk_seconds", (("durability", "s3"),))
RISK_VOLUME: Metric = ("jitckpt_work_at_risk_seconds", (("durability", "volume"),))
RISK_STEPS: Metric = ("jitckpt_work_at_risk_steps", (("durability", "s3"),))


def test_work_at_risk_fires_while_s3_fails_and_training_goes_on(
    pods: Callable[..., Pod], s3_bucket: Bucket, tmp_path: Path
) -> None:
    """A trainer (its status files, written here as the entrypoint and the hook write them:
    progress.json 4 times a second, a committed checkpoint every 12 steps) keeps training while
    every S3 request fails: the volume's work at risk stays at a few seconds, the S3 one grows
    from the last uploaded checkpoint's save, and JitckptWorkAtRisk fires; not before."""
    began = time.monotonic()
    rules = rule_file(tmp_path / "rules.yaml", speedup=SPEEDUP, replace=RISK_FAST)
    prom = Prometheus(tmp_path / "prometheus", rules).start()
    flaky = s3_bucket.server.proxy().start()
    stop, failed = threading.Event(), []
    try:
        pod = pods(
            [],
            s3_env=s3_bucket.env({}, endpoint=flaky.url),
            storage_uri=f"s3://{s3_bucket.name}/risk",
            command=["true"],
            env={"JITCKPT_S3_MAX_ATTEMPTS": "2"},
        )
        pod.start_sidecar()
        pod.wait_ready()
        prom.targets({pod.metrics_port: {"namespace": NS, "pod": "risk"}})
        folder = str(pod.jdir / "status")
        write_trainer(pod.jdir)  # run "run", as commit()'s save events
        status.FIRST_STEP.write(folder, status.FirstStep("run", 0, time.time()))

        def train() -> None:
            step = 0
            try:
                while not stop.wait(0.25):
                    step += 1
                    status.PROGRESS.write(folder, status.Progress("run", step, time.time()))
                    if step % 12 == 0:
                        commit([pod.jdir], step, [hf_files(step, big=64 * 1024)])
            except Exception as exc:  # noqa: BLE001 - raised again in the test's thread
                failed.append(exc)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        uploaded: Metric = ("jitckpt_last_uploaded_step", ())
        wait_for(lambda: (value(pod.metrics_port, uploaded) or 0) >= 24, 60, "two uploads")
        fault = time.time()
        flaky.fail(lambda _m, _k, _q: True, 500, times=None)
        fired = prom.wait_firing("JitckptWorkAtRisk", 60, pod="risk")
        during = scrape(pod.metrics_port)
        stop.set()
        trainer.join(5)
        assert not failed, failed
        assert during[RISK] > 8, during
        assert during[RISK_VOLUME] < during[RISK] / 2, during  # a checkpoint every 3 s
        assert (
            during[RISK_STEPS] > during[("jitckpt_work_at_risk_steps", (("durability", "volume"),))]
        )
        alerts = prom.query_range('ALERTS{alertname="JitckptWorkAtRisk"}', fault - 60, time.time())
        starts = [float(s["values"][0][0]) for s in alerts]
        assert min(starts) > fault, "pending or firing before the outage"
        print(
            f"work at risk: fired {fired - fault:.1f} s after the outage began, at "
            f"{during[RISK]:.1f} s / {during[RISK_STEPS]:.0f} steps in S3, "
            f"{during[RISK_VOLUME]:.1f} s on the volume; test {time.monotonic() - began:.0f} s"
        )
    finally:
        stop.set()
        flaky.stop()
        prom.stop()
        print(prom.output())


PEER_FAST = {"JitckptNoPeerReplica": ("> 600", "> 10")}
"""A copy older than 10 min -> 10 s (its `for: 10m` is 10 s at 60x)."""
PEER_TOKEN = "monitoring-peer-token"  # noqa: S105 - a test's


def test_no_peer_replica_fires_until_the_peer_serves_snapshots_and_the_panel_shows_them(
    pods: Callable[..., Pod], s3_bucket: Bucket, tmp_path: Path
) -> None:
    """Node 0's sidecar with the peer replica (JITCKPT_PEERS), node 1's with no snapshot yet:
    node 0 keeps no copy (age +Inf) and JitckptNoPeerReplica fires. Then node 1's trainer takes
    a snapshot in RAM every 2 s (written here as the hook commits them): node 0 keeps each one,
    the alert ends, and the dashboard's peer panel has data."""
    rules = rule_file(tmp_path / "rules.yaml", speedup=SPEEDUP, replace=PEER_FAST)
    prom = Prometheus(tmp_path / "prometheus", rules).start()
    stop = threading.Event()
    try:
        memory = [tmp_path / f"memory-{n}" for n in (0, 1)]
        members = []
        for node in (0, 1):
            memory[node].mkdir()
            members.append(
                pods(
                    [],
                    storage_uri=f"s3://{s3_bucket.name}/peer",
                    command=["true"],
                    env={
                        "JITCKPT_MEMORY_DIR": str(memory[node]),
                        "JITCKPT_NODE_RANK": str(node),
                        "JITCKPT_NNODES": "2",
                        "JITCKPT_PEER_TOKEN": PEER_TOKEN,
                    },
                )
            )
        peers = ",".join(f"http://127.0.0.1:{p.metrics_port}" for p in members)
        for pod in members:
            pod.env["JITCKPT_PEERS"] = peers
        node0 = members[0]
        for pod in members:
            pod.start_sidecar()
        for pod in members:
            pod.wait_ready()
        write_trainer(node0.jdir)  # a trainer runs (its status file, as the entrypoint's)
        prom.targets(
            {p.metrics_port: {"namespace": NS, "pod": f"peer-{n}"} for n, p in enumerate(members)}
        )
        absent = time.time()
        fired = prom.wait_firing("JitckptNoPeerReplica", 90, pod="peer-0")

        def snapshots() -> None:
            step = 0
            while not stop.wait(2.0):
                step += 3
                peer_snapshot(memory[1], step)

        writer = threading.Thread(target=snapshots, daemon=True)
        writer.start()
        copies: Metric = ("jitckpt_peer_replica_bytes", ())
        wait_for(lambda: (value(node0.metrics_port, copies) or 0) > 0, 60, "node 0's copy")
        kept = time.time()
        wait_for(
            lambda: not prom.firing("JitckptNoPeerReplica", pod="peer-0"), 60, "the alert to end"
        )
        panel = [expr for title, expr in dashboard_queries("peer-0") if title == PEER_PANEL]
        assert len(panel) == 2, panel

        def shown() -> dict[str, list[float]]:
            got = {expr: prom.query_range(expr, kept, time.time()) for expr in panel}
            finite = {
                expr: [float(v) for s in series for _, v in s["values"] if v != "+Inf"]
                for expr, series in got.items()
            }
            return finite if all(any(v > 0 for v in vs) for vs in finite.values()) else {}

        finite = wait_for(shown, 30, "the peer panel's data")
        assert min(finite[next(e for e in finite if "age" in e)]) < 10, finite
        print(f"no peer replica: fired {fired - absent:.1f} s after node 0 started with no copy")
    finally:
        stop.set()
        prom.stop()
        print(prom.output())


def peer_snapshot(memory: Path, step: int) -> None:
    """Node 1's snapshot of `step` of a 2-node save in RAM, committed as the hook leaves it
    (its files, every node's manifest); older ones go."""
    root = memory / "checkpoints"
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    files = {"model.safetensors": b"m" * 65536, "rng_state_1.pth": b"r" * 100}
    for name, data in files.items():
        (path / name).write_bytes(data)
    save_id = m.new_save_id()
    for node in (0, 1):
        entries = tuple(m.FileEntry(n, len(d)) for n, d in files.items() if node == 1) or (
            m.FileEntry("rng_state_0.pth", 100),
        )
        manifest = m.new_manifest(
            step, "periodic", node=node, nodes=2, world_size=2, files=entries, save_id=save_id
        )
        m.write_manifest(str(path), manifest, durable=False)
    for older in root.iterdir():
        if older != path and step_of(older.name) is not None:
            shutil.rmtree(older)
