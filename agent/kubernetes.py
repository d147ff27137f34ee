"""The kubernetes bindings of this node: the kubelet sees exactly the booked devices, and no more.

For each resource name (a pool's `policy.kubernetes.resourceName`) the agent
runs one device plugin (agent/kubelet/plugin.py) that advertises the units of
this node's active kubernetes bindings, each Healthy unless the inventory's
health says otherwise; a device outside every active binding is never
advertised, so the kubelet cannot give it to a pod. A binding is reported
`bound` once its plugin is registered with the kubelet and advertises it.

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
from common.inventory import Inventory
from common.nodewire import Binding, Report

log = structlog.get_logger("berth.agent.kubernetes")

DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
REGISTER_GRACE_S = 30.0  # a plugin the kubelet has not accepted by then: the binding is reported failed


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
    """The device plugins of this node and the state of each kubernetes binding."""

    def __init__(self, kubelet_root: Path = DEFAULT_KUBELET_ROOT, *, poll_s: float = 0.25,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.kubelet_root = Path(kubelet_root)
        self.poll_s = poll_s
        self.on_change = on_change  # a plugin was (re)registered: reconcile again, so its bindings report bound
        self.plugins: dict[str, _Plugin] = {}
        self.states: dict[str, dict] = {}  # reservation id -> what /status shows
        self.reported: dict[str, str] = {}  # reservation id -> the tag of the last report
        self.log = log

    async def reconcile(self, bindings: list[Binding], inv: Inventory) -> list[Report]:
        """Advertise exactly the wanted bindings' devices; the reports now due (bound, failed, unbound)."""
        by_resource, refused = advertised_devices(bindings, inv)
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
        for b in bindings:
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
                reports += self._once(rid, Report(rid, "bound", devices=tuple(_paths(entry.plugin, ids)), end=b.end),
                                      f"bound:{b.resourceName}:{','.join(ids)}:{b.end}")
            elif entry is not None and time.monotonic() - entry.started > REGISTER_GRACE_S:
                why = (f"the kubelet has not accepted the device plugin for {b.resourceName}: "
                       f"{entry.plugin.last_error or 'no kubelet socket at ' + str(entry.plugin.kubelet_socket)}")
                states[rid] = {"state": "failed", "kind": "kubernetes", "message": why}
                reports += self._once(rid, Report(rid, "failed", message=why[:1900]), f"failed:{why}")
            else:
                why = entry.plugin.last_error if entry is not None else None
                states[rid] = {"state": "binding", "kind": "kubernetes", "resourceName": b.resourceName,
                               "waiting": why or "for the kubelet to accept the device plugin"}
        for rid in [r for r in self.reported if r not in states]:
            self.reported.pop(rid)  # withdrawn: the checkpoint's entry goes, and its unbound report with it
        self.states = states
        return reports

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
            return
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
