"""The agent's own figures in the Prometheus text format, and the small HTTP server that shows them.

`AgentMetrics` holds what the runtime counts: bindings by state, bind latency
(a histogram, from the watch answer that asked for a binding to its cgroup
being made), watch reconnects, heartbeat age (seconds since the last
accepted heartbeat, computed when scraped), the controllers enforced and
missing, reports waiting. `metrics_app(metrics, status)` serves `/metrics`
(text format 0.0.4) and `/status` (JSON: the runtime's own summary,
including each missing controller with the host setting that would add it).
No client library: the format is a few lines of text.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from typing import Callable

from aiohttp import web

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(str(v))}"' for k, v in sorted(labels.items())) + "}"


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets + (math.inf,), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_num(float(bound))}"}} {running}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class AgentMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.bindings: dict[str, int] = {}  # state -> count, set by the runtime after each pass
        self.bind_latency = Histogram()
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

    def heartbeat_age(self) -> float | None:
        return None if self.last_heartbeat is None else max(0.0, self.clock() - self.last_heartbeat)

    def render(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_num(value)}")

        states = {"bound": 0, "failed": 0, "refused": 0, "removing": 0} | self.bindings
        metric("berth_agent_bindings", "gauge", "Bindings on this node by state.",
               [({"state": s}, n) for s, n in sorted(states.items())])
        lines.append("# HELP berth_agent_bind_latency_seconds From the watch answer that wants a binding to its "
                     "cgroup made (share, record, device program).")
        lines.append("# TYPE berth_agent_bind_latency_seconds histogram")
        lines += self.bind_latency.lines("berth_agent_bind_latency_seconds")
        metric("berth_agent_watch_reconnects_total", "counter", "Watch calls that failed and were retried.",
               [({}, self.watch_reconnects)])
        metric("berth_agent_heartbeats_total", "counter", "Heartbeats by result.",
               [({"result": "ok"}, self.heartbeats_ok), ({"result": "error"}, self.heartbeat_failures)])
        age = self.heartbeat_age()
        metric("berth_agent_heartbeat_age_seconds", "gauge",
               "Seconds since the control plane last accepted a heartbeat (NaN before the first).",
               [({}, age if age is not None else float("nan"))])
        metric("berth_agent_reports_pending", "gauge", "Reports the control plane has not accepted yet.",
               [({}, self.reports_pending)])
        metric("berth_agent_resource_version", "gauge", "The resource version of the last watch answer applied.",
               [({}, self.resource_version)])
        metric("berth_agent_drift_repairs_total", "counter", "Limits or device programs put back after drift.",
               [({}, self.drift_repairs)])
        metric("berth_agent_controller_enforced", "gauge",
               "1 for each cgroup controller enforced, 0 for one the host does not offer (see /status for the "
               "host setting that would add it).",
               [({"controller": c}, 1) for c in self.controllers_enforced]
               + [({"controller": c}, 0) for c in self.controllers_missing])
        metric("berth_agent_oom_kill_events_total", "counter",
               "Times the OOM killer was seen to end processes in a bound reservation's cgroup.",
               [({}, self.oom_kills)])
        metric("berth_agent_bindings_unenforced", "gauge",
               "Bindings whose share asks for a controller this host does not give the agent.",
               [({"controller": c}, n) for c, n in sorted(self.unenforced.items())])
        return "\n".join(lines) + "\n"


def metrics_app(metrics: AgentMetrics, status: Callable[[], dict]) -> web.Application:
    app = web.Application()

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def get_status(request: web.Request) -> web.Response:
        return web.json_response(status())

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/status", get_status)
    return app
