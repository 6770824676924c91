"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules are well formed,
every PromQL expression parses (promql-parser, the Prometheus parser's Rust port), and
every metric and label they query is exported by a live sidecar's ``/metrics``, with the
label values they match. The sidecars are real ``nccl-back serve`` processes: one loads
from storage, a second from it, so the send metrics carry real values."""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser  # the dev extra: a missing parser fails the run, never skips it
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nccl_back.dev.servers import free_port
from nccl_back.errors import ConfigError
from nccl_back.metrics import Metrics

from models import TinyTransformer, fill_random, write_checkpoint
from test_server import Serve

pytestmark = pytest.mark.timeout(180)

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "prometheus-rules.yaml"
#: Labels Prometheus adds from the scrape target (the PodMonitor), not the exporter.
TARGET_LABELS = {"namespace", "pod", "instance", "job"}
#: Grafana's variables, as values PromQL accepts, so the expressions parse as Grafana sends them.
GRAFANA_VARS = {"$__rate_interval": "5m", "$namespace": ".*"}
#: promql-parser's MatchOp (not hashable) by its str(), as PromQL spells it.
MATCH_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def rule_exprs() -> list[tuple[str, str]]:
    """(alert name, PromQL) of every rule."""
    doc = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in doc["spec"]["groups"] for r in g["rules"]]


def promql(expr: str) -> Any:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)


def uses(expr: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """The selectors of ``expr`` as (metric, [(label, op, value)]), and its by/without labels."""
    selectors: list[tuple[str, list[tuple[str, str, str]]]] = []
    grouping: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [(m.name, MATCH_OPS[str(m.op)], m.value) for m in node.matchers.matchers]
            selectors.append((node.name, matchers))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)

    promql_parser.walk(promql(expr), visit)
    return selectors, grouping


# --------------------------------------------------------------------------- structure


def test_dashboard_is_a_grafana_dashboard_of_promql_panels() -> None:
    """The JSON has a title, uid, a Prometheus data source variable and panels, each with a
    title, a grid position and at least one PromQL target that parses."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert len(dash["panels"]) >= 10
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for p in dash["panels"]:
        assert p["title"] and p["type"] in {"timeseries", "stat"}, p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"].strip()
            promql(t["expr"])  # raises ValueError on a syntax error
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for wanted in ("loads by source", "fallbacks", "transfer and relay gb/s", "verification",
                   "records rejected", "sends in flight"):
        assert wanted in titles


def test_rules_are_a_prometheus_rule_of_alerts() -> None:
    """groups/rules each with alert, a PromQL expr that parses, for, severity and annotations."""
    doc = yaml.safe_load(RULES.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    groups = doc["spec"]["groups"]
    assert groups and all(g["name"] and g["rules"] for g in groups)
    names = []
    for g in groups:
        for r in g["rules"]:
            assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, r
            names.append(r["alert"])
            promql(r["expr"])
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["for"]
            assert r["labels"]["severity"] in {"critical", "warning", "info"}
            assert r["annotations"]["summary"] and r["annotations"]["description"]
    assert len(set(names)) == len(names)
    for wanted in ("NcclBackFleetFallsBackToStorage", "NcclBackVerificationFailure",
                   "NcclBackRecordsRejected"):
        assert wanted in names


def test_podmonitor_scrapes_the_sidecar_health_port() -> None:
    """The PodMonitor selects the worker pods and scrapes /metrics on the port named health."""
    doc = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    worker = yaml.safe_load_all((MONITORING.parent / "base" / "worker.yaml").read_text())
    deployment = next(d for d in worker if d and d["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert doc["spec"]["podMetricsEndpoints"] == [{"port": "health", "path": "/metrics", "interval": "30s"}]


def test_sends_in_flight_and_sent_bytes_by_role() -> None:
    """sending() counts a send for the block's duration; record_sent adds bytes and seconds;
    an unknown role is a ConfigError naming it."""
    m = Metrics()
    with m.sending("relay"):
        assert m.sends_in_flight.labels(role="relay")._value.get() == 1
    assert m.sends_in_flight.labels(role="relay")._value.get() == 0
    m.record_sent("holder", 1000, 0.5)
    assert m.sent_bytes.labels(role="holder")._value.get() == 1000
    with pytest.raises(ConfigError, match=r"role='tree': choose one of holder, relay"):
        m.record_sent("tree", 1, 1.0)


# --------------------------------------------------------------------------- live /metrics


def _exported(text: str) -> dict[str, dict[str, set[str]]]:
    """Sample name -> label name -> values seen, from a /metrics page."""
    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = out.setdefault(s.name, {})
            for k, v in s.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


def _value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"{name}{labels} not exported")


def _problems(where: str, expr: str, exported: dict[str, dict[str, set[str]]]) -> list[str]:
    selectors, grouping = uses(expr)
    problems = []
    names = set()
    for name, matchers in selectors:
        if name not in exported:
            problems.append(f"{where}: {name} is not exported")
            continue
        names.add(name)
        for label, op, value in matchers:
            if label == "__name__" or label in TARGET_LABELS:
                continue
            if label not in exported[name]:
                problems.append(f"{where}: {name} has no label {label!r}")
            elif op in ("=", "!="):
                if value not in exported[name][label]:
                    problems.append(f"{where}: {name}{{{label}{op}{value!r}}}: no such value")
            elif re.fullmatch(r"[\w|]+", value):  # an alternation of plain values
                missing = set(value.split("|")) - exported[name][label]
                if missing:
                    problems.append(f"{where}: {name}{{{label}}}: no values {sorted(missing)}")
    available = {k for n in names for k in exported[n]} | TARGET_LABELS
    for label in grouping - available:
        problems.append(f"{where}: grouped by {label!r}, which none of its metrics has")
    return problems


@pytest.fixture
def sidecars(tmp_path: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[tuple[Serve, Serve]]:
    """A sidecar loaded from storage, and a second one that loaded from it (a peer load)."""
    import os

    ckpt = write_checkpoint(fill_random(TinyTransformer(), 5), tmp_path / "ckpt", n_shards=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    env.update({
        "NCCL_BACK_REDIS_URL": redis_url, "NCCL_BACK_NAMESPACE": namespace,
        "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1", "NCCL_BACK_CACHE_DIR": cache_dir,
        "NCCL_BACK_SECRET": "m" * 32, "NCCL_BACK_TRANSFER_TIMEOUT": "30",
    })
    started: list[Serve] = []
    try:
        first = Serve(["--model", str(ckpt)], env, free_port())
        started.append(first)
        assert first.wait_ready()["source"] == "storage"
        with tempfile.TemporaryDirectory(prefix="nb-") as sock_dir:
            second = Serve(["--model", str(ckpt), "--socket", os.path.join(sock_dir, "h.sock")],
                           env, free_port())
            started.append(second)
            assert second.wait_ready()["source"] == "peer"
            yield first, second
    finally:
        for s in started:
            s.kill()


def test_every_queried_metric_is_exported_by_a_live_sidecar(sidecars: tuple[Serve, Serve]) -> None:
    """Each metric, label and label value the dashboard and the rules use is on /metrics; the
    holder's send counters carry the peer load it served."""
    holder, receiver = sidecars
    deadline = time.monotonic() + 30
    while True:  # the holder counts its send once its own side of the broadcast returns
        status, text = holder.get("/metrics")
        assert status == 200
        if _value(text, "nccl_back_sent_bytes_total", role="holder") > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert _value(text, "nccl_back_sent_bytes_total", role="holder") > 0
    assert _value(text, "nccl_back_send_seconds_total", role="holder") > 0
    assert _value(text, "nccl_back_sends_in_flight", role="holder") == 0
    assert _value(text, "nccl_back_transfers_served_total", outcome="ok") == 1
    _, received = receiver.get("/metrics")
    assert _value(received, "nccl_back_loads_total", source="peer") == 1

    exported = _exported(text)
    problems = []
    for where, expr in [*dashboard_exprs(), *rule_exprs()]:
        problems += _problems(where, expr, exported)
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["query"]["query"])
            assert m, var
            if m[1] not in exported:
                problems.append(f"variable {var['name']}: {m[1]} is not exported")
    assert not problems, "\n".join(problems)
    # The check is real: a typo in a name, a label or a value is caught.
    assert _problems("x", 'rate(nccl_back_loads_totl[5m])', exported)
    assert _problems("x", 'sum by (reason) (rate(nccl_back_loads_total[5m]))', exported)
    assert _problems("x", 'nccl_back_fallbacks_total{reason="no_peers"}', exported)
    assert _problems("x", 'nccl_back_fallbacks_total{reason!="no_peers"}', exported)
    assert _problems("x", 'nccl_back_loads_total{source=~"peer|disk"}', exported)
    assert not _problems("x", 'nccl_back_loads_total{source=~"peer|storage",pod="p"}', exported)
