"""Nodes: agents register, heartbeat, watch the bindings wanted on their node, and report what they bound.

The control plane's side of docs/node-api.md. An agent's inventory becomes
the node's bookable units (whole GPUs, MIG instances or slots, by the
pool's sharing) and its allocatable host resources; a declared node with the
same hostname is taken over. The bindings wanted on a node are the
reservations in `binding` or `active` that hold units there; they are kept
per node in memory, with a resource version that is a digest of the set (so
every replica, and a restarted one, gives one set one version), so a
long-polling watch answers within milliseconds of a change and a reconnect
resumes without missing or replaying anything (each answer is the whole set).
A node silent for longer than the grace is lost.
"""
from __future__ import annotations

import asyncio
import hashlib
import secrets
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Mapping

import msgspec
import structlog

from controlplane.catalog import Catalog, encode_item
from controlplane.cleaning import Cleaner
from controlplane.domain import states
from controlplane.domain.clock import Clock
from controlplane.domain.errors import CONFLICT, INVALID_INPUT, NOT_FOUND, UNAUTHENTICATED, DomainError
from controlplane.domain.ids import token_hash
from controlplane.domain.model import Bound, Node, Pool, Reservation, SshEndpoint, Unit
from common.share import Share
from controlplane.state import WriterState
from controlplane.reconciler import Reconciler
from controlplane.store.groups import log_pass_failure
from controlplane.store.port import Store, Tx
from controlplane.tokens import Tokens
from common.inventory import HOSTNAME_RULE, Inventory, InventoryError, check, check_gpus, is_hostname
from common.nodewire import (MACHINE_ID_HEADER, REPORT_STATUSES, Binding, BindingShare, BindingUnit, HeartbeatAnswer, Ignored,
                             RegisterAnswer, Report, ReportAnswer, WatchAnswer)
from controlplane.transitions import CatalogRef, Transitions

log = structlog.get_logger("berth.nodes")

HEARTBEAT_S = 5
WATCH_MAX_MS = 30_000
FOLLOWER_MERGE_PASSES = 3  # a replica that does not lead reads the others' heartbeats every 3rd monitor pass


def gpu_names(inventory: Inventory, before: Node | None) -> dict[str, str]:
    """The name of each GPU's units (`gpuN`, before `/migM` or `/slotM`), by GPU uuid: the one it had, whether it
    gave units then or not (unhealthy, or in MIG mode with no instance). NVML numbers GPUs in their order, so after
    a GPU leaves (a dead one, at a driver reload) the others move up an index: named by the index, a unit came to
    name another GPU than its bookings hold, one that other bookings held already (two reservations bound to one
    GPU). A GPU new to the node takes `gpuN` of its index unless a GPU still there has it, else `gpuN-` and its
    uuid's last eight characters."""
    had: dict[str, str] = dict(before.gpu_names) if before is not None else {}
    if before is not None and not had and before.inventory is not None:  # recorded by a release before the names
        uuid_at = {g.index: g.uuid for g in before.inventory.gpus}
        for unit in before.units:
            if unit.gpu_index in uuid_at:
                had.setdefault(uuid_at[unit.gpu_index], unit.id.split("/", 1)[0])
    names: dict[str, str] = {}
    kept = {had[g.uuid] for g in inventory.gpus if g.uuid in had}
    for gpu in inventory.gpus:
        if gpu.uuid in had:
            names[gpu.uuid] = had[gpu.uuid]
            continue
        name = f"gpu{gpu.index}"
        if name in kept or name in names.values():
            name = f"gpu{gpu.index}-{gpu.uuid[-8:]}"
        names[gpu.uuid] = name
    return names


def units_of(inventory: Inventory, pool: Pool, names: Mapping[str, str] | None = None
             ) -> tuple[tuple[Unit, ...], int, list[str]]:
    """(bookable units, GPUs, notes) of an agent's inventory in this pool, each GPU's units under its name in
    `names` (gpu_names; by default `gpuN`, N its index). GPUs counts the GPUs that give units here, as a declared
    node counts the GPUs it lists (each gives units): whole GPUs in an exclusive or slots pool (the per-GPU share
    divides the host by them), GPUs in MIG mode in a MIG pool (a node binding books every one)."""
    units: list[Unit] = []
    notes: list[str] = []
    for gpu in inventory.gpus:
        index, uuid, minor = gpu.index, gpu.uuid, gpu.minor
        name = (names or {}).get(uuid) or f"gpu{index}"
        if gpu.deviceClass != pool.gpu_model:
            notes.append(f"GPU {index} is {gpu.deviceClass}, not pool {pool.id}'s {pool.gpu_model}: not bookable here")
            continue
        if not gpu.health.healthy:
            notes.append(f"GPU {index} is unhealthy: {gpu.health.reason}")
            continue
        mig_on = gpu.migMode is not None and gpu.migMode.current
        numa = gpu.numaNode
        if pool.sharing == "mig":
            if not mig_on:
                notes.append(f"GPU {index} is not in MIG mode; pool {pool.id} books MIG instances")
                continue
            for mig in gpu.migDevices:
                if not mig.health.healthy or not mig.profile:
                    continue
                caps = mig.capMinors
                units.append(Unit(f"{name}/mig{mig.index}", index, numa, mig.profile, mig.uuid, minor,
                                  tuple(c for c in (caps.gi, caps.ci) if c is not None)))
            continue
        if mig_on:
            notes.append(f"GPU {index} is in MIG mode; pool {pool.id} books whole GPUs")
            continue
        if pool.sharing == "slots":
            units.extend(Unit(f"{name}/slot{j}", index, numa, None, uuid, minor) for j in range(pool.policy.slots_per_gpu))
        else:
            units.append(Unit(name, index, numa, None, uuid, minor))
    return tuple(units), len({u.gpu_index for u in units}), notes


