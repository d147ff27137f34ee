"""The binding controller: the wanted set from the control plane made real on this host, and kept so.

`reconcile(bindings)` translates each wanted binding into what the kernel
should have (agent/bindspec.py), plans against what cgroupfs has
(agent/binder.py `plan`), carries the plan out (`Binder.run`, in a worker
thread: kernel calls block) and keeps the per-binding states that /status
shows. The first wanted set is the start-up pass: what is wanted is adopted
unchanged, what nobody wants is removed; before it nothing is removed. The
reports the binder queues in the checkpoint are for the link
(agent/link.py) to deliver. One pass at a time (a lock), so the watch, the
periodic drift check and an inventory change never interleave.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

import structlog

from agent.binder import Binder, Have, Outcome, Refused, plan
from agent.bindspec import BindError, HostView, Want, refusal, want_of
from agent.checkpoint import Checkpoint
from agent.kubernetes import KubernetesBindings
from agent.lifetime import Lifetimes
from agent.nodebinding import NodeBindings
from agent.metrics import AgentMetrics
from common.nodewire import Binding, Report

log = structlog.get_logger("berth.agent")


class BindingController:
    def __init__(self, binder: Binder, checkpoint: Checkpoint, metrics: AgentMetrics,
                 host_view: Callable[[], HostView | None], on_reports: Callable[[], None],
                 kubernetes: KubernetesBindings | None = None, lifetimes: Lifetimes | None = None,
                 nodes: NodeBindings | None = None) -> None:
        self.binder = binder
        self.nodes = nodes  # node bindings: hand-over and hand-back (None: refuse them)
        self.lifetimes = lifetimes  # the end.json files hold workloads read (None: none written)
        self.kubernetes = kubernetes  # the device plugins for kubernetes bindings (None: refuse them)
        self.checkpoint = checkpoint
        self.metrics = metrics
        self.host_view = host_view  # the current translation context (changes with each discovery)
        self.on_reports = on_reports  # reports were queued: wake the link's report loop
        self.wanted: list[Binding] | None = None  # the last complete wanted set; None before the first answer
        self.states: dict[str, dict] = {}
        self.resource_version = 0
        self.lock = asyncio.Lock()
        self.log = log

    @property
    def started(self) -> bool:
        """Whether the start-up pass is done (the first wanted set was reconciled)."""
        return self.wanted is not None

    def cgroup_of(self, reservation_id: str) -> Path:
        return self.binder.cgroup_of(reservation_id)

    def _desired(self, bindings: list[Binding]) -> dict[str, Want | BindError | Refused]:
        host = self.host_view()
        assert host is not None, "reconcile before the first discovery"
        out: dict[str, Want | BindError | Refused] = {}
        for b in bindings:
            why = refusal(b, kubernetes=self.kubernetes is not None)
            if why:
                out[b.reservationId] = Refused(why)
                continue
            try:
                out[b.reservationId] = want_of(b, host)
            except BindError as exc:
                out[b.reservationId] = exc
        return out

    async def reconcile(self, bindings: list[Binding], seen: float, *, resource_version: int | None = None,
                        why: str = "") -> list[Outcome]:
        async with self.lock:
            first = self.wanted is None
            self.wanted = list(bindings)
            # kubernetes and node bindings go to their own managers where this agent makes them; the rest are cgroups
            managed = {"kubernetes": self.kubernetes is not None, "node": self.nodes is not None}
            pods = [b for b in bindings if b.kind == "kubernetes" and managed["kubernetes"]]
            metal = [b for b in bindings if b.kind == "node" and managed["node"]]
            others = [b for b in bindings if not managed.get(b.kind, False)]
            if self.nodes is not None:
                await self._reconcile_nodes(metal)
            actual: dict[str, Have] = await asyncio.to_thread(self.binder.actual)
            if self.kubernetes is not None:
                await self._reconcile_pods(pods, [b for b in others if b.reservationId not in actual])
                # a new binding whose devices pods of an ended kubernetes booking still hold waits for their eviction
                others = [b for b in others if b.reservationId not in self.kubernetes.blocked]
            desired = self._desired(others)
            actions = plan(desired, actual)
            if resource_version is not None:
                self.resource_version = resource_version
                self.checkpoint.set_version(resource_version)
                self.metrics.resource_version = resource_version
            wanted_pods = {b.reservationId for b in pods}
            for rid in [r for r in self.checkpoint.bindings
                        if r not in desired and r not in actual and r not in wanted_pods]:
                entry = self.checkpoint.bindings[rid]
                self.checkpoint.forget(rid)
                if entry.state in ("completed", "removing"):
                    self.checkpoint.queue_report(Report(rid, "unbound"))
            outcomes = await asyncio.to_thread(self.binder.run, actions)
            for o in outcomes:
                if o.action.kind in ("create", "update") and o.ok:
                    self.metrics.bind_latency.observe(time.monotonic() - seen)
                if o.ok:
                    self.metrics.binder_took(o.action.kind, o.seconds)
                if o.repaired:
                    self.metrics.drift_repairs += len(o.repaired)
            self._update_states(outcomes)
            if self.lifetimes is not None:
                self.lifetimes.sync(b for b in others if b.kind == "hold"
                                    and self.states.get(b.reservationId, {}).get("state") == "bound")
            if first or any(o.action.kind != "keep" for o in outcomes):
                counts: dict[str, int] = {}
                for o in outcomes:
                    counts[o.action.kind] = counts.get(o.action.kind, 0) + 1
                self.log.info("reconciled", why=why, resource_version=self.resource_version, **counts)
            if self.checkpoint.data.pendingReports:
                self.on_reports()
            return outcomes

    async def _reconcile_nodes(self, metal: list[Binding]) -> None:
        """The node bindings: hand over, extend, take back. A hand-back's `unbound` is kept and sent before the
        node is cleaned in band (the control plane shows it `cleaning` meanwhile), and a record is dropped only
        once its reports are kept. A hand-over the pass left for after a hand-back and its cleaning is made in a
        second pass, once they are done."""
        assert self.nodes is not None
        for _ in range(2):
            for report in await asyncio.to_thread(self.nodes.reconcile, metal):
                self.checkpoint.queue_report(report)
            if self.nodes.to_clean:
                await asyncio.to_thread(self.checkpoint.save)
                self.on_reports()
                for report in await asyncio.to_thread(self.nodes.clean_handed_back):
                    self.checkpoint.queue_report(report)
            if self.nodes.handed_back:
                await asyncio.to_thread(self.checkpoint.save)
                await asyncio.to_thread(self.nodes.forget_handed_back)
            if not self.nodes.deferred:
                break

    async def _reconcile_pods(self, pods: list[Binding], fresh: list[Binding]) -> None:
        """The kubernetes bindings: advertise, report, and keep the bound ones in the checkpoint; `fresh` (other
        bindings not made yet) wait while pods of an ended kubernetes booking hold their devices."""
        assert self.kubernetes is not None
        host = self.host_view()
        assert host is not None
        for report in await self.kubernetes.reconcile(pods, host.inventory, fresh):
            self.checkpoint.queue_report(report)
        for entry in self.kubernetes.bound_entries(pods):
            old = self.checkpoint.bindings.get(entry.reservationId)
            if old is None or (old.spec, old.devices, old.state) != (entry.spec, entry.devices, entry.state):
                self.checkpoint.set(entry)
        for rid in self.kubernetes.let_go:  # AllocationReleased reported: nothing of it is left here
            self.checkpoint.forget(rid)

    async def recheck(self, why: str) -> None:
        """Reconcile the last wanted set again (drift repair, a changed inventory); nothing before the first."""
        if self.wanted is not None:
            await self.reconcile(self.wanted, time.monotonic(), why=why)

    def _update_states(self, outcomes: list[Outcome]) -> None:
        states: dict[str, dict] = {}
        unenforced: dict[str, int] = {}
        for o in outcomes:
            a = o.action
            if a.kind == "remove":
                if not o.ok:
                    states[a.reservation_id] = {"state": "removing"}
                continue
            if a.kind == "refuse":
                states[a.reservation_id] = {"state": "refused", "message": a.reason}
            elif a.kind == "fail" or not o.ok:
                states[a.reservation_id] = {"state": "failed",
                                            "message": a.reason or (o.report.message if o.report else "")}
            else:
                assert a.want is not None
                states[a.reservation_id] = {"state": "bound", "cgroup": str(self.cgroup_of(a.reservation_id)),
                                            "devices": list(a.want.devices), "unenforced": list(a.want.unenforced)}
                for u in a.want.unenforced:
                    c = u.split(" ", 1)[0]
                    unenforced[c] = unenforced.get(c, 0) + 1
        if self.kubernetes is not None:
            states.update(self.kubernetes.states)
        if self.nodes is not None:
            states.update(self.nodes.states)
        self.states = states
        counts: dict[str, int] = {}
        for s in states.values():
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        self.metrics.bindings = counts
        self.metrics.unenforced = unenforced

    async def check_oom(self) -> dict[str, int]:
        """Bound reservations whose cgroup's OOM kill count grew: logged, counted, and a bound report with the
        new count queued (the control plane sets the reservation's OOMKilled condition)."""
        bound = [rid for rid, s in self.states.items() if s.get("state") == "bound"]
        async with self.lock:
            grown = await asyncio.to_thread(self.binder.count_oom_kills, bound)
        for rid, total in grown.items():
            self.metrics.oom_kills += 1
            self.log.warning("workload OOM-killed", reservation_id=rid, oom_kills=total)
        if grown:
            await self.recheck("OOM kill")  # queues the bound reports that carry the new counts
        return grown

    async def watch_oom(self, every_s: float) -> None:
        """check_oom every `every_s`: a tenant hears within seconds that its workload outgrew its memory."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.check_oom()
            except Exception as exc:  # keep watching
                self.log.error("OOM check failed", error=str(exc))

    async def periodic(self, every_s: float) -> None:
        """Re-check the last wanted set every `every_s` (a limit or device program changed behind our back)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.recheck("periodic check")
            except Exception as exc:  # keep checking; the next pass tries again
                self.log.error("periodic check failed", error=str(exc))
