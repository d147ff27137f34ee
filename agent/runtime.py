"""The node agent at run time: discover, register, heartbeat, watch, bind, report; recover after any crash.

`Agent(config).run(stop)` is the whole life of `berth agent`:

1. take the state directory's lock (agent/checkpoint.py) and settle where the
   agent and its workloads live (agent/delegation.py: leave the delegated
   cgroup for a leaf, or start the workloads scope under systemd);
2. probe which controllers the host offers (agent/controllers.py) and say at
   once which are missing and what host setting would add them;
3. load the checkpoint (void after a reboot), list the cgroups already there,
   discover the host (agent/discovery.py, `--simulate` or NVML) and keep
   re-discovering on a timer;
4. tell systemd READY=1 and ping its watchdog;
5. register (or reuse the stored node token), heartbeat on the interval the
   control plane gave, and long-poll the watch with the last resource
   version, reconnecting with backoff; every answer is the complete wanted
   set, so each one is reconciled (agent/binder.py: plan, then apply on the
   cgroup subtree) and the reports go out (kept in the checkpoint until the
   control plane accepts them);
6. the first watch answer is the start-up pass: what is wanted is adopted
   unchanged (same cgroup, same device program), what nobody wants any more
   is killed and removed. Before that answer nothing is removed: an agent
   that cannot reach its control plane kills nothing.

Between watch answers the last wanted set is reconciled again on a timer: a
limit or device program changed behind the agent's back is repaired.
Stopping (SIGTERM) leaves every workload running.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

from agent import controllers as ctl
from agent import delegation
from agent.binder import Binder, Have, Outcome, Refused, plan
from agent.bindspec import BindError, HostView, Want, refusal, simulated_devices_proc, want_of
from agent.checkpoint import Checkpoint, Identity, StateDir, read_boot_id
from agent.discovery import Discovery, Rediscovery, Reserve
from agent.errors import AgentError
from common import hostfacts
from common.hostfacts import HostReadError
from agent.execgate import ExecGate, ExecPolicy, Target
from common.inventory import Inventory
from agent.metrics import AgentMetrics, metrics_app
from agent.nodeclient import NodeApiError, NodeClient, Unauthorized, Unreachable
from common.nodewire import Binding, Report
from agent.sdnotify import Notifier
from cgroups import Subtree, read_proc_devices
from cgroups.errors import CgroupError

log = structlog.get_logger("berth.agent")

try:
    from importlib.metadata import version as _version

    AGENT_VERSION = _version("berth")
except Exception:  # pragma: no cover - not installed
    AGENT_VERSION = "0.1.0"


@dataclass
class AgentConfig:
    control_plane: str
    bootstrap_token: str
    state_dir: Path
    cgroup_root: str | None = None
    cgroup_enable_from: str | None = None
    simulate: str | None = None
    metrics_listen: str | None = None
    nvml_library: str | None = None
    reserve: Reserve = field(default_factory=Reserve)
    device_classes: object | None = None
    exec_policy: ExecPolicy = field(default_factory=ExecPolicy)
    watch_timeout_ms: int = 25_000
    heartbeat_s: float | None = None  # None: what the control plane says at register
    rediscover_s: float = 60.0
    reconcile_s: float = 30.0  # re-check (drift repair) the last wanted set this often
    backoff_min_s: float = 0.2
    backoff_max_s: float = 10.0
    request_timeout_s: float = 10.0
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")


def heartbeat_interval(heartbeat_s: float | None, grace_s: float | None) -> float:
    """The control plane's interval, but at least three heartbeats per grace period (one lost packet, or a
    slow one, must not make the node lost)."""
    out = heartbeat_s or 5.0
    if grace_s:
        out = min(out, grace_s / 3)
    return max(0.05, out)


REPORT_BATCH = 500  # the node API takes at most 1000 reports per call


class Backoff:
    """Exponential backoff with jitter: min_s, 2 min_s, ... up to max_s, each scaled by a random [0.5, 1)."""

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s, self.n = min_s, max_s, 0

    def next(self) -> float:
        delay = min(self.max_s, self.min_s * (2 ** self.n))
        self.n += 1
        return delay * (0.5 + random.random() / 2)

    def reset(self) -> None:
        self.n = 0


class Agent:
    def __init__(self, config: AgentConfig, *, notifier: Notifier | None = None,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.config = config
        self.notifier = notifier or Notifier.from_env()
        self.wall_ms = wall_ms
        self.metrics = AgentMetrics()
        self.log = log
        self.state = StateDir(config.state_dir)
        self.client = NodeClient(config.control_plane, timeout_s=config.request_timeout_s)
        self.identity: Identity | None = None
        self.layout: delegation.Layout | None = None
        self.probe: ctl.ControllerProbe | None = None
        self.subtree: Subtree | None = None
        self.checkpoint: Checkpoint | None = None
        self.binder: Binder | None = None
        self.inventory: Inventory | None = None
        self.inventory_dirty = True  # send the inventory with the next heartbeat
        self.host_view: HostView | None = None
        self.heartbeat_s = 5.0
        self.resource_version = 0
        self.wanted: list[Binding] | None = None  # the last complete wanted set; None before the first answer
        self.binding_states: dict[str, dict] = {}
        self.started_at = time.monotonic()
        self._bind_lock = asyncio.Lock()
        self._register_lock = asyncio.Lock()
        self._reports_wake = asyncio.Event()
        self._registered = asyncio.Event()
        self._rediscovery: Rediscovery | None = None
        self._watcher = None
        self._exec_gate: ExecGate | None = None
        self._metrics_runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Future] = []

    # -- start-up -------------------------------------------------------------

    def prepare(self) -> None:
        """Everything before the network: lock, layout, controllers, subtree, checkpoint, first discovery."""
        cfg = self.config
        self.state.open()
        self.identity = self.state.read_identity()
        if self.identity is not None and self.identity.controlPlane != cfg.control_plane:
            log.warning("stored node identity is for another control plane; registering anew",
                        stored=self.identity.controlPlane, now=cfg.control_plane)
            self.identity = None
        if self.identity is not None:
            self._bind_node(self.identity.nodeId)
            self.client.token = self.identity.nodeToken
            self.heartbeat_s = cfg.heartbeat_s or self.identity.heartbeatSeconds
        self.layout = delegation.resolve(cfg.cgroup_root, cfg.cgroup_enable_from, proc=cfg.proc)
        if delegation.ensure_scope(self.layout):
            self.log.info("started the workloads scope", scope=str(self.layout.scope))
        moved = delegation.enter_leaf(self.layout)
        if moved:
            self.log.info("agent moved into its leaf cgroup", leaf=str(self.layout.leaf), pids=moved)
        top = self.layout.enable_from or self.layout.root
        self.probe = ctl.probe(top, proc=cfg.proc)
        self.metrics.controllers_enforced = self.probe.enforced
        self.metrics.controllers_missing = tuple(self.probe.missing)
        if self.probe.missing:
            self.log.warning("cgroup controllers missing: shares asking for them are reported as not enforced",
                        enforced=list(self.probe.enforced), missing=list(self.probe.missing),
                        hints=self.probe.missing)
        else:
            self.log.info("cgroup controllers", enforced=list(self.probe.enforced))
        self.subtree = Subtree(self.layout.root, controllers=self.probe.enforced,
                               enable_from=self.layout.enable_from, proc=cfg.proc, sys=cfg.sys)
        self.subtree.prepare()
        self.checkpoint = self.state.load_checkpoint(boot_id=read_boot_id(cfg.proc), cgroup_root=str(self.layout.root))
        self.log.info("checkpoint", note=self.checkpoint.note)
        self.binder = Binder(self.subtree, self.checkpoint, wall_ms=self.wall_ms)
        self.binder.log = self.log
        found = self.binder.actual()
        self.log.info("cgroups found at start", count=len(found), reservations=sorted(found)[:50],
                      without_record=sorted(r for r, h in found.items() if h.share is None) or None)
        self._build_discovery()
        self.refresh_inventory()

    def _bind_node(self, node_id: str) -> None:
        self.log = log.bind(node_id=node_id)
        for part in (self.binder, self._exec_gate):
            if part is not None:
                part.log = self.log

    def _build_discovery(self) -> None:
        cfg = self.config
        from agent.host import KernelHost

        kernel = KernelHost(sys_root=str(cfg.sys), proc_root=str(cfg.proc))
        kwargs = {"reserve": cfg.reserve}
        if cfg.device_classes is not None:
            kwargs["device_classes"] = cfg.device_classes
        if cfg.simulate:
            from agent.simulate import SimulatedGpus, SimulatedHost

            gpus = SimulatedGpus(cfg.simulate)
            self._sim_gpus = gpus
            host = SimulatedHost(gpus, fallback=kernel)
        else:
            from agent.health import HealthPolicy
            from agent.nvml import NvmlGpus

            self._health = HealthPolicy()
            kwargs["health"] = self._health
            gpus = NvmlGpus(library=cfg.nvml_library, sys_root=str(cfg.sys), proc_root=str(cfg.proc))
            host = kernel
        discovery = Discovery(gpus=gpus, host=host, **kwargs)
        self._rediscovery = Rediscovery(discovery.discover, interval_s=cfg.rediscover_s,
                                        on_change=self._on_inventory_change)

    def refresh_inventory(self) -> None:
        assert self._rediscovery is not None
        self._rediscovery.refresh()  # the first discovery always reaches _on_inventory_change

    def _on_inventory_change(self, change, inventory: Inventory) -> None:
        """Called on the re-discovery thread (or the caller's, for the first one, which is taken at once)."""
        if self.inventory is not None and self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._set_inventory, inventory)
        else:
            self._set_inventory(inventory)

    def _set_inventory(self, inventory: Inventory) -> None:
        first = self.inventory is None
        self.inventory = inventory
        self.inventory_dirty = True
        self.host_view = self._host_view(inventory)
        if not first:
            self.log.info("inventory changed; re-checking bindings")
            if self.wanted is not None and self._loop is not None:
                asyncio.ensure_future(self.reconcile(self.wanted, time.monotonic(), why="inventory changed"))

    def _host_view(self, inventory: Inventory) -> HostView:
        cfg = self.config
        assert self.probe is not None
        sim_cpus = sim_mem = False
        devices_proc = cfg.proc
        if cfg.simulate:
            top = self._sim_gpus.topology()
            sim_cpus = top.host is not None and top.host.cpus is not None
            sim_mem = top.host is not None and top.host.memoryGiB is not None
            if "nvidia-uvm" not in read_proc_devices(cfg.proc):
                devices_proc = simulated_devices_proc(cfg.proc, self.config.state_dir / "simulate" / "proc")
        return HostView(inventory=inventory, enforced=frozenset(self.probe.enforced), devices_proc=devices_proc,
                        simulated_cpus=sim_cpus, simulated_memory=sim_mem,
                        real_cpus=len(hostfacts.online_cpus(str(cfg.sys))),
                        real_memory_bytes=hostfacts.read_meminfo(str(cfg.proc)).total_kib * 1024)

    # -- the control plane ----------------------------------------------------

    async def register(self) -> None:
        """Register with the bootstrap token (retrying with backoff until it works or the agent stops)."""
        async with self._register_lock:
            backoff = Backoff(self.config.backoff_min_s, self.config.backoff_max_s)
            while True:
                inv = self.inventory
                assert inv is not None
                try:
                    ans = await self.client.register(self.config.bootstrap_token, inv.hostname, inv,
                                                     AGENT_VERSION)
                    break
                except (Unreachable, NodeApiError) as exc:
                    level = "error" if isinstance(exc, Unauthorized) else "warning"
                    getattr(self.log, level)("register failed; retrying", error=str(exc))
                    await asyncio.sleep(backoff.next())
            self.identity = Identity(nodeId=ans.nodeId, nodeToken=ans.nodeToken, controlPlane=self.config.control_plane,
                                     poolId=ans.poolId, hostname=inv.hostname, registeredAtMs=self.wall_ms(),
                                     heartbeatSeconds=heartbeat_interval(ans.heartbeatSeconds, ans.graceSeconds))
            self.state.write_identity(self.identity)
            self.heartbeat_s = self.config.heartbeat_s or heartbeat_interval(ans.heartbeatSeconds, ans.graceSeconds)
            self.inventory_dirty = False  # register carried it
            self._bind_node(ans.nodeId)
            assert self.checkpoint is not None and self.binder is not None
            self.checkpoint.set_node(ans.nodeId)
            self.binder.forget_reports()  # a fresh registration: tell the control plane everything again
            self.log.info("registered", pool_id=ans.poolId, heartbeat_s=self.heartbeat_s, grace_s=ans.graceSeconds,
                          resource_version=ans.resourceVersion)
            self._registered.set()

    async def _reregister(self, token_used: str | None) -> None:
        if self.client.token != token_used:
            return  # someone else registered meanwhile
        self.log.warning("node token refused; registering again")
        await self.register()

    async def watch_loop(self) -> None:
        if self.client.token is None:
            await self.register()
        backoff = Backoff(self.config.backoff_min_s, self.config.backoff_max_s)
        rv = 0  # at start: the complete wanted set at once, for the start-up pass
        while True:
            token = self.client.token
            try:
                ans = await self.client.watch(rv, self.config.watch_timeout_ms)
            except Unauthorized:
                await self._reregister(token)
                rv = 0
                continue
            except (Unreachable, NodeApiError) as exc:
                self.metrics.watch_reconnects += 1
                delay = backoff.next()
                self.log.warning("watch failed; reconnecting", error=str(exc), retry_in_s=round(delay, 3),
                                 resource_version=rv)
                await asyncio.sleep(delay)
                continue
            seen = time.monotonic()
            if backoff.n:
                self.log.info("watch resumed", resource_version=rv, now=ans.resourceVersion)
            backoff.reset()
            if ans.changed or self.wanted is None or ans.resourceVersion != rv:
                await self.reconcile(ans.bindings, seen, resource_version=ans.resourceVersion,
                                     why="start-up pass" if self.wanted is None else "watch")
            rv = ans.resourceVersion

    async def heartbeat_loop(self) -> None:
        if self.client.token is None:
            await self._registered.wait()
        while True:
            token = self.client.token
            inv = self.inventory
            assert inv is not None
            send_inv = inv if self.inventory_dirty else None
            try:
                await self.client.heartbeat(send_inv)
                self.metrics.heartbeats_ok += 1
                self.metrics.last_heartbeat = time.monotonic()
                if send_inv is not None and self.inventory is inv:
                    self.inventory_dirty = False
            except Unauthorized:
                self.metrics.heartbeat_failures += 1
                await self._reregister(token)
                continue
            except (Unreachable, NodeApiError) as exc:
                self.metrics.heartbeat_failures += 1
                self.log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(self.heartbeat_s)

    async def report_loop(self) -> None:
        backoff = Backoff(self.config.backoff_min_s, self.config.backoff_max_s)
        while True:
            await self._reports_wake.wait()
            self._reports_wake.clear()
            assert self.checkpoint is not None
            pending = list(self.checkpoint.data.pendingReports)
            self.metrics.reports_pending = len(pending)
            if not pending or self.client.token is None:
                continue
            token = self.client.token
            pending = pending[:REPORT_BATCH]
            try:
                ans = await self.client.report(pending)
            except Unauthorized:
                await self._reregister(token)
                self._reports_wake.set()
                continue
            except (Unreachable, NodeApiError) as exc:
                if isinstance(exc, NodeApiError) and exc.status in (400, 404, 413, 422):
                    # the control plane will never take these as they are: say so once, do not loop on them
                    self.log.error("reports refused by the control plane; dropped", error=str(exc),
                                   reservations=[r.reservationId for r in pending])
                    ans = None
                else:
                    delay = backoff.next()
                    self.log.warning("report failed; retrying", error=str(exc), pending=len(pending),
                                     retry_in_s=round(delay, 3))
                    await asyncio.sleep(delay)
                    self._reports_wake.set()
                    continue
            backoff.reset()
            for ig in (ans.ignored if ans is not None else []):
                self.log.warning("report ignored by the control plane", reservation_id=ig.reservationId,
                                 reason=ig.reason)
            async with self._bind_lock:
                # accepted or ignored, the control plane has its answer; a report queued meanwhile stays
                self.checkpoint.data.pendingReports = [r for r in self.checkpoint.data.pendingReports
                                                       if r not in pending]
                await asyncio.to_thread(self.checkpoint.save)
                self.metrics.reports_pending = len(self.checkpoint.data.pendingReports)
            if self.checkpoint.data.pendingReports:
                self._reports_wake.set()

    # -- binding --------------------------------------------------------------

    def _desired(self, bindings: list[Binding]) -> dict[str, Want | BindError | Refused]:
        assert self.host_view is not None
        out: dict[str, Want | BindError | Refused] = {}
        for b in bindings:
            why = refusal(b)
            if why:
                out[b.reservationId] = Refused(why)
                continue
            try:
                out[b.reservationId] = want_of(b, self.host_view)
            except BindError as exc:
                out[b.reservationId] = exc
        return out

    async def reconcile(self, bindings: list[Binding], seen: float, *, resource_version: int | None = None,
                        why: str = "") -> list[Outcome]:
        async with self._bind_lock:
            assert self.binder is not None and self.checkpoint is not None
            first = self.wanted is None
            self.wanted = list(bindings)
            desired = self._desired(bindings)
            actual: dict[str, Have] = await asyncio.to_thread(self.binder.actual)
            actions = plan(desired, actual)
            if resource_version is not None:
                self.resource_version = resource_version
                self.checkpoint.set_version(resource_version)
                self.metrics.resource_version = resource_version
            for rid in [r for r in self.checkpoint.bindings if r not in desired and r not in actual]:
                entry = self.checkpoint.bindings[rid]
                self.checkpoint.forget(rid)
                if entry.state in ("completed", "removing"):
                    self.checkpoint.queue_report(Report(rid, "unbound"))
            outcomes = await asyncio.to_thread(self.binder.run, actions)
            for o in outcomes:
                if o.action.kind in ("create", "update") and o.ok:
                    self.metrics.bind_latency.observe(time.monotonic() - seen)
                if o.repaired:
                    self.metrics.drift_repairs += len(o.repaired)
            self._update_states(outcomes)
            if first or any(o.action.kind != "keep" for o in outcomes):
                counts: dict[str, int] = {}
                for o in outcomes:
                    counts[o.action.kind] = counts.get(o.action.kind, 0) + 1
                self.log.info("reconciled", why=why, resource_version=self.resource_version, **counts)
            if self.checkpoint.data.pendingReports:
                self._reports_wake.set()
            return outcomes

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
                states[a.reservation_id] = {"state": "bound", "cgroup": str(self.binder.cgroup_of(a.reservation_id)),
                                            "devices": list(a.want.devices),
                    "unenforced": list(a.want.unenforced)}
                for u in a.want.unenforced:
                    c = u.split(" ", 1)[0]
                    unenforced[c] = unenforced.get(c, 0) + 1
        self.binding_states = states
        counts: dict[str, int] = {}
        for s in states.values():
            counts[s["state"]] = counts.get(s["state"], 0) + 1
        self.metrics.bindings = counts
        self.metrics.unenforced = unenforced

    async def periodic_reconcile(self) -> None:
        while True:
            await asyncio.sleep(self.config.reconcile_s)
            if self.wanted is not None:
                try:
                    await self.reconcile(self.wanted, time.monotonic(), why="periodic check")
                except Exception as exc:  # keep checking; the next pass tries again
                    self.log.error("periodic check failed", error=str(exc))

    async def watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_interval_s
        if not interval:
            await asyncio.Event().wait()  # no watchdog asked for: nothing to do, ever
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    # -- exec -----------------------------------------------------------------

    def _exec_target(self, rid: str) -> Target | None:
        assert self.checkpoint is not None and self.subtree is not None
        entry = self.checkpoint.bindings.get(rid)
        if entry is None or entry.state != "completed":
            return None
        path = self.binder.cgroup_of(rid)
        return Target(entry.tenantId, path.name, path) if path.is_dir() else None

    # -- status ---------------------------------------------------------------

    def status(self) -> dict:
        age = self.metrics.heartbeat_age()
        return {
            "nodeId": self.identity.nodeId if self.identity else None,
            "controlPlane": self.config.control_plane,
            "agentVersion": AGENT_VERSION,
            "layout": self.layout.to_wire() if self.layout else None,
            "controllers": self.probe.to_wire() if self.probe else None,
            "resourceVersion": self.resource_version,
            "heartbeatAgeSeconds": None if age is None else round(age, 3),
            "pendingReports": len(self.checkpoint.data.pendingReports) if self.checkpoint else 0,
            "bindings": self.binding_states,
            "startupPassDone": self.wanted is not None,
            "execPolicy": self.config.exec_policy.to_wire(),
            "uptimeSeconds": round(time.monotonic() - self.started_at, 3),
        }

    # -- the whole life ---------------------------------------------------------

    async def _start_metrics(self) -> None:
        if not self.config.metrics_listen:
            return
        from aiohttp import web

        host, _, port = self.config.metrics_listen.rpartition(":")
        runner = web.AppRunner(metrics_app(self.metrics, self.status), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host or "127.0.0.1", int(port))
        await site.start()
        self._metrics_runner = runner
        addrs = [f"{a[0]}:{a[1]}" for a in runner.addresses]
        self.log.info("metrics listening", address=addrs[0] if addrs else self.config.metrics_listen)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.prepare)
            assert self.subtree is not None
            self._exec_gate = ExecGate(self.state.exec_socket, self.config.exec_policy, self._exec_target,
                                       self.subtree.move, proc=self.config.proc)
            self._exec_gate.log = self.log
            await self._exec_gate.start()
            await self._start_metrics()
            if self.checkpoint and self.checkpoint.data.pendingReports:
                self._reports_wake.set()  # unbound reports from before a crash
            assert self._rediscovery is not None
            self._rediscovery.start()
            self._start_xid_watcher()
            self.notifier.ready(status=self.probe.summary() if self.probe else "ready")
            self.log.info("agent ready", control_plane=self.config.control_plane,
                          cgroup_root=str(self.layout.root if self.layout else ""),
                          state_dir=str(self.config.state_dir), simulate=self.config.simulate)
            self._tasks = [asyncio.ensure_future(c) for c in (
                self.watch_loop(), self.heartbeat_loop(), self.report_loop(), self.periodic_reconcile(),
                self.watchdog_loop())]
            stopper = asyncio.ensure_future(stop.wait())
            self._tasks.append(stopper)
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopper and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            await self.shutdown()

    def _start_xid_watcher(self) -> None:
        if self.config.simulate:
            return
        try:
            from agent.health import XidWatcher
            from agent.nvml import NvmlEvents

            events = NvmlEvents(library=self.config.nvml_library).open()
            self._watcher = XidWatcher(events, self._health, on_change=self._rediscovery.request).start()
        except Exception as exc:  # no driver: nothing to watch
            self.log.info("no XID watcher", reason=str(exc))

    async def shutdown(self) -> None:
        self.notifier.stopping()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._watcher is not None:
            try:
                self._watcher.stop()
            except Exception:
                pass
        if self._rediscovery is not None:
            self._rediscovery.stop(timeout=2)
        if self._exec_gate is not None:
            await self._exec_gate.stop()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        await self.client.close()
        if self.checkpoint is not None:
            try:
                async with self._bind_lock:
                    self.checkpoint.save()
            except OSError:
                pass
        self.state.close()
        self.log.info("agent stopped; workloads keep running", bindings=len(self.binding_states))


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, (AgentError, CgroupError, HostReadError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"

