"""The chart's alerts, rendered by helm and unit-tested by promtool (`promtool test rules`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from .tools import CHART, helm_template, run, tool

HERE = Path(__file__).resolve().parent / "promtool"


def render_rules(folder: Path) -> Path:
    served = ("monitoring.coreos.com/v1/PrometheusRule",)
    values = str(CHART / "ci" / "monitoring-values.yaml")
    docs = yaml.safe_load_all(helm_template(values, api_versions=served).stdout)
    (rule,) = [d for d in docs if d and d["kind"] == "PrometheusRule"]
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_rules_are_valid(tmp_path: Path) -> None:
    result = run(tool("promtool"), "check", "rules", str(render_rules(tmp_path)))
    assert "SUCCESS: 6 rules found" in result.stdout


def test_every_alert_fires_when_it_should_and_not_otherwise(tmp_path: Path) -> None:
    render_rules(tmp_path)
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    result = run(tool("promtool"), "test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test(tmp_path: Path) -> None:
    rules = yaml.safe_load(render_rules(tmp_path).read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"]}
    assert alerts == tested
