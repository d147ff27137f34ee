"""The agent's own figures for Prometheus (through prometheus-client), and the small HTTP server that shows them.

`AgentMetrics` is what the runtime counts and sets: bindings by state, bind
latency (from the watch answer that asked for a binding to its cgroup being
made), the duration of each bind, update and unbind, watch reconnects,
heartbeats, the controllers enforced and missing, the bindings a missing
controller leaves unenforced, reports waiting. Each instance has its own
registry, so two agents in one process (tests) never share a figure. Gauges
are read from the plain attributes when scraped, in the manner of
kube-state-metrics, so the runtime never calls into the client library for
them. `metrics_app(metrics, status)` serves `/metrics` and `/status` (JSON: the
runtime's own summary, including each missing controller with the host
setting that would add it).
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from common.metrics import LATENCY_BUCKETS, scrape
BINDING_STATES = ("bound", "failed", "refused", "removing")
OPERATIONS = {"create": "bind", "update": "update", "remove": "unbind"}  # a plan's action kind -> the metric label


class AgentMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.bindings: dict[str, int] = {}  # state -> count, set by the runtime after each pass
        self.bind_latency = Histogram(
            "berth_agent_bind_latency_seconds", "From the watch answer that wants a binding to its cgroup made "
            "(share, record, device program).", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.operation_seconds = Histogram(
            "berth_agent_binding_operation_seconds", "Time the binder took to bind, update or unbind one "
            "reservation (kernel writes, device program, checkpoint).", ["operation"], buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.watch_reconnects = 0
        self.heartbeats_ok = 0
        self.heartbeat_failures = 0
        self.last_heartbeat: float | None = None
        self.reports_pending = 0
        self.resource_version = 0
        self.drift_repairs = 0
        self.controllers_enforced: tuple[str, ...] = ()
        self.controllers_missing: tuple[str, ...] = ()
        self.unenforced: dict[str, int] = {}  # controller -> bindings that asked for it but did not get it
        self.oom_kills = 0  # times a bound reservation's OOM kill count was seen to grow
        self.registry.register(_Snapshot(self))

    def heartbeat_age(self) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, self.clock() - self.last_heartbeat)

    def binder_took(self, action_kind: str, seconds: float) -> None:
        """One binder step (a plan action) finished in `seconds`; keeps and refusals are not timed."""
        operation = OPERATIONS.get(action_kind)
        if operation is not None:
            self.operation_seconds.labels(operation).observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _Snapshot:
    """The agent's counters and gauges, read from `AgentMetrics`' attributes at each scrape."""

    def __init__(self, m: AgentMetrics) -> None:
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # unchecked: the families are built from the attributes at collect time

    def collect(self) -> Iterator[Metric]:
        m = self.m
        bindings = GaugeMetricFamily("berth_agent_bindings", "Bindings on this node by state.", labels=["state"])
        for state, n in sorted(({s: 0 for s in BINDING_STATES} | m.bindings).items()):
            bindings.add_metric([state], n)
        yield bindings
        yield CounterMetricFamily("berth_agent_watch_reconnects", "Watch calls that failed and were retried.",
                                  value=m.watch_reconnects)
        beats = CounterMetricFamily("berth_agent_heartbeats", "Heartbeats by result.", labels=["result"])
        beats.add_metric(["ok"], m.heartbeats_ok)
        beats.add_metric(["error"], m.heartbeat_failures)
        yield beats
        age = m.heartbeat_age()
        yield GaugeMetricFamily("berth_agent_heartbeat_age_seconds", "Seconds since the control plane last "
                                "accepted a heartbeat (NaN before the first).",
                                value=age if age is not None else float("nan"))
        yield GaugeMetricFamily("berth_agent_reports_pending", "Reports the control plane has not accepted yet.",
                                value=m.reports_pending)
        yield GaugeMetricFamily("berth_agent_resource_version", "The resource version of the last watch answer "
                                "applied.", value=m.resource_version)
        yield CounterMetricFamily("berth_agent_drift_repairs", "Limits or device programs put back after drift.",
                                  value=m.drift_repairs)
        enforced = GaugeMetricFamily("berth_agent_controller_enforced", "1 for each cgroup controller enforced, "
                                     "0 for one the host does not offer (see /status for the host setting that "
                                     "would add it).", labels=["controller"])
        for c in m.controllers_enforced:
            enforced.add_metric([c], 1)
        for c in m.controllers_missing:
            enforced.add_metric([c], 0)
        yield enforced
        yield CounterMetricFamily("berth_agent_oom_kill_events", "Times the OOM killer was seen to end processes "
                                  "in a bound reservation's cgroup.", value=m.oom_kills)
        gaps = GaugeMetricFamily("berth_agent_bindings_unenforced", "Bindings whose share asks for a controller "
                                 "this host does not give the agent (enforcement gaps), by controller.",
                                 labels=["controller"])
        for c in sorted(set(m.controllers_missing) | set(m.unenforced)):
            gaps.add_metric([c], m.unenforced.get(c, 0))
        yield gaps


def metrics_app(metrics: AgentMetrics, status: Callable[[], dict]) -> web.Application:
    app = web.Application()

    async def get_metrics(request: web.Request) -> web.Response:
        return scrape(metrics.registry, request)

    async def get_status(request: web.Request) -> web.Response:
        return web.json_response(status())

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/status", get_status)
    return app
