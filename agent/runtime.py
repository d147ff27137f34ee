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

The parts: agent/link.py (the link to the control plane: register, heartbeat,
watch and report loops with backoff) and agent/controller.py (the binding
controller: desired, plan, binder, states). This module owns the host side
(layout, controllers, subtree, checkpoint, discovery), the exec gate, metrics
and the start and stop of it all.
"""
from __future__ import annotations

import asyncio
import errno
import re
import ssl
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import structlog

from agent import controllers as ctl
from agent import delegation
from agent.binder import Binder
from agent.bindspec import HostView, simulated_devices_proc
from agent.checkpoint import Checkpoint, StateDir, read_boot_id
from agent.controller import BindingController
from agent.discovery import Discovery, Rediscovery, Reserve
from agent.errors import AgentError
from common import hostfacts
from common.hostfacts import HostReadError
from agent.kubernetes import DEFAULT_KUBELET_ROOT, KubernetesBindings
from agent.execgate import ExecGate, ExecPolicy, Target
from common.inventory import Inventory
from agent.metrics import AgentMetrics, metrics_app
from agent.lifetime import Lifetimes
from agent.link import ControlPlaneLink
from agent.nodebinding import NodeBindings, TenantRootConfig
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
    metrics_listen: tuple[str, int] | None = None  # (host, port): common/argtypes.listen
    nvml_library: str | None = None
    reserve: Reserve = field(default_factory=Reserve)
    device_classes: object | None = None
    exec_policy: ExecPolicy = field(default_factory=ExecPolicy)
    watch_timeout_ms: int = 25_000
    heartbeat_s: float | None = None  # None: what the control plane says at register
    health_quiet_s: float | None = None  # a GPU marked unhealthy is healthy again after this long without an event
    rediscover_s: float = 60.0
    reconcile_s: float = 30.0  # re-check (drift repair) the last wanted set this often
    oom_check_s: float = 2.0  # read each bound reservation's OOM kill count this often
    backoff_min_s: float = 0.2
    backoff_max_s: float = 10.0
    request_timeout_s: float = 10.0
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    machine_id_file: Path = Path("/etc/machine-id")
    kubelet_root: Path = DEFAULT_KUBELET_ROOT  # where the kubelet's device-plugins/ and pod-resources/ are
    kubeconfig: str | None = None  # the API server's credentials (None: in-cluster)
    kubernetes_node_name: str | None = None  # this host's Node (None: the hostname)
    ssl_context: ssl.SSLContext | None = None  # https:// to the control plane (common/tls.py); None: system store
    tenant_root: TenantRootConfig | None = None  # node bindings (--ssh-keys-dir ...); None: refused


class Agent:
    def __init__(self, config: AgentConfig, *, notifier: Notifier | None = None,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.config = config
        self.notifier = notifier or Notifier.from_env()
        self.wall_ms = wall_ms
        self.metrics = AgentMetrics()
        self.log = log
        self.state = StateDir(config.state_dir)
        self.layout: delegation.Layout | None = None
        self.probe: ctl.ControllerProbe | None = None
        self.subtree: Subtree | None = None
        self.checkpoint: Checkpoint | None = None
        self.controller: BindingController | None = None
        self.kubernetes: KubernetesBindings | None = None
        self.link: ControlPlaneLink | None = None
        self.inventory: Inventory | None = None
        self.host_view: HostView | None = None
        self.started_at = time.monotonic()
        self._rediscovery: Rediscovery | None = None
        self._watcher = None
        self._root_claim: int | None = None  # the flock on the cgroup root (delegation.claim), held for life
        self._health = None  # agent.health.HealthPolicy: NVML's GPUs only (a simulated host has no XID watcher)
        self._exec_gate: ExecGate | None = None
        self._metrics_runner = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Future] = []
        self._rechecks: set[asyncio.Future] = set()  # passes asked for by a kubelet registration

    # -- start-up -------------------------------------------------------------

    def prepare(self) -> None:
        """Everything before the network: lock, layout, controllers, subtree, checkpoint, first discovery."""
        cfg = self.config
        self.state.open()
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
        self._root_claim = delegation.claim(self.layout.root, cfg.proc)  # before anything there is read or removed
        self.checkpoint = self.state.load_checkpoint(boot_id=read_boot_id(cfg.proc), cgroup_root=str(self.layout.root))
        self.log.info("checkpoint", note=self.checkpoint.note)
        binder = Binder(self.subtree, self.checkpoint, wall_ms=self.wall_ms)
        found = binder.actual()
        self.log.info("cgroups found at start", count=len(found), reservations=sorted(found)[:50],
                      without_record=sorted(r for r, h in found.items() if h.share is None) or None)
        self.kubernetes = KubernetesBindings(cfg.kubelet_root, on_change=self._kubelet_changed, kubeconfig=cfg.kubeconfig,
                                             node_name=cfg.kubernetes_node_name)
        self.kubernetes.remember_bound(self.checkpoint.bindings.values())
        nodes = None
        if cfg.tenant_root is not None:
            reset: Callable[[Inventory], list[str]] | None = None
            if cfg.simulate is None:  # simulated GPUs have no MIG calls, clocks or power limits to put back
                from agent import nvml

                reset = partial(nvml.clean_gpus, cfg.nvml_library)
            nodes = NodeBindings(cfg.state_dir, cfg.tenant_root, inventory=lambda: self.inventory,
                                 rediscover=self._discover_now, sys_root=str(cfg.sys),
                                 simulated_hugepages=cfg.simulate is not None, reset_gpus=reset)
        self.controller = BindingController(binder, self.checkpoint, self.metrics, lambda: self.host_view,
                                            self._reports_queued, kubernetes=self.kubernetes,
                                            lifetimes=Lifetimes(cfg.state_dir), nodes=nodes)
        self.link = ControlPlaneLink(
            cfg.control_plane, cfg.bootstrap_token, self.state, self.checkpoint, self.controller, self.metrics,
            inventory=lambda: self.inventory, agent_version=AGENT_VERSION, wall_ms=self.wall_ms,
            on_node=self._bind_node, heartbeat_s=cfg.heartbeat_s, watch_timeout_ms=cfg.watch_timeout_ms,
            backoff_min_s=cfg.backoff_min_s, backoff_max_s=cfg.backoff_max_s, request_timeout_s=cfg.request_timeout_s,
            machine_id=self._machine_id(), ssl_context=cfg.ssl_context)
        self.link.restore()
        self._build_discovery()
        self.refresh_inventory()

    def _machine_id(self) -> str:
        """This host's machine id (machine-id(5)); "" (and a warning) when it cannot be read: such a node cannot be
        taken over after a loss without an operator's release."""
        path = self.config.machine_id_file
        try:
            text = Path(path).read_text().strip().lower()
        except OSError as exc:
            self.log.warning("no machine id: a lost node needs an operator's release to register again",
                             file=str(path), error=exc.strerror)
            return ""
        if not re.fullmatch(r"[0-9a-f]{32}", text):
            self.log.warning("machine id is not 32 hex digits; not sent", file=str(path))
            return ""
        return text

    def _kubelet_changed(self) -> None:
        """A device plugin was (re)registered with the kubelet, or the pods holding devices changed: reconcile."""
        if self.controller is not None:
            task = asyncio.ensure_future(self.controller.recheck("kubelet registration"))
            self._rechecks.add(task)
            task.add_done_callback(self._rechecks.discard)

    def _reports_queued(self) -> None:
        if self.link is not None:
            self.link.reports_wake.set()

    def _bind_node(self, node_id: str) -> None:
        self.log = log.bind(node_id=node_id)
        for part in (self.controller, self.controller.binder if self.controller else None, self.link,
                     self._exec_gate):
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

            self._health = HealthPolicy(quiet_time_s=cfg.health_quiet_s)
            kwargs["health"] = self._health
            gpus = NvmlGpus(library=cfg.nvml_library, sys_root=str(cfg.sys), proc_root=str(cfg.proc))
            host = kernel
        discovery = Discovery(gpus=gpus, host=host, **kwargs)
        self._rediscovery = Rediscovery(discovery.discover, interval_s=cfg.rediscover_s,
                                        on_change=self._on_inventory_change)

    def _discover_now(self) -> Inventory:
        """Discover the node at once (after a node binding's clean), on the calling thread."""
        assert self._rediscovery is not None
        self._rediscovery.refresh()
        assert self._rediscovery.current is not None
        return self._rediscovery.current

    def reset_health(self) -> None:
        """The operator's word (SIGUSR1 to the agent: `systemctl kill -s USR1 berth-agent`): every device marked
        unhealthy is healthy again, and the inventory is discovered again at once so the control plane hears it."""
        if self._health is None:
            self.log.warning("health reset asked, but this agent watches no GPU health (a simulated host)")
            return
        cleared = sum(self._health.reset(uuid) for uuid in {m.target.gpu_uuid for m in self._health.marks()})
        self.log.info("health marks cleared by the operator's signal", cleared=cleared)
        if cleared and self._rediscovery is not None and self._loop is not None:
            self._loop.run_in_executor(None, self._rediscovery.refresh)

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
        if self.link is not None:
            self.link.inventory_changed()
        self.host_view = self._host_view(inventory)
        if not first:
            self.log.info("inventory changed; re-checking bindings")
            if self.controller is not None and self._loop is not None:
                asyncio.ensure_future(self.controller.recheck("inventory changed"))

    def _host_view(self, inventory: Inventory) -> HostView:
        cfg = self.config
        assert self.probe is not None
        sim_cpus = sim_mem = sim_huge = False
        devices_proc = cfg.proc
        if cfg.simulate:
            top = self._sim_gpus.topology()
            sim_cpus = top.host is not None and top.host.cpus is not None
            sim_mem = top.host is not None and top.host.memoryGiB is not None
            sim_huge = top.host is not None and (top.host.hugepages1G is not None or top.host.hugepages2M is not None)
            if "nvidia-uvm" not in read_proc_devices(cfg.proc):
                devices_proc = simulated_devices_proc(cfg.proc, self.config.state_dir / "simulate" / "proc")
        return HostView(inventory=inventory, enforced=frozenset(self.probe.enforced), devices_proc=devices_proc,
                        simulated_cpus=sim_cpus, simulated_memory=sim_mem, simulated_hugepages=sim_huge,
                        real_cpus=len(hostfacts.online_cpus(str(cfg.sys))),
                        real_memory_bytes=hostfacts.read_meminfo(str(cfg.proc)).total_kib * 1024,
                        real_hugepages_1g=hostfacts.hugepages_total(hostfacts.SIZE_1G_KIB, str(cfg.sys)) or 0)

    async def watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_interval_s
        if not interval:
            await asyncio.Event().wait()  # no watchdog asked for: nothing to do, ever
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    # -- exec -----------------------------------------------------------------

    def _exec_target(self, rid: str) -> Target | None:
        assert self.checkpoint is not None and self.controller is not None
        entry = self.checkpoint.bindings.get(rid)
        if entry is None or entry.state != "completed":
            return None
        path = self.controller.cgroup_of(rid)
        if not path.is_dir():
            return None
        assert self.subtree is not None
        return Target(entry.tenantId, path.name, path, tuple(self.subtree.procs_paths(path.name)))

    # -- status ---------------------------------------------------------------

    def status(self) -> dict:
        age = self.metrics.heartbeat_age()
        return {
            "nodeId": self.link.identity.nodeId if self.link and self.link.identity else None,
            "controlPlane": self.config.control_plane,
            "agentVersion": AGENT_VERSION,
            "layout": self.layout.to_wire() if self.layout else None,
            "controllers": self.probe.to_wire() if self.probe else None,
            "resourceVersion": self.controller.resource_version if self.controller else 0,
            "heartbeatAgeSeconds": None if age is None else round(age, 3),
            "pendingReports": len(self.checkpoint.data.pendingReports) if self.checkpoint else 0,
            "bindings": self.controller.states if self.controller else {},
            "startupPassDone": bool(self.controller and self.controller.started),
            "execPolicy": self.config.exec_policy.to_wire(),
            "uptimeSeconds": round(time.monotonic() - self.started_at, 3),
        }

    # -- the whole life ---------------------------------------------------------

    async def _start_metrics(self) -> None:
        if not self.config.metrics_listen:
            return
        from aiohttp import web

        host, port = self.config.metrics_listen
        runner = web.AppRunner(metrics_app(self.metrics, self.status), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._metrics_runner = runner
        addrs = [f"{a[0]}:{a[1]}" for a in runner.addresses]
        self.log.info("metrics listening", address=addrs[0] if addrs else self.config.metrics_listen)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.prepare)
            assert self.subtree is not None
            self.config.exec_policy.write(self.state.path)  # where `berth exec` run as root reads it
            self._exec_gate = ExecGate(self.state.exec_socket, self.config.exec_policy, self._exec_target,
                                       proc=self.config.proc)
            self._exec_gate.log = self.log
            await self._exec_gate.start()
            await self._start_metrics()
            if self.checkpoint and self.checkpoint.data.pendingReports:
                self._reports_queued()  # unbound reports from before a crash
            assert self._rediscovery is not None
            self._rediscovery.start()
            self._start_xid_watcher()
            self.notifier.ready(status=self.probe.summary() if self.probe else "ready")
            self.log.info("agent ready", control_plane=self.config.control_plane,
                          cgroup_root=str(self.layout.root if self.layout else ""),
                          state_dir=str(self.config.state_dir), simulate=self.config.simulate)
            assert self.link is not None and self.controller is not None and self.kubernetes is not None
            self._tasks = [asyncio.ensure_future(c) for c in (
                self.link.watch_loop(), self.link.heartbeat_loop(), self.link.report_loop(),
                self.controller.periodic(self.config.reconcile_s),
                self.controller.watch_oom(self.config.oom_check_s), self.watchdog_loop(),
                self.kubernetes.watch_holds(lambda: self.controller.wanted or []))]
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
        for t in [*self._tasks, *self._rechecks]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._rechecks, return_exceptions=True)
        if self._watcher is not None:
            try:
                self._watcher.stop()
            except Exception:
                pass
        if self._rediscovery is not None:
            self._rediscovery.stop(timeout=2)
        if self._exec_gate is not None:
            await self._exec_gate.stop()
        if self.kubernetes is not None:
            await self.kubernetes.stop()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.link is not None:
            await self.link.close()
        if self.checkpoint is not None and self.controller is not None:
            try:
                async with self.controller.lock:
                    self.checkpoint.save()
            except OSError:
                pass
        self.state.close()
        if self.controller is not None:  # a start that failed says why on its own, and stopped nothing
            self.log.info("agent stopped; workloads keep running", bindings=len(self.controller.states))


# A file system that will not take the agent's state: what to do about it (the workloads are not touched)
_STORAGE = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there or raise the quota",
            errno.EROFS: "give a directory on a writable file system"}


def describe_error(exc: BaseException, state_dir: str | None = None) -> str:
    if isinstance(exc, (AgentError, CgroupError, HostReadError)):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in _STORAGE:
        where = exc.filename or state_dir or "its state directory"
        return (f"cannot write {where} ({exc.strerror}): the agent keeps its checkpoint and identity in --state-dir "
                f"{state_dir or ''}; {_STORAGE[exc.errno]} and start it again (the workloads keep running)")
    return f"{type(exc).__name__}: {exc}"

