"""The link to the control plane: register, heartbeat, watch and report, each a loop with backoff.

Register once with the bootstrap token (or reuse the stored node token),
heartbeat on the interval the control plane gave (the inventory rides along
when it changed), long-poll the watch with the last resource version and hand
every answer (always the complete wanted set) to the binding controller, and
deliver the reports the binder queued in the checkpoint until the control
plane took them. A refused node token means someone registered meanwhile:
register again. No answer at all is retried with exponential backoff and
jitter; nothing here ever removes a binding.
"""
from __future__ import annotations

import asyncio
import random
import ssl
import time
from typing import Callable

import structlog

from agent.checkpoint import Checkpoint, Identity, StateDir
from agent.controller import BindingController
from agent.metrics import AgentMetrics
from agent.nodeclient import NodeApiError, NodeClient, Unauthorized, Unreachable
from common.inventory import Inventory
from common.nodewire import HeartbeatAnswer, Report

log = structlog.get_logger("berth.agent")

REPORT_BATCH = 500  # the node API takes at most 1000 reports per call


def next_batch(pending: list[Report]) -> list[Report]:
    """The reports of the next call, in queue order: `waiting` reports go in calls of their own, after the others,
    since a replica of an earlier release (behind the same balancer as one that takes them, in a rolling upgrade)
    refuses a whole call for a status it does not know, and a refused call is dropped."""
    others = [r for r in pending if r.status != "waiting"]
    return (others or pending)[:REPORT_BATCH]


def heartbeat_interval(heartbeat_s: float | None, grace_s: float | None) -> float:
    """The control plane's interval, but at least three heartbeats per grace period (one lost packet, or a
    slow one, must not make the node lost)."""
    out = heartbeat_s or 5.0
    if grace_s:
        out = min(out, grace_s / 3)
    return max(0.05, out)


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


