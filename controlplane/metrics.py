"""The control plane's figures for Prometheus: what is booked, what the nodes say, and how fast the parts work.

Gauges are read when scraped (in the manner of kube-state-metrics), from the
store (reservations by pool and state), the catalog and the node service
(nodes by pool and state, heartbeat age, bindings wanted and releases held
per node); counters and histograms are fed by the parts as they work: a
create's latency by outcome (the HTTP edge), each store group's size (the
writer), each reconciler pass's duration. One registry per control plane.
Every metric is listed in docs/operations.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import structlog
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.metrics import LATENCY_BUCKETS
from common.version import VERSION
from controlplane.domain.errors import DomainError
from controlplane.domain.states import DRAFT

log = structlog.get_logger("berth.metrics")

if TYPE_CHECKING:
    from controlplane.wiring import ControlPlane

GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the writer's group holds at most 256 jobs


class ControlPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.create_seconds = Histogram(
            "berth_create_duration_seconds", "Create requests from their body read to the answer, by outcome (the "
            "reservation's state, or the error code).", ["outcome"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.group_jobs = Histogram(
            "berth_store_group_jobs", "Jobs committed together by one store transaction (one fsync).",
            buckets=GROUP_BUCKETS, registry=self.registry)
        self.pass_seconds = Histogram(
            "berth_reconciler_pass_duration_seconds", "One reconciler pass over the timers due.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._create_by_outcome: dict[str, Histogram] = {}  # (labels() takes a lock and checks its values per call)
        self._snapshot: _Snapshot | None = None

    def created(self, outcome: str, seconds: float) -> None:
        child = self._create_by_outcome.get(outcome)
        if child is None:
            child = self._create_by_outcome[outcome] = self.create_seconds.labels(outcome)
        child.observe(seconds)

    def group_committed(self, jobs: int) -> None:
        self.group_jobs.observe(jobs)

    def passed(self, seconds: float) -> None:
        self.pass_seconds.observe(seconds)

    def watch(self, cp: "ControlPlane") -> None:
        """Read `cp`'s gauges at every scrape from now on."""
        self._snapshot = _Snapshot(cp)
        self.registry.register(self._snapshot)

    async def read_store(self, cp: "ControlPlane") -> None:
        """Before a scrape: what it shows from the database, read off the API's loop. A database that is away keeps
        the counts of the last scrape (the rest of the figures matter most then): logged, not a failed scrape."""
        if self._snapshot is None:
            return
        try:
            self._snapshot.state_counts = await cp.store.state_counts()
        except DomainError as exc:
            log.warning("reservation counts not read for the scrape; the last ones are shown", error=exc.message)


class _Snapshot:
    """Reservations, nodes and bindings as the control plane holds them at the scrape."""

    def __init__(self, cp: "ControlPlane") -> None:
        self.cp = cp
        self.state_counts: list[tuple[str, str, int]] = []  # read_store's, before each scrape

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        reservations = GaugeMetricFamily("berth_reservations", "Reservations by pool and state (released and "
                                         "cancelled ones included: they stay listed; drafts, the refused and "
                                         "undecided creates a key keeps, are not reservations).",
                                         labels=["pool", "state"])
        for pool, state, n in self.state_counts:
            if state != DRAFT:
                reservations.add_metric([pool, state], n)
        yield reservations
        nodes = GaugeMetricFamily("berth_nodes", "Nodes by pool and state: ready, cordoned, draining, cleaning, "
                                  "maintenance, or lost (its agent silent past the grace).", labels=["pool", "state"])
        age = GaugeMetricFamily("berth_node_heartbeat_age_seconds", "Seconds since the node's agent last sent a "
                                "heartbeat (absent for a node never heard from).", labels=["node", "pool"])
        bindings = GaugeMetricFamily("berth_node_bindings", "Bindings the control plane wants on each node: bound "
                                     "(binding or active reservations) or held (a kubernetes release whose devices "
                                     "pods still hold).", labels=["node", "pool", "state"])
        by_state: dict[tuple[str, str], int] = {}
        for node, state, heartbeat_age, wanted, held in self.cp.nodes.gauges():
            by_state[(node.pool_id, state)] = by_state.get((node.pool_id, state), 0) + 1
            if heartbeat_age is not None:
                age.add_metric([node.id, node.pool_id], heartbeat_age)
            bindings.add_metric([node.id, node.pool_id, "bound"], wanted)
            bindings.add_metric([node.id, node.pool_id, "held"], held)
        for (pool, state), n in sorted(by_state.items()):
            nodes.add_metric([pool, state], n)
        yield nodes
        yield age
        yield bindings
        yield CounterMetricFamily("berth_store_groups", "Store transactions committed (each one fsync; one that failed "
                                  "and was rolled back is not counted).",
                                  value=self.cp.store.groups)
        yield CounterMetricFamily("berth_store_jobs", "Store jobs run (creates, reports, reconciler passes...).",
                                  value=self.cp.store.jobs)
        writer = getattr(self.cp.store, "writer", None)
        yield CounterMetricFamily("berth_store_race_retries", "Store groups run again after losing a race with "
                                  "another replica (PostgreSQL).", value=getattr(writer, "retries", 0))
        yield CounterMetricFamily("berth_store_reloads", "Times this replica brought its memory up to the database "
                                  "because another replica wrote, or a speculative group was abandoned (PostgreSQL).",
                                  value=getattr(writer, "reloads", 0))
        yield CounterMetricFamily("berth_store_rebuilds", "Times the memory was rebuilt whole from the database: "
                                  "PostgreSQL, of the reloads and at start, rather than only the reservations that "
                                  "changed; SQLite, after a group's commit failed.",
                                  value=getattr(writer, "rebuilds", getattr(self.cp.store, "rebuilds", 0)))
        yield CounterMetricFamily("berth_store_speculative_groups", "Store groups of creates run while the previous "
                                  "group committed, and committed by one statement (PostgreSQL).",
                                  value=getattr(writer, "speculated", 0))
        yield CounterMetricFamily("berth_store_commit_waits_expired", "Requests answered PROVIDER_UNAVAILABLE "
                                  "because their change was not committed within --commit-wait (PostgreSQL).",
                                  value=getattr(writer, "expired", 0))
        info = GaugeMetricFamily("berth_controlplane_build_info", "1, labelled with the release this control plane "
                                 "runs, its store's engine and the version of its database's schema: during a rolling "
                                 "upgrade, which replicas run which release.", labels=["version", "engine", "schema"])
        info.add_metric([VERSION, self.cp.store.engine, str(self.cp.store.schema_version)], 1)
        yield info
        yield GaugeMetricFamily("berth_replica_leader", "1 while this replica leads: drives the timers and "
                                "watches for lost nodes (always 1 on SQLite).", value=int(self.cp.replicas.leads()))
        yield CounterMetricFamily("berth_replica_catch_ups", "Times this replica brought its memory up to the "
                                  "database for requests that could not wait for the NOTIFY: an unknown token, a "
                                  "watch's version it did not hold (PostgreSQL; at most 20 a second).",
                                  value=self.cp.replicas.catch_ups)
        yield CounterMetricFamily("berth_reconciler_passes", "Reconciler passes run.",
                                  value=self.cp.reconciler.passes)
        yield CounterMetricFamily("berth_reconciler_transitions", "Reservations the reconciler moved (a window "
                                  "started or ended, a grace ran out).", value=self.cp.reconciler.transitions)
        yield CounterMetricFamily("berth_reconciler_timer_failures", "Timers whose handling failed (a defect): each "
                                  "set aside for a minute, the others going on.", value=self.cp.reconciler.failures)
