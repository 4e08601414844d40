"""docs/operations.md and deploy/grafana/pushsvc-dashboard.json against the code: the metric
table and the dashboard's queries are checked against the daemon's real registry (a renamed
metric fails here), and every log event the page names is one the code emits."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import daemon_config

from pushsvc.devmem.fake import FakeDeviceMemory
from pushsvc.engine.fake import FakeEngine
from pushsvc.server.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "pushsvc-dashboard.json"

# What prometheus_client appends to a family's name, per type, on /metrics.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "gauge": ("",), "summary": ("", "_count", "_sum", "_created"), "info": ("_info",)}


@pytest.fixture(scope="module")
def families() -> Iterator[dict[str, str]]:
    """Every metric family of a real daemon's registry, GPU gauges included (they are
    registered when the daemon has device memory), as ``name on /metrics -> type``:
    counters as ``x_total``, histograms and gauges by their base name."""
    base = tempfile.mkdtemp(prefix="ps")
    try:
        daemon = Daemon(daemon_config(f"{base}/rt", "names"), engine=FakeEngine(), devmem=FakeDeviceMemory())
        found = {}
        for family in daemon.metrics.registry.collect():
            name = family.name + "_total" if family.type == "counter" else family.name
            found[name] = family.type
        yield found
    finally:
        shutil.rmtree(base, ignore_errors=True)


def series_names(families: dict[str, str]) -> set[str]:
    """Every sample name a query may use."""
    names = set()
    for name, kind in families.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        names |= {base + suffix for suffix in _SUFFIXES[kind]}
    return names


def test_registry_sees_the_metrics_that_need_a_running_service(families: dict[str, str]) -> None:
    for name in ("pushsvc_transfers_total", "pushsvc_transfer_seconds", "pushsvc_nixl_handles",
                 "pushsvc_table_entries", "pushsvc_landing_slots", "process_open_fds"):
        assert name in families


# ---------------------------------------------------------------- the metric table


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _first_column(section: str) -> list[str]:
    """Backticked names in the first cell of each table row of ``section``."""
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_every_exported_metric_is_in_the_table_and_nothing_else(families: dict[str, str]) -> None:
    section = _section(OPERATIONS.read_text(), "Metrics")
    table = section.split("`pushsvc_failures_total{kind}`:")[0]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == set(families), (
        f"missing from docs/operations.md: {sorted(set(families) - set(rows))}; "
        f"not exported: {sorted(set(rows) - set(families))}")
    wrong = {name: (rows[name], kind) for name, kind in families.items() if rows[name] != kind}
    assert not wrong, f"documented type, exported type: {wrong}"


def test_every_failure_kind_in_the_code_is_documented() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "pushsvc").rglob("*.py"))
    kinds = set(re.findall(r'failures\.labels\("([a-z_]+)"', code))
    assert kinds, "the pattern no longer finds the failure kinds"
    section = _section(OPERATIONS.read_text(), "Metrics").split("`pushsvc_failures_total{kind}`:")[1]
    documented = set(_first_column(section))
    assert kinds <= documented, sorted(kinds - documented)


# ---------------------------------------------------------------- log events


def _emitted_events() -> set[str]:
    code = "\n".join(p.read_text() for p in (ROOT / "pushsvc").rglob("*.py"))
    return set(re.findall(r'log\.(?:debug|info|warning|error|exception)\(\s*"([a-z_]+)"', code))


def test_log_events_named_in_the_docs_are_emitted_by_the_code() -> None:
    emitted = _emitted_events()
    assert {"daemon_started", "push_failed", "sd_notify_failed"} <= emitted  # the pattern still works
    text = OPERATIONS.read_text()
    alert_events = _first_column(_section(text, "Log events worth alerting on"))
    assert len(alert_events) > 20
    lifecycle = re.findall(r"`([a-z_]+)`", text.split("Lifecycle events worth a dashboard annotation:")[1]
                           .split("\n\n")[0])
    unknown = sorted(set(alert_events + lifecycle) - emitted)
    assert not unknown, f"named in docs/operations.md, emitted nowhere: {unknown}"


def test_every_error_event_of_the_daemon_is_worth_an_alert() -> None:
    """A new log.error in the daemon must get a row (warnings are a judgement; errors not)."""
    code = "\n".join(p.read_text() for p in (ROOT / "pushsvc" / "server").rglob("*.py"))
    errors = set(re.findall(r'log\.(?:error|exception)\(\s*"([a-z_]+)"', code))
    documented = set(_first_column(_section(OPERATIONS.read_text(), "Log events worth alerting on")))
    # health_cap_failed: a bug guard in the health server's connection cap, logged with its traceback.
    assert errors - documented <= {"health_cap_failed"}, sorted(errors - documented)


def test_troubleshooting_names_real_metrics_and_events(families: dict[str, str]) -> None:
    section = _section(OPERATIONS.read_text(), "Troubleshooting")
    series = series_names(families) | set(families)  # a histogram may be named by its family
    emitted = _emitted_events()
    named = set(re.findall(r"`([a-z_]+)(?:\{[^`]*\})?`", section))
    metrics = {n for n in named if n.startswith(("pushsvc_", "process_"))}
    assert metrics and metrics <= series, sorted(metrics - series)
    events = {n for n in named if n in emitted}
    assert len(events) >= 8


def test_linked_from_the_readme() -> None:
    assert "(docs/operations.md)" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------- the dashboard

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges, grouping clauses and function calls are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", expr):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le, side) (rate(pushsvc_phase_seconds_bucket'
                        '{job=~"$job", phase="total"}[$__rate_interval])))') == {"pushsvc_phase_seconds_bucket"}
    assert metric_names("process_resident_memory_bytes / 2^30 > pushsvc_peers offset 5m") == {
        "process_resident_memory_bytes", "pushsvc_peers"}
    assert metric_names('sum(rate(pushsvc_transfer_byte_total{x="rate(y)"}[5m]))') == {"pushsvc_transfer_byte_total"}


def _panels(node: dict) -> Iterator[dict]:
    for panel in node.get("panels", []):
        yield panel
        yield from _panels(panel)


def test_dashboard_queries_only_exported_metrics(families: dict[str, str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = series_names(families)
    used: set[str] = set()
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = metric_names(expr)
            assert names, f"{panel['title']!r}: no metric in {expr!r}"
            unknown = names - series
            assert not unknown, f"{panel['title']!r} queries {sorted(unknown)}, which the daemon does not export"
            used |= names
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert metric_names(var["definition"].removeprefix("label_values(").rsplit(",", 1)[0]) <= series
    # The panels the dashboard promises.
    for name in ("pushsvc_transfers_total", "pushsvc_transfer_seconds_bucket", "pushsvc_phase_seconds_bucket",
                 "pushsvc_transfer_bytes_total", "pushsvc_landing_slots", "pushsvc_staging_waits_total",
                 "pushsvc_peers", "pushsvc_rejected_connections_total", "pushsvc_malformed_inputs_total",
                 "pushsvc_nixl_handles", "process_open_fds"):
        assert name in used, name


def test_dashboard_quantiles_come_from_histograms(families: dict[str, str]) -> None:
    histograms = {n for n, kind in families.items() if kind == "histogram"}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            if "histogram_quantile" in target["expr"]:
                (name,) = metric_names(target["expr"])
                assert name.removesuffix("_bucket") in histograms and "by (le" in target["expr"], target["expr"]


def test_the_proxy_metric_table_is_the_proxys_registry() -> None:
    from pushsvc.proxy.metrics import ProxyMetrics

    exported = {f.name + "_total" if f.type == "counter" else f.name: f.type
                for f in ProxyMetrics().registry.collect()}
    section = _section(OPERATIONS.read_text(), "Proxy metrics")
    documented = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.split("|")]
            documented[cells[1].strip("`")] = cells[2]
    assert documented == exported
