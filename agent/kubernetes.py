"""The kubernetes bindings of this node: the kubelet sees exactly the booked devices, and no more.

For each resource name (a pool's `policy.kubernetes.resourceName`) the agent
runs one device plugin (agent/kubelet/plugin.py) that advertises the units of
this node's active kubernetes bindings, each Healthy unless the inventory's
health says otherwise; a device outside every active binding is never
advertised, so the kubelet cannot give it to a pod. A binding is reported
`bound` once its plugin is registered with the kubelet and advertises it.

A released binding (the release hold) is withdrawn at once; the kubelet's
PodResources API says which pods still hold its devices, reported as `held`
with their names until none does, then `unbound` (AllocationReleased).
`watch_holds` looks every second while such a binding waits.

What to advertise is a pure function of the wanted bindings and the
inventory (`advertised_devices`); `KubernetesBindings.reconcile` applies it
(starting and stopping plugins) and says which reports are due.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import structlog

from agent.bindspec import BindError, _find_unit, device_paths
from agent.checkpoint import BindingEntry
from agent.kubelet.plugin import DevicePlugin, KubeletError, PluginDevice
from agent.kubelet.podresources import PodDevices, list_pod_devices, pod_resources_socket
from common.inventory import Inventory
from common.nodewire import Binding, Report

log = structlog.get_logger("berth.agent.kubernetes")

DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
REGISTER_GRACE_S = 30.0  # a plugin the kubelet has not accepted by then: the binding is reported failed
EVICTION_RETRY_S = 5.0  # an eviction a disruption budget refused (or that failed) is tried again after this, as
# `kubectl drain` does


def plugin_devices(binding: Binding, inv: Inventory) -> list[PluginDevice]:
    """The binding's units as the kubelet sees them: GPU or MIG UUIDs with their device nodes; BindError if a unit
    is not on this host."""
    out = []
    for unit in binding.units:
        gpu, mig = _find_unit(inv, unit)
        if mig is not None:
            if mig.capMinors.gi is None or mig.capMinors.ci is None:
                raise BindError(f"unit {unit.unit}: no nvidia-caps minors for {mig.uuid}; cannot pass its cap devices")
            nodes = device_paths([gpu.minor], [mig.capMinors.gi, mig.capMinors.ci])
            out.append(PluginDevice(mig.uuid, gpu.health.healthy and mig.health.healthy, gpu.numaNode, nodes,
                                    mig.uuid))
        else:
            out.append(PluginDevice(gpu.uuid, gpu.health.healthy, gpu.numaNode, device_paths([gpu.minor], []),
                                    gpu.uuid))
    return out


def holders_of(binding: Binding, pods: Iterable[PodDevices]) -> list[str]:
    """The pods (namespace/name) holding any of the binding's devices, as the kubelet's PodResources says."""
    ids = {u.uuid for u in binding.units}
    return sorted({f"{p.namespace}/{p.name}" for p in pods
                   if p.resource_name == binding.resourceName and ids.intersection(p.device_ids)})


def waiting_message(pods: list[str], why: dict[str, str]) -> str:
    """Why a booking that has started waits: the pods of an ended booking still holding its devices, each with
    why it is still there (as the last eviction found; nothing known yet: being evicted)."""
    named = [f"{pod}: {why.get(pod, 'being evicted')}." for pod in pods[:20]]
    more = [f"And {len(pods) - 20} more."] if len(pods) > 20 else []
    return " ".join(["Pods of an ended booking still hold the devices; they are bound once the pods are gone.",
                     *named, *more])[:2000]


def advertised_devices(bindings: Iterable[Binding], inv: Inventory) -> tuple[dict[str, list[PluginDevice]],
                                                                             dict[str, str]]:
    """(resource name -> devices to advertise, reservation id -> why it cannot be made) for the active kubernetes
    bindings; a unit claimed twice is refused for the later binding."""
    by_resource: dict[str, list[PluginDevice]] = {}
    refused: dict[str, str] = {}
    seen: dict[str, str] = {}
    for b in bindings:
        if not b.resourceName:
            refused[b.reservationId] = "the binding names no resourceName (the pool's policy.kubernetes)"
            continue
        try:
            devices = plugin_devices(b, inv)
        except BindError as exc:
            refused[b.reservationId] = str(exc)
            continue
        taken = [d.id for d in devices if d.id in seen]
        if taken:
            refused[b.reservationId] = f"device(s) {', '.join(taken)} are already advertised for {seen[taken[0]]}"
            continue
        for d in devices:
            seen[d.id] = b.reservationId
        by_resource.setdefault(b.resourceName, []).extend(devices)
    return by_resource, refused


@dataclass
class _Plugin:
    plugin: DevicePlugin
    watcher: asyncio.Task | None = None
    started: float = field(default_factory=time.monotonic)


class KubernetesBindings:
    """The device plugins of this node, the state of each kubernetes binding, and the node's side of the release
    hold (the stuck taint, evictions for a booking that takes held devices)."""

    def __init__(self, kubelet_root: Path = DEFAULT_KUBELET_ROOT, *, poll_s: float = 0.25,
                 on_change: Callable[[], None] = lambda: None, kubeconfig: str | None = None,
                 node_name: str | None = None, api: Callable[[str], tuple] | None = None) -> None:
        self.kubelet_root = Path(kubelet_root)
        self.poll_s = poll_s
        self.on_change = on_change  # reconcile again: a plugin (re)registered, or the pods holding devices changed
        self.kubeconfig = kubeconfig
        self.node_name = node_name  # the Kubernetes Node of this host (default: the inventory's hostname)
        self._make_api = api or self._api_of
        self._api: tuple | None = None  # (NodeTaints, PodEvictions), made when first needed
        self.api_error: str | None = None
        self.plugins: dict[str, _Plugin] = {}
        self.start_errors: dict[str, str] = {}  # resource name -> why its device plugin could not start
        self.states: dict[str, dict] = {}  # reservation id -> what /status shows
        self.reported: dict[str, str] = {}  # reservation id -> the tag of the last report
        self.let_go: list[str] = []  # released bindings reported unbound (AllocationReleased) by the last pass
        self.blocked: dict[str, list[str]] = {}  # new binding -> pods of an ended one still holding its devices
        self.holder_view: dict[str, tuple[str, ...]] = {}  # released or blocked binding -> its holders, last seen
        self.recent: dict[str, frozenset[str]] = {}  # kubernetes bindings seen lately -> their device ids
        self.tainted: bool | None = None  # the stuck taint as last written (None: not known)
        self._last_pods: list[PodDevices] | None = []
        self._advertised_states: dict[str, dict] = {}
        self._hostname = ""
        self._pods_error: str | None = None
        self._evicted_for: dict[str, set[str]] = {}  # ended binding -> the pods in a new booking's way
        self._evicted: set[str] = set()  # of those, the pods the Kubernetes API evicted (others left by themselves)
        self._said: set[tuple[str, str]] = set()  # (pod, why it stays in the way) already logged
        self._why: dict[str, str] = {}  # pod in a new booking's way -> why it is still there, as last tried
        self._retry_at: float | None = None  # when to try the refused evictions again (monotonic)
        # The control plane takes `waiting` reports (its heartbeat answer says so: one of an older release would
        # refuse the whole batch they ride in).
        self.report_waiting = False
        self.log = log

    async def reconcile(self, bindings: list[Binding], inv: Inventory, fresh: Iterable[Binding] = ()) -> list[Report]:
        """One pass over the node's kubernetes bindings; the reports now due.

        Active ones are advertised (bound once the kubelet accepted the plugin); released ones report the pods
        that still hold their devices (held) or that none does (unbound: AllocationReleased). A binding not yet
        bound here (any kind, `fresh` for the others) whose devices pods of an ended binding still hold is
        `blocked`: those pods are evicted first, the blocked binding is reported `waiting` with them and why they
        stay, and the ended binding is told which were evicted. The stuck taint follows whether any released
        binding is carried on past its window."""
        released = [b for b in bindings if b.released]
        active = [b for b in bindings if not b.released]
        for b in bindings:
            self._remember(b)
        self._hostname = inv.hostname
        new = [b for b in active if self.states.get(b.reservationId, {}).get("state") != "bound"] + list(fresh)
        # Only a Kubernetes node has pods to ask about (a plain host has no pod-resources socket).
        kubelet_here = bool(released) or pod_resources_socket(self.kubelet_root).exists()
        pods = await self._pods() if kubelet_here and (released or new) else []
        reports: list[Report] = []
        if pods is not None:
            reports += await self._evict_for(new, pods, {b.reservationId for b in bindings})
        advertise = [b for b in active if b.reservationId not in self.blocked]
        reports += await self._advertise(advertise, inv)
        states = {**self._advertised_states}
        for rid in self.blocked:
            if rid in {b.reservationId for b in active}:
                states[rid] = {"state": "evicting", "kind": "kubernetes", "holders": self.blocked[rid]}
        self.let_go = []
        for b in released:
            rid = b.reservationId
            if pods is None:  # the kubelet cannot say: nothing is reported until it can
                states[rid] = {"state": "held", "kind": "kubernetes", "holders": None}
                continue
            holders = holders_of(b, pods)
            if holders:
                states[rid] = {"state": "held", "kind": "kubernetes", "holders": holders}
                reports += self._once(rid, Report(rid, "held", holders=tuple(holders[:256])),
                                      f"held:{','.join(holders)}")
            else:
                states[rid] = {"state": "released", "kind": "kubernetes"}
                reports += self._once(rid, Report(rid, "unbound"), "unbound")  # AllocationReleased
                self.let_go.append(rid)
        self.holder_view = self._view(released, new, pods)
        await self._taint(any(b.stuck for b in released), inv)
        for rid in [r for r in self.reported if r not in states and r not in self._evicted_for
                    and r not in self.blocked]:
            self.reported.pop(rid)  # withdrawn: the checkpoint's entry goes, and its unbound report with it
        self.states = states
        return reports

    async def _advertise(self, active: list[Binding], inv: Inventory) -> list[Report]:
        by_resource, refused = advertised_devices(active, inv)
        for name, devices in by_resource.items():
            await self._ensure(name)
            if name in self.plugins:
                self.plugins[name].plugin.set_devices(devices)
        for name in [n for n in self.plugins if n not in by_resource]:
            entry = self.plugins.pop(name)
            entry.plugin.set_devices([])  # withdraw first: the kubelet's stream hears it before the socket goes
            await self._stop(entry)
        reports: list[Report] = []
        states: dict[str, dict] = {}
        for b in active:
            rid = b.reservationId
            if rid in refused:
                states[rid] = {"state": "failed", "kind": "kubernetes", "message": refused[rid]}
                reports += self._once(rid, Report(rid, "failed", message=refused[rid]), f"failed:{refused[rid]}")
                continue
            entry = self.plugins.get(b.resourceName)
            ids = [u.uuid for u in b.units]
            if entry is not None and entry.plugin.registered.is_set():
                states[rid] = {"state": "bound", "kind": "kubernetes", "resourceName": b.resourceName,
                               "devices": ids}
                if b.awaitingBound:  # the control plane never heard it (a report lost, a restore): tell it again
                    self.reported.pop(rid, None)
                reports += self._once(rid, Report(rid, "bound", devices=tuple(_paths(entry.plugin, ids)), end=b.end),
                                      f"bound:{b.resourceName}:{','.join(ids)}:{b.end}")
            elif entry is None and b.resourceName in self.start_errors:
                why = f"the device plugin for {b.resourceName} cannot start: {self.start_errors[b.resourceName]}"
                states[rid] = {"state": "failed", "kind": "kubernetes", "message": why}
                reports += self._once(rid, Report(rid, "failed", message=why[:1900]), f"failed:{why}")
            elif entry is not None and time.monotonic() - entry.started > REGISTER_GRACE_S:
                why = (f"the kubelet has not accepted the device plugin for {b.resourceName}: "
                       f"{entry.plugin.last_error or 'no kubelet socket at ' + str(entry.plugin.kubelet_socket)}; "
                       "is the kubelet running on this node, with its root at the agent's --kubelet-root?")
                states[rid] = {"state": "failed", "kind": "kubernetes", "message": why}
                reports += self._once(rid, Report(rid, "failed", message=why[:1900]), f"failed:{why}")
            else:
                why = entry.plugin.last_error if entry is not None else None
                states[rid] = {"state": "binding", "kind": "kubernetes", "resourceName": b.resourceName,
                               "waiting": why or "for the kubelet to accept the device plugin"}
        self._advertised_states = states
        return reports

    async def _evict_for(self, new: list[Binding], pods: list[PodDevices], wanted: set[str]) -> list[Report]:
        """Pods holding devices of a binding not yet bound here belong to an ended binding: evict them, and tell
        that ended binding (unbound, with the pods) once they are gone."""
        self.blocked = {}
        holding: dict[str, set[str]] = {}  # pod -> device ids
        for p in pods:
            holding.setdefault(f"{p.namespace}/{p.name}", set()).update(p.device_ids)
        reports: list[Report] = []
        for b in new:
            ids = {u.uuid for u in b.units}
            in_the_way = sorted(pod for pod, held in holding.items() if ids & held)
            if not in_the_way:
                continue
            self.blocked[b.reservationId] = in_the_way
            for pod in in_the_way:
                if await self._evict(pod):
                    self._evicted.add(pod)
                for old, old_ids in self.recent.items():
                    if old not in wanted and old_ids & holding[pod]:
                        self._evicted_for.setdefault(old, set()).add(pod)
            if self.report_waiting:
                why = waiting_message(in_the_way, self._why)
                reports += self._once(b.reservationId, Report(b.reservationId, "waiting",
                                                              holders=tuple(in_the_way[:256]), message=why),
                                      f"waiting:{why}")
        self._why = {pod: why for pod, why in self._why.items() if pod in holding}
        if not self.blocked:
            self._retry_at = None
        for old, evicted in list(self._evicted_for.items()):
            still = [pod for pod in evicted if pod in holding and holding[pod] & self.recent.get(old, frozenset())]
            if not still:  # gone: the ended binding hears which pods were evicted to make room (none: they left)
                named = tuple(sorted(pod for pod in evicted if pod in self._evicted))
                self._evicted -= evicted
                reports += self._once(old, Report(old, "unbound", evicted=named[:256]), f"evicted:{','.join(named)}")
                del self._evicted_for[old]
        return reports

    async def _evict(self, pod: str) -> bool:
        """Whether the Kubernetes API evicted the pod (no API, a failure, a disruption budget: not, this time);
        `_why` keeps why it is still there."""
        namespace, name = pod.split("/", 1)
        api = self._apis()
        if api is None:
            self._in_the_way(pod, "the agent has no Kubernetes API access to evict it (--kubeconfig, or the "
                                  "in-cluster service account)")
            return False
        try:
            outcome = await api[1].evict_async(namespace, name)
        except KubeletError as exc:
            why = f"its eviction failed ({exc}); retried"
            if self._why.get(pod) != why:
                self.log.error("eviction failed", pod=pod, error=str(exc))
            self._why[pod] = why
            self._retry_later()
            return False
        if outcome == "evicted":
            if pod not in self._evicted:
                self.log.warning("pod evicted: it held devices a new booking takes", pod=pod)
            self._why[pod] = "evicted, stopping"
        elif outcome == "blocked":
            self._in_the_way(pod, "its disruption budget does not allow an eviction now; retried until it does")
            self._retry_later()
        return outcome == "evicted"

    def _retry_later(self) -> None:
        """The refused evictions are tried again EVICTION_RETRY_S after the first refusal (watch_holds)."""
        self._retry_at = self._retry_at or time.monotonic() + EVICTION_RETRY_S

    def _in_the_way(self, pod: str, why: str) -> None:
        """Say once, for the operator, why a pod still holds devices a booking has started on."""
        self._why[pod] = why
        if (pod, why) not in self._said:
            self._said.add((pod, why))
            self.log.warning("pod holds devices a booking has started on, and stays: the booking waits until it "
                             "leaves", pod=pod, why=why)

    async def _taint(self, stuck: bool, inv: Inventory) -> None:
        """The node carries the KubernetesReleaseStuck NoSchedule taint exactly while a release is carried on."""
        if stuck == self.tainted or (not stuck and self.tainted is None):
            return
        from agent.kubelet.taint import RELEASE_STUCK_TAINT  # the kubernetes client loads only where it is used

        api = self._apis()
        if api is None:
            return
        try:
            if stuck:
                await api[0].set_async(RELEASE_STUCK_TAINT)
            else:
                await api[0].remove_async(RELEASE_STUCK_TAINT)
        except KubeletError as exc:
            self.log.error("cannot change the node's taint", stuck=stuck, error=str(exc))
            return
        self.tainted = stuck
        self.log.warning("node tainted: a kubernetes release is stuck" if stuck else "node taint removed",
                         taint=f"{RELEASE_STUCK_TAINT}:NoSchedule")

    def _apis(self) -> tuple | None:
        if self._api is None:
            try:
                self._api = self._make_api(self.node_name or self._hostname)
                self.api_error = None
            except KubeletError as exc:
                if self.api_error != str(exc):
                    self.log.error("no Kubernetes API access: the node cannot be tainted or pods evicted",
                                   error=str(exc))
                self.api_error = str(exc)
                return None
        return self._api

    def _api_of(self, node_name: str) -> tuple:
        from agent.kubelet.evict import PodEvictions
        from agent.kubelet.taint import NodeTaints  # the kubernetes client loads only where it is used

        return (NodeTaints(node_name, kubeconfig=self.kubeconfig), PodEvictions(kubeconfig=self.kubeconfig))

    def remember_bound(self, entries: Iterable[BindingEntry]) -> None:
        """At start: the kubernetes bindings the checkpoint has as bound, with their device ids, so that pods of
        one that ended while this agent was away, evicted for a new booking now, are still told to it
        (reservation.pods-evicted)."""
        for entry in entries:
            if entry.kind == "kubernetes" and entry.reservationId not in self.recent:
                self.recent[entry.reservationId] = frozenset(entry.devices)

    def _remember(self, b: Binding) -> None:
        self.recent.pop(b.reservationId, None)
        self.recent[b.reservationId] = frozenset(u.uuid for u in b.units)
        while len(self.recent) > 1000:
            self.recent.pop(next(iter(self.recent)))

    def _view(self, released: list[Binding], new: list[Binding], pods: list[PodDevices] | None) -> dict:
        view: dict[str, tuple[str, ...]] = {b.reservationId: tuple(holders_of(b, pods or ())) for b in released}
        for b in new:
            ids = {u.uuid for u in b.units}
            view[b.reservationId] = tuple(sorted({f"{p.namespace}/{p.name}" for p in pods or ()
                                                  if ids.intersection(p.device_ids)}))
        return view

    async def _pods(self) -> list[PodDevices] | None:
        """Which pods hold which devices, from the kubelet's PodResources; None (said once) when it cannot tell."""
        try:
            self._last_pods = await list_pod_devices(self.kubelet_root)
            self._pods_error = None
        except KubeletError as exc:
            if str(exc) != self._pods_error:
                self.log.warning("cannot read which pods hold devices", error=str(exc))
            self._pods_error = str(exc)
            self._last_pods = None
        return self._last_pods

    async def watch_holds(self, wanted: Callable[[], list[Binding]], every_s: float = 1.0) -> None:
        """While released bindings wait for their pods (or new ones for evicted pods to go), look every `every_s`
        and reconcile when what the kubelet says changed, or when refused evictions are due to be tried again."""
        while True:
            await asyncio.sleep(every_s)
            bindings = wanted()
            released = [b for b in bindings if b.kind == "kubernetes" and b.released]
            waiting = [b for b in bindings if b.reservationId in self.blocked]
            if not released and not waiting:
                continue
            if waiting and self._retry_at is not None and time.monotonic() >= self._retry_at:
                self._retry_at = None
                self.on_change()
                continue
            try:
                pods = await self._pods()
                if pods is not None and self._view(released, waiting, pods) != self.holder_view:
                    self.on_change()
            except Exception as exc:  # keep watching
                self.log.error("hold watch failed", error=str(exc))

    def bound_entries(self, bindings: list[Binding]) -> list[BindingEntry]:
        """Checkpoint entries of the bindings bound now (so a restarted agent still reports their unbinding)."""
        by_id = {b.reservationId: b for b in bindings}
        return [BindingEntry(reservationId=rid, state="completed", spec=s["resourceName"], cgroup="",
                             kind="kubernetes", tenantId=by_id[rid].tenantId, principalId=by_id[rid].principalId,
                             devices=list(s["devices"]), updatedAtMs=int(time.time() * 1000))
                for rid, s in self.states.items() if s["state"] == "bound" and rid in by_id]

    def pending_registration(self) -> bool:
        """Whether a binding waits for a plugin's registration (the caller reconciles again soon)."""
        return any(s["state"] == "binding" for s in self.states.values())

    async def _ensure(self, name: str) -> None:
        if name in self.plugins:
            return
        try:
            plugin = DevicePlugin(name, self.kubelet_root, poll_s=self.poll_s)
            await plugin.start()
        except KubeletError as exc:
            self.log.error("device plugin cannot start", resource_name=name, error=str(exc))
            self.start_errors[name] = str(exc)  # its bookings fail with it (BindFailed), the agent goes on
            return
        self.start_errors.pop(name, None)
        entry = self.plugins[name] = _Plugin(plugin)
        entry.watcher = asyncio.ensure_future(self._watch(plugin))

    async def _watch(self, plugin: DevicePlugin) -> None:
        seen = plugin.registrations
        while True:
            await asyncio.sleep(self.poll_s)
            if plugin.registrations != seen and plugin.registered.is_set():
                seen = plugin.registrations
                self.on_change()

    async def _stop(self, entry: _Plugin) -> None:
        if entry.watcher is not None:
            entry.watcher.cancel()
            await asyncio.gather(entry.watcher, return_exceptions=True)
        await entry.plugin.stop()

    def _once(self, rid: str, report: Report, tag: str) -> list[Report]:
        if self.reported.get(rid) == tag:
            return []
        self.reported[rid] = tag
        return [report]

    def forget_reports(self) -> None:
        self.reported = {rid: "" for rid in self.reported}

    async def stop(self) -> None:
        """Stop serving (the kubelet sees the resources go); the control plane still wants what it wants."""
        for entry in self.plugins.values():
            await self._stop(entry)
        self.plugins.clear()

    async def wait_registered(self, timeout_s: float) -> None:
        """Until every plugin is registered or timeout_s passes."""
        waits = [asyncio.ensure_future(p.plugin.registered.wait()) for p in self.plugins.values()]
        if waits:
            await asyncio.wait(waits, timeout=timeout_s)
            for w in waits:
                w.cancel()


def _paths(plugin: DevicePlugin, ids: list[str]) -> list[str]:
    """The device nodes the kubelet hands a container for these ids (each once, in order)."""
    by_id = {d.id: d for d in plugin.devices}
    out: list[str] = []
    for i in ids:
        for node in by_id[i].device_nodes if i in by_id else ():
            if node not in out:
                out.append(node)
    return out
