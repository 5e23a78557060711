"""The alert rules under promtool: they load (`promtool check rules`), and each alert fires in
the situation it names and stays quiet in the ones it must not mistake for it
(`promtool test rules` on tests/k8s/alerts.test.yaml)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from harness.prometheus import needs_promtool, promtool, rule_file, rule_groups

CASES = Path(__file__).with_name("alerts.test.yaml")


def alert_names() -> set[str]:
    return {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}


@needs_promtool
def test_promtool_accepts_the_rules(tmp_path):
    """The PrometheusRule's groups, annotations included, pass `promtool check rules`."""
    path = rule_file(tmp_path / "rules.yaml")
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in out.stdout


@needs_promtool
def test_every_alert_passes_its_promtool_unit_tests(tmp_path):
    """promtool evaluates the real rules on the cases' series and compares every alert."""
    rule_file(tmp_path / "rules.yaml", descriptions=False)
    shutil.copy(CASES, tmp_path / CASES.name)
    out = promtool("test", "rules", str(tmp_path / CASES.name))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
def test_a_wrong_expectation_fails_promtool(tmp_path):
    """The unit tests can fail: a case that expects a quiet pod to alert is reported."""
    rule_file(tmp_path / "rules.yaml", descriptions=False)
    case = {
        "rule_files": ["rules.yaml"],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'jitckpt_sidecar_ready{namespace="ml", pod="p"}', "values": "1x40"}
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "35m",
                        "alertname": "JitckptSidecarNotReady",
                        "exp_alerts": [{"exp_labels": {"severity": "warning"}}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump(case))
    out = promtool("test", "rules", str(tmp_path / "wrong.yaml"))
    assert out.returncode != 0
    assert "FAILED" in out.stdout + out.stderr


def test_every_alert_has_cases_where_it_fires_and_where_it_does_not():
    """Each alert of the PrometheusRule has a firing case and a quiet case in the unit tests."""
    cases = yaml.safe_load(CASES.read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == alert_names()
    assert quiet == alert_names()