class ControlPlaneLink:
    def __init__(self, control_plane: str, bootstrap_token: str, state: StateDir, checkpoint: Checkpoint,
                 controller: BindingController, metrics: AgentMetrics, *, inventory: Callable[[], Inventory | None],
                 agent_version: str, wall_ms: Callable[[], int], on_node: Callable[[str], None],
                 heartbeat_s: float | None = None, watch_timeout_ms: int = 25_000, backoff_min_s: float = 0.2,
                 backoff_max_s: float = 10.0, request_timeout_s: float = 10.0, machine_id: str = "",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.control_plane = control_plane
        self.machine_id = machine_id  # this host's /etc/machine-id, sent at register (docs/node-api.md)
        self.bootstrap_token = bootstrap_token
        self.state = state
        self.checkpoint = checkpoint
        self.controller = controller
        self.metrics = metrics
        self.inventory = inventory
        self.agent_version = agent_version
        # the last heartbeat's answer named a version (this control plane's release takes the field): every heartbeat
        # carries ours (behind a balancer each replica learns it so), but not the first (an older one refuses it)
        self.sends_version = False
        self.wall_ms = wall_ms
        self.on_node = on_node  # the node id is known (bind it into the logs)
        self.fixed_heartbeat_s = heartbeat_s  # None: what the control plane says
        self.watch_timeout_ms = watch_timeout_ms
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.client = NodeClient(control_plane, timeout_s=request_timeout_s, ssl_context=ssl_context)
        self.client.machine_id = machine_id
        self.identity: Identity | None = None
        self.heartbeat_s = heartbeat_s or 5.0
        self.inventory_dirty = True  # send the inventory with the next heartbeat
        self.reports_wake = asyncio.Event()
        self._registered = asyncio.Event()
        self._register_lock = asyncio.Lock()
        self.log = log

    def restore(self) -> None:
        """Reuse the node identity stored by an earlier run, if it is for this control plane."""
        identity = self.state.read_identity()
        if identity is not None and identity.controlPlane != self.control_plane:
            self.log.warning("stored node identity is for another control plane; registering anew",
                             stored=identity.controlPlane, now=self.control_plane)
            identity = None
        if identity is not None:
            self.identity = identity
            self.client.token = identity.nodeToken
            self.heartbeat_s = self.fixed_heartbeat_s or identity.heartbeatSeconds
            self.on_node(identity.nodeId)

    def inventory_changed(self) -> None:
        self.inventory_dirty = True

    async def register(self) -> None:
        """Register with the bootstrap token (retrying with backoff until it works or the agent stops)."""
        async with self._register_lock:
            await self._register()

    async def _register(self) -> None:
        """Register, the register lock held (register() and _reregister() take it)."""
        backoff = Backoff(self.backoff_min_s, self.backoff_max_s)
        while True:
            inv = self.inventory()
            assert inv is not None
            try:
                ans = await self.client.register(self.bootstrap_token, inv.hostname, inv, self.agent_version,
                                                 self.machine_id)
                break
            except (Unreachable, NodeApiError) as exc:
                # A refused token, or a node another agent holds (409: alive, or registered from another
                # machine), or a TLS handshake that failed: the operator must act, so say it loudly, and keep
                # trying (a release, the other agent's loss or a fixed certificate lets a later attempt through).
                taken = isinstance(exc, NodeApiError) and exc.code == "CONFLICT"
                tls_failed = isinstance(exc, Unreachable) and exc.tls is not None
                level = "error" if isinstance(exc, Unauthorized) or taken or tls_failed else "warning"
                getattr(self.log, level)("register refused: the node is held by another agent; retrying" if taken
                                         else "register failed; retrying", error=str(exc),
                                         machine_id=self.machine_id or None)
                await asyncio.sleep(backoff.next())
        interval = heartbeat_interval(ans.heartbeatSeconds, ans.graceSeconds)
        self.identity = Identity(nodeId=ans.nodeId, nodeToken=ans.nodeToken, controlPlane=self.control_plane,
                                 poolId=ans.poolId, hostname=inv.hostname, registeredAtMs=self.wall_ms(),
                                 heartbeatSeconds=interval)
        self.state.write_identity(self.identity)
        self.heartbeat_s = heartbeat_interval(self.fixed_heartbeat_s or interval, ans.graceSeconds)
        self.inventory_dirty = False  # register carried it
        self.on_node(ans.nodeId)
        self.checkpoint.set_node(ans.nodeId)
        self.controller.binder.forget_reports()  # a fresh registration: tell the control plane everything again
        self.log.info("registered", pool_id=ans.poolId, heartbeat_s=self.heartbeat_s, grace_s=ans.graceSeconds,
                      resource_version=ans.resourceVersion)
        self._registered.set()

    async def _reregister(self, token_used: str | None) -> None:
        """A call made with `token_used` was refused: register again, unless another loop already did. Checked
        under the register lock: the heartbeat and the watch are often refused together (a restored database, a
        stale node.json), and the second register, made while its own agent is alive, was refused as a node
        another agent holds, retried until the node was lost."""
        async with self._register_lock:
            if self.client.token != token_used:
                return  # another loop registered meanwhile: its token is the one to use
            self.log.warning("node token refused; registering again")
            await self._register()

    async def watch_loop(self) -> None:
        if self.client.token is None:
            await self.register()
        backoff = Backoff(self.backoff_min_s, self.backoff_max_s)
        rv = 0  # at start: the complete wanted set at once, for the start-up pass
        while True:
            token = self.client.token
            try:
                ans = await self.client.watch(rv, self.watch_timeout_ms)
            except Unauthorized:
                await self._reregister(token)
                rv = 0
                continue
            except (Unreachable, NodeApiError) as exc:
                self.metrics.watch_reconnects += 1
                if isinstance(exc, NodeApiError) and exc.code == "INVALID_INPUT":
                    rv = 0  # the control plane will not take this version (it never gave it): start again whole
                delay = backoff.next()
                self.log.warning("watch failed; reconnecting", error=str(exc), retry_in_s=round(delay, 3),
                                 resource_version=rv)
                await asyncio.sleep(delay)
                continue
            seen = time.monotonic()
            if backoff.n:
                self.log.info("watch resumed", resource_version=rv, now=ans.resourceVersion)
            backoff.reset()
            await self._heard_node_state(ans.nodeState)  # before the pass: an operator's clear first
            if ans.changed or not self.controller.started or ans.resourceVersion != rv:
                await self.controller.reconcile(list(ans.bindings), seen, resource_version=ans.resourceVersion,
                                                why="watch" if self.controller.started else "start-up pass")
            rv = ans.resourceVersion

    async def heartbeat_loop(self) -> None:
        if self.client.token is None:
            await self._registered.wait()
        while True:
            token = self.client.token
            inv = self.inventory()
            assert inv is not None
            send = inv if self.inventory_dirty else None
            try:
                ans = await self._heartbeat(send)
                self._keep_to_grace(ans.graceSeconds)
                self._takes_reports(ans.reportStatuses)
                await self._heard_node_state(ans.nodeState)
                self.metrics.heartbeats_ok += 1
                self.metrics.last_heartbeat = time.monotonic()
                if send is not None and self.inventory() is inv:
                    self.inventory_dirty = False
            except Unauthorized:
                self.metrics.heartbeat_failures += 1
                await self._reregister(token)
                continue
            except (Unreachable, NodeApiError) as exc:
                self.metrics.heartbeat_failures += 1
                self.log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(self.heartbeat_s)

    def _keep_to_grace(self, grace_s: float | None) -> None:
        """Three heartbeats in the grace each answer names: a control plane restarted with a shorter `--node-grace`
        than the one the stored interval (or `--heartbeat-seconds`) was made for lost the node between heartbeats."""
        wanted = self.fixed_heartbeat_s or (self.identity.heartbeatSeconds if self.identity else self.heartbeat_s)
        interval = heartbeat_interval(wanted, grace_s)
        if interval != self.heartbeat_s:
            self.log.info("heartbeat interval set to fit the control plane's grace", heartbeat_s=interval,
                          grace_s=grace_s)
            self.heartbeat_s = interval

    async def _heartbeat(self, inventory: Inventory | None) -> HeartbeatAnswer:
        """One heartbeat, with this agent's version once answers name versions (an agent keeps its token across
        restarts and does not register again, so after an upgrade in place, or a control plane's restart, this is how
        every replica learns what runs). Refused with it (behind one balancer in a rolling upgrade, a replica of an
        earlier release refuses the field), it goes again at once without it."""
        version = self.agent_version if self.sends_version else ""
        try:
            ans = await self.client.heartbeat(inventory, version)
        except NodeApiError as exc:
            if not version or isinstance(exc, Unauthorized):
                raise
            ans = await self.client.heartbeat(inventory)
        self.sends_version = ans.agentVersion is not None
        return ans

    async def _heard_node_state(self, state: str) -> None:
        """The node's state as the control plane answered it (a heartbeat, a watch): node bindings take it."""
        if state and self.controller.nodes is not None:
            await asyncio.to_thread(self.controller.nodes.heard_node_state, state)

    def _takes_reports(self, statuses: tuple[str, ...]) -> None:
        """What the control plane's release takes: `waiting` only where it says so (an older one refuses the
        whole batch a report of a status it does not know rides in)."""
        pods = self.controller.kubernetes
        if pods is not None and pods.report_waiting != ("waiting" in statuses):
            pods.report_waiting = "waiting" in statuses
            pods.on_change()  # a booking already waiting is reported now

    async def report_loop(self) -> None:
        backoff = Backoff(self.backoff_min_s, self.backoff_max_s)
        while True:
            await self.reports_wake.wait()
            self.reports_wake.clear()
            pending = list(self.checkpoint.data.pendingReports)
            self.metrics.reports_pending = len(pending)
            if not pending or self.client.token is None:
                continue
            token = self.client.token
            pending = next_batch(pending)
            others = pending[0].status != "waiting"
            try:
                ans = await self.client.report(pending)
            except Unauthorized:
                await self._reregister(token)
                self.reports_wake.set()
                continue
            except (Unreachable, NodeApiError) as exc:
                if isinstance(exc, NodeApiError) and exc.status in (400, 404, 413, 422):
                    # the control plane will never take these as they are: say so once, do not loop on them
                    if not others:  # only `waiting` reports: a replica of an earlier release
                        self.log.warning("waiting reports refused by the control plane (an earlier release?); "
                                         "dropped", reservations=[r.reservationId for r in pending])
                    else:
                        self.log.error("reports refused by the control plane; dropped", error=str(exc),
                                       reservations=[r.reservationId for r in pending])
                    ans = None
                else:
                    delay = backoff.next()
                    self.log.warning("report failed; retrying", error=str(exc), pending=len(pending),
                                     retry_in_s=round(delay, 3))
                    await asyncio.sleep(delay)
                    self.reports_wake.set()
                    continue
            backoff.reset()
            for ig in (ans.ignored if ans is not None else ()):
                self.log.warning("report ignored by the control plane", reservation_id=ig.reservationId,
                                 reason=ig.reason)
            async with self.controller.lock:
                # accepted or ignored, the control plane has its answer; a report queued meanwhile stays
                self.checkpoint.data.pendingReports = [r for r in self.checkpoint.data.pendingReports
                                                       if r not in pending]
                await asyncio.to_thread(self.checkpoint.save)
                self.metrics.reports_pending = len(self.checkpoint.data.pendingReports)
            if self.checkpoint.data.pendingReports:
                self.reports_wake.set()

    async def close(self) -> None:
        await self.client.close()