def checked(inventory: Inventory, rules: Callable[[Inventory], None] = check) -> Inventory:
    """An agent's inventory, if it keeps the rules its types cannot state (common.inventory.check: a host name, no
    two GPUs with one uuid or PCI bus id); INVALID_INPUT naming the field otherwise, before anything is changed."""
    try:
        rules(inventory)
    except InventoryError as exc:
        raise DomainError(INVALID_INPUT, f"inventory.{exc}", {"field": f"inventory.{exc.field}", "rule": exc.rule}) \
            from None
    return inventory


def capacity_of(inventory: Inventory) -> Share:
    return Share(inventory.cpus.allocatableVcpuMilli, inventory.memory.allocatableMiB, inventory.hugepages.pages1G.total)


def binding_of(res: Reservation, node: Node | None, node_id: str, pool: Pool | None = None) -> Binding:
    """What the node's agent is to make of a reservation: its units there, its share and their NUMA nodes (and,
    for a kubernetes binding, the resource name of its pool; for a node binding, the tenant's keys, the login
    account and the cleaning, as fixed at creation)."""
    placement = next((p for p in res.placements if p.node_id == node_id), None)
    heard = next((b for b in res.bound if b.node_id == node_id), None)
    by_id = {u.id: u for u in node.units} if node else {}
    units = [by_id[uid] for uid in (placement.units if placement else []) if uid in by_id]
    share = res.resources
    return Binding(
        reservationId=res.id, kind=res.binding, tenantId=res.tenant_id, principalId=res.principal_id,
        start=res.start or 0, end=res.end or 0,
        units=tuple(BindingUnit(u.id, u.gpu_index, u.uuid, u.mig_profile) for u in units),
        share=BindingShare(share.vcpu_milli, share.memory_mib, share.hugepages_1g),
        numaNodes=tuple(sorted({u.numa_node for u in units if u.numa_node is not None})),
        resourceName=pool.policy.kubernetes_resource if pool is not None and res.binding == "kubernetes" else "",
        released=res.hold is not None, stuck=res.hold is not None and res.hold.carried_from is not None,
        endingAt=res.end - res.ending_warning_ms if res.end and res.ending_warning_ms else 0,
        ending=res.end is not None and res.ending_warned == res.end,
        awaitingBound=res.hold is None and (heard is None or (heard.end is not None and heard.end != (res.end or 0))),
        sshKeys=tuple(res.ssh_keys), user=res.login_user, cleaning=res.cleaning,
    )


def wanted_of(res: Reservation, catalog: Catalog) -> dict[str, Binding]:
    """The bindings a reservation wants, by node: on the nodes it is placed on while binding or active; a held
    kubernetes release, on the nodes that have not let go of its devices yet (released). Plain data: a memory
    rebuilt whole computes them apart from the API's loop (ControlPlane._read_memory)."""
    wanted = res.state in (states.BINDING, states.ACTIVE)
    on = {p.node_id for p in res.placements} if wanted else set(res.hold.nodes) if res.hold else set()
    if not on:
        return {}
    pool = catalog.pools.get(res.pool_id)
    return {node_id: binding_of(res, catalog.nodes.get(node_id), node_id, pool) for node_id in on}


async def _nothing_to_catch_up() -> None:
    """A lone control plane: nobody else writes."""


async def _heard_nothing_elsewhere() -> dict[str, int]:
    """A lone control plane: no other replica hears heartbeats."""
    return {}


# A node's resource version is a digest of its set of bindings: the XOR of each binding's own digest (52 bits, so
# that JSON carries it exactly) with EMPTY_SET. Equal sets have equal versions on every replica and across restarts,
# whatever order or batches the changes came in, so an agent whose watch moves to another replica, or comes back
# after a restart, waits there while its set stands. Never 0: an agent that knows nothing sends 0 and is answered.
EMPTY_SET = 1 << 52
_DIGEST_BITS = (1 << 52) - 1
_encode_binding = msgspec.json.Encoder().encode


def binding_digest(doc: Binding) -> int:
    return int.from_bytes(hashlib.blake2b(_encode_binding(doc), digest_size=8).digest(), "big") & _DIGEST_BITS


@dataclass
class NodeLive:
    rv: int  # the version of the set of bindings (EMPTY_SET ^ each binding's digest)
    bindings: dict[str, Binding]
    last_seen: float | None = None  # monotonic seconds of the last heartbeat; None: never (a declared node)
    lost: bool = False
    changed: asyncio.Event | None = None
    agent_version: str = ""


