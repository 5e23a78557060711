"""A real Prometheus for tests (Debian's `prometheus` 2.42 and its `promtool`).

The alert rules are the groups of k8s/monitoring/prometheusrule.yaml, written as a Prometheus
rule file (`rule_file`); for a test that cannot wait minutes, `speedup=60` turns every minute
of a `for:` or a range window into a second and `replace` swaps a threshold of one alert. Each
`Prometheus` is started by the test on a free 127.0.0.1 port with its own config, TSDB and log
in a temp directory (never the package's systemd service), discovers the sidecars under test
through a file_sd JSON file that `targets()` rewrites, and answers queries through its HTTP API.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from harness.procs import REPO, free_port, wait_for

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RULES = REPO / "k8s" / "monitoring" / "prometheusrule.yaml"
DASHBOARD = REPO / "k8s" / "monitoring" / "grafana-dashboard.json"
MISSING = "not installed (Debian's `prometheus` package; .ci/run installs it)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {MISSING}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus {MISSING}")

_DURATION = re.compile(r"^(\d+)m$")
_WINDOW = re.compile(r"\[(\d+)m\]")


def rule_groups(
    *,
    descriptions: bool = True,
    speedup: int = 1,
    replace: Optional[Mapping[str, tuple[str, str]]] = None,
) -> list[dict[str, Any]]:
    """The PrometheusRule's groups. With `speedup=60`, `for: 5m` becomes `for: 5s` and `[15m]`
    becomes `[15s]`; `replace` maps an alert to (text in its expr, replacement), each of
    which must occur exactly once (a rule changed under the test fails it loudly)."""
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["spec"]["groups"]
    todo = dict(replace or {})
    for group in groups:
        for rule in group["rules"]:
            if not descriptions:
                rule.get("annotations", {}).pop("description", None)
            if speedup != 1:
                rule["for"] = _scale(rule.get("for", "0m"), speedup)
                rule["expr"] = _WINDOW.sub(
                    lambda found: f"[{_seconds(int(found.group(1)), speedup)}]", rule["expr"]
                )
            if rule.get("alert") in todo:
                old, new = todo.pop(rule["alert"])
                assert rule["expr"].count(old) == 1, f"{old!r} not once in {rule['expr']!r}"
                rule["expr"] = rule["expr"].replace(old, new)
    assert not todo, f"no such alerts: {sorted(todo)}"
    return groups


def _scale(duration: str, speedup: int) -> str:
    found = _DURATION.match(str(duration))
    assert found, f"`for: {duration}` is not in whole minutes"
    return _seconds(int(found.group(1)), speedup)


def _seconds(minutes: int, speedup: int) -> str:
    seconds = minutes * 60 // speedup
    assert seconds * speedup == minutes * 60, f"{minutes}m does not divide by {speedup}"
    return f"{seconds}s"


def rule_file(path: Path, **kwargs: Any) -> Path:
    """Write `rule_groups(**kwargs)` as a Prometheus rule file at `path`."""
    path.write_text(yaml.safe_dump({"groups": rule_groups(**kwargs)}, sort_keys=False))
    return path


def promtool(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    out = subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=120)
    return subprocess.CompletedProcess(
        out.args, out.returncode, out.stdout.decode(), out.stderr.decode()
    )


class Prometheus:
    """One Prometheus server scraping the targets the test names, with `rules` loaded."""

    def __init__(self, workdir: Path, rules: Path, interval: str = "1s") -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.targets_file = self.dir / "targets.json"
        self.targets({})
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": "jitckpt",
                    "scrape_timeout": interval,
                    "file_sd_configs": [
                        {"files": [str(self.targets_file)], "refresh_interval": interval}
                    ],
                }
            ],
        }
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log = self.dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        assert PROMETHEUS is not None
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [
                        PROMETHEUS,
                        f"--config.file={self.config}",
                        f"--storage.tsdb.path={self.dir / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--storage.tsdb.retention.time=1d",
                        "--log.level=warn",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                )
            try:
                wait_for(self._ready, timeout=60, what="prometheus ready", interval=0.1)
            except AssertionError:
                self.stop()
                continue
            return self
        raise RuntimeError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError("prometheus exited")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:  # noqa: S310 - loopback
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def targets(self, targets: Mapping[int, Mapping[str, str]]) -> None:
        """Scrape 127.0.0.1:<port> for each port, with its labels (namespace, pod, ...)."""
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": dict(labels)}
            for port, labels in targets.items()
        ]
        tmp = self.targets_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.targets_file)

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - loopback
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: Optional[float] = None) -> list[dict[str, Any]]:
        """An instant query: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        result: list[dict[str, Any]] = self.api("query", query=expr, time=at)["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        """A range query: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        result: list[dict[str, Any]] = self.api(
            "query_range", query=expr, start=start, end=end, step=step
        )["result"]
        return result

    def up(self, port: int) -> bool:
        """Whether the last scrape of 127.0.0.1:<port> succeeded."""
        found = self.query(f'up{{instance="127.0.0.1:{port}"}}')
        return bool(found) and found[0]["value"][1] == "1"

    def firing(self, alert: str, **labels: str) -> bool:
        selector = ", ".join(
            [f'alertname="{alert}"', 'alertstate="firing"']
            + [f'{k}="{v}"' for k, v in labels.items()]
        )
        return bool(self.query(f"ALERTS{{{selector}}}"))

    def wait_firing(self, alert: str, timeout: float, **labels: str) -> float:
        """Wait until `alert` fires for `labels`; the time.time() it was first seen firing."""
        wait_for(lambda: self.firing(alert, **labels), timeout, f"{alert} {labels} firing", 0.25)
        return time.time()

    def output(self) -> str:
        return self.log.read_text()[-5000:] if self.log.exists() else ""