class NodeService:
    def __init__(self, store: Store, clock: Clock, catalog: CatalogRef, state: WriterState, moves: Transitions,
                 tokens: Tokens, reconciler: Reconciler, grace_s: float = 30.0, cleaner: Cleaner | None = None):
        self.store = store
        self.clock = clock
        self.catalog = catalog
        self.state = state
        self.moves = moves
        self.tokens = tokens
        self.grace_s = grace_s
        self.reconciler = reconciler
        self.cleaner = cleaner or Cleaner(store, clock, catalog, moves, reconciler)
        self.live: dict[str, NodeLive] = {}
        self.wanted_on: dict[str, set[str]] = {}  # reservation -> the nodes it is wanted on now
        self.heartbeat_s = min(HEARTBEAT_S, max(0.2, grace_s / 3))  # three heartbeats fit in the grace
        self.closing = False
        self.watching_since: float | None = None  # (monotonic) since when this replica leads: took_the_lead
        self._passes_following = 0  # monitor passes since this replica last led (check_lost)
        # Several replicas (controlplane/replicas.py): only the leader declares nodes lost; a heartbeat heard here
        # is shared with it, and heartbeats heard by the others are merged in before each check.
        self.leads: Callable[[], bool] = lambda: True
        self.heard: Callable[[str, int], None] = lambda node_id, at_ms: None
        self.heard_elsewhere: Callable[[], Awaitable[dict[str, int]]] = _heard_nothing_elsewhere
        self.caught_up: Callable[[], Awaitable[None]] = _nothing_to_catch_up  # that memory brought up to now
        moves.listeners.append(self._reservation_changed)

    # ---- desired bindings -----------------------------------------------------------
    def resync(self, wanted: dict[str, dict[str, Binding]]) -> None:
        """The bindings wanted now, by live reservation as the database has them (wanted_of each: at start, and
        when the writer's memory was rebuilt whole): only the nodes whose set changed move."""
        for rid, on in wanted.items():
            self._want(rid, on)
        for rid in [rid for rid in self.wanted_on if rid not in wanted]:  # ended, or no longer live
            for node_id in self.wanted_on.pop(rid):
                node = self.live.get(node_id)
                if node is not None:
                    self._set(node, rid, None)

    def _node(self, node_id: str) -> NodeLive:
        live = self.live.get(node_id)
        if live is None:
            live = self.live[node_id] = NodeLive(EMPTY_SET, {})
        return live

    @staticmethod
    def _set(live: NodeLive, rid: str, doc: Binding | None) -> None:
        """The node's binding of reservation rid becomes doc (None: none): its version follows the set (each
        binding's digest in or out of it), and its watches are answered."""
        old = live.bindings.pop(rid, None) if doc is None else live.bindings.get(rid)
        if old == doc:
            return
        if doc is not None:
            live.bindings[rid] = doc
        live.rv ^= (0 if old is None else binding_digest(old)) ^ (0 if doc is None else binding_digest(doc))
        if live.changed is not None:
            live.changed.set()
            live.changed = None

    def _wanted_on_node(self, node_id: str) -> list[str]:
        live = self.live.get(node_id)
        return list(live.bindings) if live is not None else []

    def _reservation_changed(self, res: Reservation) -> None:
        self._want(res.id, wanted_of(res, self.catalog.current))

    def _want(self, rid: str, on: dict[str, Binding]) -> None:
        """The reservation's bindings as `on` has them, by node: a node whose binding changed moves."""
        for node_id, doc in on.items():
            self._set(self._node(node_id), rid, doc)
        # Only the nodes that hold it are visited (not every node of the fleet, on every save of any reservation).
        for node_id in self.wanted_on.get(rid, set()).difference(on):
            live = self.live.get(node_id)
            if live is not None:
                self._set(live, rid, None)
        if on:
            self.wanted_on[rid] = set(on)
        else:
            self.wanted_on.pop(rid, None)

    # ---- authentication ------------------------------------------------------------
    def node_of_token(self, token: str, machine_id: str = "") -> Node:
        """The node a node token speaks for. `machine_id` (the calling agent's host; empty from an agent of an
        earlier release) must be the host the node was registered from: a state directory copied to another host
        (a cloned image) carries the token, and its agent would bind every reservation of the node a second time."""
        found = self.tokens.resolve(token)
        if found is None or found[0] != "node":
            raise DomainError(UNAUTHENTICATED, "Authorization: not a node token; register with the pool's bootstrap token",
                              {"field": "Authorization"})
        node = self.catalog.current.nodes.get(found[1])
        if node is None:
            raise DomainError(UNAUTHENTICATED, "Authorization: the token's node no longer exists", {"field": "Authorization"})
        if machine_id and node.machine_id and machine_id != node.machine_id:
            log.warning("node token refused: another host", node_id=node.id, recorded=node.machine_id,
                        machine_id=machine_id)
            raise DomainError(CONFLICT, f"{MACHINE_ID_HEADER}: node {node.id}'s token was issued to the host with "
                              f"machine id {node.machine_id}, and this agent runs on {machine_id}: its state directory "
                              "was copied from that host (a cloned image, a restored backup?). Remove node.json from "
                              "this host's state directory, and it registers anew: as a node of its own, or as this "
                              "one where an operator released its identity",
                              {"field": MACHINE_ID_HEADER, "nodeId": node.id, "rule": "machine_id"})
        return node

    def pool_of_bootstrap(self, token: str) -> Pool:
        found = self.tokens.resolve(token)
        if found is None or found[0] != "node-bootstrap":
            raise DomainError(UNAUTHENTICATED, "Authorization: not a pool bootstrap token (see the bootstrap file's nodeTokens)",
                              {"field": "Authorization"})
        pool = self.catalog.current.pools.get(found[1])
        if pool is None:
            raise DomainError(UNAUTHENTICATED, "Authorization: the token's pool no longer exists", {"field": "Authorization"})
        return pool

    # ---- register and inventory ----------------------------------------------------------
    async def register(self, pool: Pool, hostname: str, inventory: Inventory, agent_version: str = "",
                       machine_id: str = "") -> RegisterAnswer:
        token = "nt_" + secrets.token_urlsafe(32)
        if not is_hostname(hostname):  # the node's id is made of it
            raise DomainError(INVALID_INPUT, f"hostname: {hostname!r} is not {HOSTNAME_RULE}",
                              {"field": "hostname", "rule": HOSTNAME_RULE})
        checked(inventory)

        def job(tx: Tx) -> Node:
            catalog = self.catalog.current
            existing = next((n for n in catalog.nodes.values() if n.hostname == hostname), None)
            if existing is not None and existing.pool_id != pool.id:
                raise DomainError(INVALID_INPUT, f"hostname: {hostname} is node {existing.id} of pool {existing.pool_id}, "
                                  f"not of pool {pool.id}; use that pool's bootstrap token",
                                  {"field": "hostname", "nodeId": existing.id, "poolId": existing.pool_id})
            if existing is not None:
                self._check_takeover(existing, machine_id, inventory.bootId)
            node_id = existing.id if existing else f"{pool.id}-{hostname}"
            node = self._apply_inventory(tx, catalog, pool, node_id, hostname, inventory, machine_id=machine_id)
            tx.delete_tokens("node", node_id)
            tx.put_token(token_hash(token), "node", node_id)
            rows = {h: ks for h, ks in self.tokens.rows.items() if ks != ("node", node_id)}
            rows[token_hash(token)] = ("node", node_id)
            self.tokens.rows = rows
            return node

        node = await self.store.call(job)
        live = self._node(node.id)
        live.last_seen = self.clock.monotonic()
        live.agent_version = agent_version
        if self._is_lost(node.id):
            await self._found(node.id)
        log.info("node registered", node_id=node.id, pool_id=pool.id, units=len(node.units), agent_version=agent_version)
        return RegisterAnswer(node.id, token, pool.id, self.heartbeat_s, self.grace_s, live.rv)

    def _check_takeover(self, node: Node, machine_id: str, boot_id: str | None = None) -> None:
        """May this registration take the node? Not while its agent is alive (unless the same host comes back from
        a new boot, as after a reset: the agent that sent the last heartbeat is gone with the old boot), and once
        it is lost only from the host that registered it (its machine id), unless an operator released the
        node's identity."""
        if node.declared or node.identity_released:
            return
        live = self.live.get(node.id)
        release = f"berth admin nodes release-identity {node.id}"
        last_boot = node.inventory.bootId if node.inventory is not None else None
        rebooted = bool(node.machine_id and machine_id == node.machine_id and boot_id and last_boot
                        and boot_id != last_boot)
        if live is not None and live.last_seen is not None and not live.lost and not rebooted:
            ago = self.clock.monotonic() - live.last_seen
            if ago <= self.grace_s:
                log.warning("registration refused: the node's agent is alive", node_id=node.id,
                            heartbeat_s_ago=round(ago, 1), machine_id=machine_id)
                raise DomainError(CONFLICT, f"hostname: {node.hostname} is node {node.id}, whose agent is alive (last "
                                  f"heartbeat {ago:.0f} s ago); a second agent may not register it. If this host "
                                  f"replaces it, an operator releases the node first: {release}",
                                  {"field": "hostname", "nodeId": node.id, "rule": "live_agent"})
        if node.machine_id and machine_id != node.machine_id:
            log.warning("registration refused: another machine id", node_id=node.id, recorded=node.machine_id,
                        machine_id=machine_id)
            raise DomainError(CONFLICT, f"machineId: node {node.id} was registered by the host with machine id "
                              f"{node.machine_id}, not {machine_id or '(none)'}; only that host may take it over. If "
                              f"this host replaces it, an operator releases the node first: {release}",
                              {"field": "machineId", "nodeId": node.id, "rule": "machine_id"})

    async def release_identity(self, node_id: str) -> Node:
        """Let the next registration of this node come from any host (a replaced or reinstalled machine)."""
        def job(tx: Tx) -> Node:
            catalog = self.catalog.current
            node = catalog.nodes.get(node_id)
            if node is None:
                raise DomainError(NOT_FOUND, f"nodeId: no node {node_id!r}", {"field": "nodeId"})
            node = replace(node, identity_released=True)
            tx.put_catalog("node", node_id, encode_item(node))
            self.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node_id: node})
            return node

        node = await self.store.call(job)
        log.warning("node identity released: its next registration may come from any host", node_id=node_id,
                    recorded_machine_id=node.machine_id)
        return node

    def _apply_inventory(self, tx: Tx, catalog: Catalog, pool: Pool, node_id: str, hostname: str,
                         inventory: Inventory, machine_id: str | None = None) -> Node:
        """machine_id: given by a registration (recorded, and any release used up); None keeps the node's."""
        old = catalog.nodes.get(node_id)
        names = gpu_names(inventory, old)
        units, gpus, notes = units_of(inventory, pool, names)
        if machine_id is None:
            machine_id, released = (old.machine_id, old.identity_released) if old is not None else ("", False)
        else:
            released = False
        node = Node(node_id, pool.id, hostname, units, gpus, capacity_of(inventory), declared=False,
                    schedulable=old.schedulable if old is not None and not old.declared else True,
                    machine_id=machine_id, identity_released=released,
                    state=old.state if old is not None else "ready",  # an operator's cordon outlives inventories
                    state_reason=old.state_reason if old is not None else "",
                    bmc=old.bmc if old is not None else None, inventory=inventory,
                    cleaning=old.cleaning if old is not None else None, gpu_names=tuple(sorted(names.items())))
        if old != node:
            tx.put_catalog("node", node_id, encode_item(node))
            tx.touch()
            self.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node_id: node})
            self.state.add_nodes([node])
            if old is not None and {u.id for u in old.units} != {u.id for u in units}:
                self._devices_lost(tx, node_id)
            for note in notes:
                log.info("inventory note", node_id=node_id, note=note)
        self.cleaner.came_back(tx, node_id, inventory, self.clock.compute_now())  # back from a redfish reset?
        return self.catalog.current.nodes[node_id]

    def _devices_lost(self, tx: Tx, node_id: str) -> None:
        """DevicesLost on each live reservation booked on the node, worked out over all its nodes (a gang's): set
        while a node of it does not report a device it holds, cleared once they all do again (a GPU back after a
        driver reload)."""
        now = self.clock.compute_now()
        calendar, nodes = self.state.calendar, self.catalog.current.nodes
        pool = calendar.pools.get(nodes[node_id].pool_id)
        cal = pool.nodes.get(node_id) if pool is not None else None
        for rid in cal.owners() if cal is not None else ():
            res = tx.reservation(rid)
            if res is None or res.state in states.TERMINAL:
                continue
            missing: dict[str, list[str]] = {}
            for b in calendar.bookings_of(rid):
                reported = {u.id for u in nodes[b.node_id].units} if b.node_id in nodes else set()
                if lost := sorted(set(b.units) - reported):
                    missing[b.node_id] = lost
            if missing:
                res.set_condition("DevicesLost", "True", "InventoryChanged", "; ".join(
                    f"node {n} no longer reports {', '.join(units)}" for n, units in sorted(missing.items())), now)
            elif any(c.type == "DevicesLost" for c in res.conditions):
                res.clear_condition("DevicesLost")
            else:
                continue
            self.moves.save(tx, res)

    async def update_inventory(self, node: Node, inventory: Inventory) -> None:
        checked(inventory, check_gpus)  # not the hostname: the node's id was made at its registration
        pool = self.catalog.current.pools[node.pool_id]
        await self.store.call(
            lambda tx: self._apply_inventory(tx, self.catalog.current, pool, node.id, node.hostname, inventory))

    # ---- heartbeats and loss ----------------------------------------------------------------
    async def heartbeat(self, node: Node, inventory: Inventory | None, agent_version: str = "") -> HeartbeatAnswer:
        live = self._node(node.id)
        live.last_seen = self.clock.monotonic()
        if agent_version:  # an agent restarted or upgraded in place (it keeps its token), or this replica restarted
            live.agent_version = agent_version
        self.heard(node.id, self.clock.compute_now())
        if inventory is not None:
            await self.update_inventory(node, inventory)
        if self._is_lost(node.id):
            await self._found(node.id)
        current = self.catalog.current.nodes.get(node.id, node)
        return HeartbeatAnswer(live.rv, self.grace_s, REPORT_STATUSES, agentVersion=live.agent_version,
                               nodeState=current.state)

    def _is_lost(self, node_id: str) -> bool:
        """Lost here, or by another replica (the catalog, as the database has it, says so)."""
        node = self.catalog.current.nodes.get(node_id)
        return self._node(node_id).lost or (node is not None and not node.schedulable)

    async def _merge_heard_elsewhere(self) -> None:
        """Heartbeats other replicas heard (epoch ms), as this replica's monotonic seconds (read off the loop: a
        database that stopped answering must not hold every request of the leader)."""
        seen = await self.heard_elsewhere()
        if not seen:
            return
        wall, mono = self.clock.compute_now(), self.clock.monotonic()
        for node_id, at_ms in seen.items():
            if node_id not in self.catalog.current.nodes:
                continue
            live = self._node(node_id)
            at = mono - max(0, wall - at_ms) / 1000
            if live.last_seen is None or at > live.last_seen:
                live.last_seen = at

    def took_the_lead(self) -> None:
        """This replica watches for lost nodes from now on."""
        self.watching_since = self.clock.monotonic()

    async def check_lost(self) -> list[str]:
        """Mark nodes silent for longer than the grace as lost; the ids newly lost (none unless this replica
        leads: the others hear heartbeats and share them)."""
        if not self.leads():
            # what a replica that does not lead shows (the admin API, /metrics) is what every replica heard too,
            # read every few passes: an agent behind a balancer may beat on the others only
            self._passes_following += 1
            if self._passes_following % FOLLOWER_MERGE_PASSES == 1:
                await self._merge_heard_elsewhere()
            return []
        self._passes_following = 0
        await self._merge_heard_elsewhere()
        now = self.clock.monotonic()
        nodes = self.catalog.current.nodes
        # The grace counts from this replica's taking the lead too: agents silent while no control plane ran (a
        # restart, a whole cluster down longer than the grace) get their grace to speak again, and one that never
        # does is lost after it, like one that stops speaking later. A node no agent holds a token for (declared,
        # never registered) has nobody to wait for.
        since = self.watching_since if self.watching_since is not None else now
        registered = self.tokens.holders("node")
        for node_id in registered & nodes.keys():
            self._node(node_id)  # watched whether heard since or not
        for nid, live in self.live.items():  # lost or found by another replica meanwhile
            node = nodes.get(nid)
            live.lost = node is not None and not node.schedulable
        lost = [nid for nid, live in self.live.items()
                if not live.lost and (live.last_seen is not None or nid in registered)
                and now - max(since, live.last_seen or since) > self.grace_s]
        for node_id in lost:
            for pool_id in await self.store.call(lambda tx, n=node_id: self._lose(tx, n), background=True):
                self.reconciler.capacity_freed(pool_id)
            self.live[node_id].lost = True
            log.warning("node lost", node_id=node_id, silent_s=round(now - (self.live[node_id].last_seen or now), 1))
        return lost

    def _set_schedulable(self, tx: Tx, node_id: str, value: bool) -> None:
        catalog = self.catalog.current
        node = catalog.nodes.get(node_id)
        if node is None or node.schedulable == value:
            return
        node = replace(node, schedulable=value)
        tx.put_catalog("node", node_id, encode_item(node))
        self.catalog.current = catalog.with_changes(nodes={**catalog.nodes, node_id: node})

    def _reservations_on(self, tx: Tx, node_id: str) -> list[Reservation]:
        out = []
        for rid in self._wanted_on_node(node_id):
            res = tx.reservation(rid)
            if res is not None and res.state in (states.BINDING, states.ACTIVE):
                out.append(res)
        return out

    def _lose(self, tx: Tx, node_id: str) -> set[str]:
        """The node is lost: its bindings not yet active fail their create (the reservation ends: nothing may bill
        behind a failed create); active ones carry NodeLost; those placed on it whose window is still ahead move to
        other nodes where they fit, as on a drain, and the rest stay with NodeLost. The pools whose capacity this
        freed."""
        now = self.clock.compute_now()
        self._set_schedulable(tx, node_id, False)
        freed: set[str] = set()
        node = self.catalog.current.nodes.get(node_id)
        if node is not None:
            # Those that fit elsewhere move; the rest stay (the node may be back before their window: sent back to
            # pending, they could lose its capacity to a create meanwhile) and fail at their start if it is not.
            moved, kept = self.moves.move_off(tx, node, now, "lost", keep=True)
            if moved:
                freed.add(node.pool_id)  # a gang moved whole freed its other nodes
            for res in filter(None, map(tx.reservation, kept)):
                self._mark_lost(tx, res, node_id, now, "no other node has room for this reservation's window: it "
                                "stays placed there, and fails at its window's start if the node is not back by then")
            if moved or kept:
                log.warning("placed reservations of a lost node", node_id=node_id, moved=len(moved), kept=len(kept))
        for res in self._reservations_on(tx, node_id):
            if res.state == states.BINDING:
                self.moves.end(tx, res, now, "node-lost", actor="platform", nodeId=node_id)
                freed.add(res.pool_id)
                continue
            self._mark_lost(tx, res, node_id, now)
        for rid in self._wanted_on_node(node_id):  # held releases: the hold ends with it
            res = tx.reservation(rid)
            if res is not None and res.hold is not None and self.moves.allocation_released(
                    tx, res, node_id, now, "NodeLost", f"node {node_id} was lost while it held the devices"):
                freed.add(res.pool_id)
        return freed

    def _mark_lost(self, tx: Tx, res: Reservation, node_id: str, now: int, then: str = "") -> None:
        """NodeLost on a reservation the node holds (active) or will hold (placed ahead), with its event."""
        message = f"node {node_id} has not been heard from for more than {self.grace_s:g} s"
        res.set_condition("NodeLost", "True", "HeartbeatMissed", f"{message} and {then}" if then else message, now)
        self.moves.save(tx, res)
        self.moves.event(tx, res, "reservation.node-lost", now, nodeId=node_id)

    async def _found(self, node_id: str) -> None:
        def job(tx: Tx) -> None:
            now = self.clock.compute_now()
            self._set_schedulable(tx, node_id, True)
            node = self.catalog.current.nodes.get(node_id)
            ahead = [r for r in map(tx.reservation, self.moves.placed_ahead(node, now) if node else ())
                     if r is not None and r.state == states.PLACED]
            for res in self._reservations_on(tx, node_id) + ahead:
                if any(c.type == "NodeLost" for c in res.conditions):
                    res.clear_condition("NodeLost")
                    self.moves.save(tx, res)
                    self.moves.event(tx, res, "reservation.node-found", now, nodeId=node_id)

        await self.store.call(job)
        self.live[node_id].lost = False
        log.info("node back", node_id=node_id)
        self.reconciler.capacity_freed(self.catalog.current.nodes[node_id].pool_id)

    async def run_monitor(self, interval_s: float = 1.0) -> None:
        while True:
            try:
                await self.check_lost()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                log_pass_failure(log, "node monitor pass", exc)
            await asyncio.sleep(interval_s)

    # ---- watch ----------------------------------------------------------------------------------
    async def watch(self, node: Node, rv: int | None, timeout_ms: int) -> WatchAnswer:
        if rv is not None and rv != self._node(node.id).rv:
            # The agent's last answer may have come from a replica further on than this one: catch up first, or
            # this one would answer an older set (and the agent unbind what that replica bound, or bind what it
            # released). A lone control plane has nothing to catch up with.
            await self.caught_up()
        live = self._node(node.id)
        if rv is None or rv != live.rv or timeout_ms <= 0 or self.closing:
            return self._watch_answer(node.id, live, changed=rv != live.rv)
        if live.changed is None:
            live.changed = asyncio.Event()
        event = live.changed
        try:
            await asyncio.wait_for(event.wait(), timeout_ms / 1000)
        except asyncio.TimeoutError:
            return self._watch_answer(node.id, live, changed=False)
        return self._watch_answer(node.id, live, changed=rv != live.rv)  # (changed, and back again: no change)

    def close(self) -> None:
        """Answer every long poll now (the control plane is stopping)."""
        self.closing = True
        for live in self.live.values():
            if live.changed is not None:
                live.changed.set()
                live.changed = None

    def _watch_answer(self, node_id: str, live: NodeLive, changed: bool) -> WatchAnswer:
        node = self.catalog.current.nodes.get(node_id)
        return WatchAnswer(live.rv, tuple(sorted(live.bindings.values(), key=lambda b: b.reservationId)),
                           changed=changed, nodeState=node.state if node is not None else "")

    # ---- reports ----------------------------------------------------------------------------------
    async def report(self, node: Node, reports: tuple[Report, ...]) -> ReportAnswer:
        def job(tx: Tx) -> ReportAnswer:
            now = self.clock.compute_now()
            accepted: list[str] = []
            ignored: list[Ignored] = []
            for rep in reports:
                rid = rep.reservationId
                res = tx.reservation(rid)
                if res is None or not any(p.node_id == node.id for p in res.placements):
                    ignored.append(Ignored(rid, "not a reservation of this node"))
                    continue
                if rep.status == "bound":
                    if res.state not in (states.BINDING, states.ACTIVE):
                        ignored.append(Ignored(rid, f"the reservation is {res.state}"))
                        continue
                    self._bound(tx, res, node.id, rep, now)
                elif rep.status == "unbound":
                    if res.binding == "node":  # handed back: the node is cleaned before anyone books it again
                        self.cleaner.begin(tx, node.id, res, now)
                    res.bound = [b for b in res.bound if b.node_id != node.id]
                    self.moves.confirm(res, now)
                    if rep.evicted:
                        self.moves.event(tx, res, "reservation.pods-evicted", now, nodeId=node.id,
                                         pods=list(rep.evicted))
                    if self.moves.allocation_released(tx, res, node.id, now):
                        tx.on_commit(lambda pool_id=res.pool_id: self.reconciler.capacity_freed(pool_id))
                    self.moves.save(tx, res)
                elif rep.status == "held":
                    if res.hold is None or node.id not in res.hold.nodes:
                        ignored.append(Ignored(rid, "the reservation holds no devices on this node"))
                        continue
                    self.moves.held(res, node.id, list(rep.holders), now)
                    self.moves.save(tx, res)
                elif rep.status == "waiting":
                    if res.state not in (states.BINDING, states.ACTIVE):
                        ignored.append(Ignored(rid, f"the reservation is {res.state}"))
                        continue
                    if any(b.node_id == node.id for b in res.bound):
                        ignored.append(Ignored(rid, "the reservation is bound on this node"))
                        continue
                    res.set_condition("DevicesBound", "False", "PodsInTheWay",
                                      f"node {node.id}: {(rep.message or 'pods hold the devices')}"[:500], now)
                    self.moves.save(tx, res)
                elif rep.status == "cleaned":  # a node binding's in-band clean check after its hand-back
                    why = self.cleaner.cleaned(tx, node.id, rid, rep.clean, now)
                    if why is not None:
                        ignored.append(Ignored(rid, why))
                        continue
                else:  # failed
                    if res.state not in (states.BINDING, states.ACTIVE):
                        ignored.append(Ignored(rid, f"the reservation is {res.state}"))
                        continue
                    message = f"node {node.id}: {(rep.message or 'binding failed')[:500]}"
                    res.set_condition("DevicesBound", "False", "BindFailed", message, now)
                    # bound here before: until this node binds again (another node's report does not clear it)
                    res.bound = [replace(b, failed=message) if b.node_id == node.id else b for b in res.bound]
                    if res.binding == "node" and res.state == states.BINDING:
                        self._handover_failed(tx, res, node.id, message, now)
                    else:
                        self.moves.save(tx, res)
                accepted.append(rid)
            return ReportAnswer(tuple(accepted), tuple(ignored))

        return await self.store.call(job)

    def _handover_failed(self, tx: Tx, res: Reservation, node_id: str, message: str, now: int) -> None:
        """A node binding's node could not be handed over (the keys could not be installed): the create fails, the
        platform's doing, and nothing bills; the node's own message says why."""
        self.moves.end(tx, res, now, "handover-failed", actor="platform", nodeId=node_id)
        op = res.create_operation()
        if op is not None and op.failure is not None:
            op.failure.message = f"{op.failure.message} ({message})"
            self.moves.save(tx, res)
        tx.on_commit(lambda pool_id=res.pool_id: self.reconciler.capacity_freed(pool_id))

    def _bound(self, tx: Tx, res: Reservation, node_id: str, rep: Report, now: int) -> None:
        devices = list(rep.devices)
        mine = next((b for b in res.bound if b.node_id == node_id), None)
        ssh = (SshEndpoint(rep.ssh.host, rep.ssh.port, rep.ssh.user, tuple(rep.ssh.hostKeys))
               if rep.ssh is not None else None)
        same = mine is not None and (mine.cgroup, mine.devices, mine.end, mine.ssh) == (rep.cgroup, devices, rep.end,
                                                                                         ssh)
        failed_before = mine is not None and mine.failed is not None  # this node reported failed since it bound
        if same and rep.oomKills <= mine.oom_kills and not failed_before:
            return  # a repeated report changes nothing
        before = mine.oom_kills if mine is not None and mine.cgroup == rep.cgroup else 0
        if rep.oomKills > before:
            self._oom_killed(tx, res, node_id, rep.oomKills, rep.oomKills - before, now)
        node = self.catalog.current.nodes.get(node_id)
        # a node binding's hand-over: the node as it was then is what its cleaning must bring it back to
        handed = (mine.inventory if mine is not None and mine.inventory is not None else
                  node.inventory if res.binding == "node" and node is not None else None)
        res.bound = [b for b in res.bound if b.node_id != node_id] + [
            Bound(node_id, mine.at if same else now, rep.cgroup, devices, rep.end, rep.oomKills, ssh, handed)]
        failed = next((b.failed for b in res.bound if b.failed is not None), None)  # another node's, still
        every = {p.node_id for p in res.placements} <= {b.node_id for b in res.bound}
        if failed_before and res.state == states.ACTIVE:  # bound again (a GPU back): said once no node is failed
            if failed is not None:
                res.set_condition("DevicesBound", "False", "BindFailed", failed, now)
            elif every:
                self.moves.devices_bound(res, now)
        if not same:
            self.moves.confirm(res, now)
            if rep.unenforced:  # bound, but the host could not enforce all of the share
                res.set_condition("Enforced", "False", "PartialEnforcement",
                                  f"node {node_id} could not enforce: {', '.join(rep.unenforced)}"[:500], now)
        if res.state == states.BINDING and every and failed is None:  # a gang's node that failed holds it back
            self.moves.mark_active(tx, res, now)
        else:
            self.moves.save(tx, res)

    def _oom_killed(self, tx: Tx, res: Reservation, node_id: str, total: int, new: int, now: int) -> None:
        """The tenant learns that its workload outgrew its memory share: a condition on get, an event."""
        mib = res.resources.memory_mib
        share = f"{mib / 1024:g} GiB per node" if mib else "the node's memory"
        res.set_condition("OOMKilled", "True", "MemoryLimit",
                          f"node {node_id}: the OOM killer ended {total} process(es) of this reservation, which used "
                          f"more memory than its share ({share}); book more with --memory-gib", now)
        self.moves.event(tx, res, "reservation.oom-killed", now, nodeId=node_id, oomKills=total, new=new)
        log.warning("workload OOM-killed", reservation_id=res.id, node_id=node_id, oom_kills=total)

    def gauges(self) -> list[tuple[Node, str, float | None, int, int]]:
        """Per node for /metrics: (node, state with lost over the operator's, heartbeat age or None, bindings
        wanted, releases held)."""
        now = self.clock.monotonic()
        out = []
        for node in self.catalog.current.nodes.values():
            live = self.live.get(node.id)
            age = now - live.last_seen if live is not None and live.last_seen is not None else None
            wanted = list(live.bindings.values()) if live is not None else []
            held = sum(1 for b in wanted if b.released)
            lost = (live is not None and live.lost) or not node.schedulable
            out.append((node, "lost" if lost else node.state, age, len(wanted) - held, held))
        return out

