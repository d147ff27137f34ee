"""Cleaning: a bare-metal node taken back from a node binding (tenant root) is cleaned before anyone books it again.

At the hand-back (the agent's `unbound` report for a node binding) the node
goes to state `cleaning`, so placement passes it by. Then, by the pool's
`policy.tenantRoot.cleaning`:

- inband: the agent cleans the node and reports `cleaned` with its check;
  ok returns the node to the state it had (ready, or an operator's cordon),
  not ok puts it in maintenance with the differences as its reason;
- redfish: the control plane resets the system through the node's BMC
  (controlplane/bmc.py; a one-time boot source when the pool names one) and
  returns the node only when its agent comes back from another boot (a new
  boot id) with the inventory recorded at the hand-over; any difference puts
  it in maintenance.

A node not clean within the turnaround (the time the calendar keeps it past
the window) goes to maintenance too: it stays out of placement until an
operator clears it (`berth admin nodes clear NODE`). Each step is an event in
the fleet's stream.
"""
from __future__ import annotations

from dataclasses import replace

import structlog

from common.inventory import Inventory
from common.inventory import differences as inventory_differences
from common.nodewire import CleanCheck
from controlplane.domain import node_states
from controlplane.domain.clock import Clock
from controlplane.domain.model import Cleaning, Node, Reservation
from controlplane.domain.timers import CLEANING as CLEANING_TIMER
from controlplane.reconciler import Reconciler
from controlplane.store.port import Store, Tx
from controlplane.transitions import CatalogRef, Transitions

log = structlog.get_logger("berth.cleaning")

RETURNS = (node_states.READY, node_states.CORDONED, node_states.DRAINING)  # states a cleaning starts from
MAX_SHOWN = 20  # differences named in a maintenance reason


def differences(recorded: Inventory | None, now: Inventory) -> list[str]:
    """How the node's inventory differs from the one recorded at the hand-over, said plainly (a new boot id is
    expected, and not a difference)."""
    if recorded is None:
        return ["no inventory was recorded at the hand-over, so the node cannot be checked against it"]
    return inventory_differences(recorded, now)


class Cleaner:
    def __init__(self, store: Store, clock: Clock, catalog: CatalogRef, moves: Transitions, reconciler: Reconciler):
        self.store = store
        self.clock = clock
        self.catalog = catalog
        self.moves = moves
        self.reconciler = reconciler
        reconciler.cleaning_overdue = self.overdue
        self._asking: set[tuple[str, str]] = set()  # (node, reservation) whose reset is being asked now

    # ---- the hand-back --------------------------------------------------------------------------------
    def begin(self, tx: Tx, node_id: str, res: Reservation, now: int) -> None:
        """The agent handed the node back (keys removed, sessions ended): clean it before it takes placements."""
        node = self.catalog.current.nodes.get(node_id)
        if node is None or (node.cleaning is not None and node.cleaning.reservation_id == res.id):
            return  # a repeated report
        if node.state not in RETURNS:  # maintenance, or another cleaning: already out of placement
            log.warning("hand-back of a node not taking placements: left as it is", node_id=node_id,
                        reservation_id=res.id, state=node.state)
            return
        pool = self.catalog.current.pools.get(node.pool_id)
        mode = res.cleaning or (pool.policy.cleaning if pool else "inband")
        turnaround = res.turnaround_ms or (pool.policy.turnaround_ms if pool else 0)
        bound = next((b for b in res.bound if b.node_id == node_id), None)
        recorded = bound.inventory if bound is not None and bound.inventory is not None else node.inventory
        boot = node.inventory.bootId if node.inventory is not None else None
        cleaning = Cleaning(res.id, mode, now, now + turnaround, node.state, boot or "", recorded)
        awaited = ("its agent's clean check" if mode == "inband" else
                   "its agent back from a new boot after the BMC reset, with the inventory of the hand-over")
        self.moves.put_node(tx, replace(node, state=node_states.CLEANING, cleaning=cleaning,
                                        state_reason=f"cleaning ({mode}) after reservation {res.id}: waiting for "
                                                     f"{awaited}"))
        self.moves.state.timers.add(cleaning.deadline, CLEANING_TIMER, node_id)
        self._event(tx, node, "node.cleaning", node_states.CLEANING, now, res.id, mode, deadline=cleaning.deadline)
        log.info("node cleaning", node_id=node_id, reservation_id=res.id, cleaning=mode, deadline=cleaning.deadline)
        if mode == "redfish":
            if node.bmc is None:
                self.moves.to_maintenance(tx, node_id, "NoBmc", f"pool {node.pool_id} cleans by redfish but node "
                                          f"{node_id} declares no bmc in the bootstrap file", now)
                return
            tx.on_commit(lambda: self.reconciler.background(self._reset(node_id, res.id)))

    # ---- inband -----------------------------------------------------------------------------------------
    def cleaned(self, tx: Tx, node_id: str, reservation_id: str, check: CleanCheck | None, now: int) -> str | None:
        """The agent's clean check after the hand-back of reservation_id; why the report is ignored, or None."""
        node = self.catalog.current.nodes.get(node_id)
        cleaning = node.cleaning if node is not None else None
        if node is None or cleaning is None or cleaning.reservation_id != reservation_id:
            if node is not None and check is not None and not check.ok and node.state != node_states.MAINTENANCE:
                # Late (its cleaning timed out, or an operator cleared the node first): the agent found the node
                # not clean, and refuses it to anyone until the control plane takes it out and an operator clears it
                found = "; ".join(check.differences[:MAX_SHOWN]) or "the agent's clean check failed"
                self.moves.to_maintenance(tx, node_id, "CleaningFailed", f"after reservation {reservation_id}, "
                                          f"reported after its cleaning had ended: {found}", now)
                return None
            return f"node {node_id} is not being cleaned after this reservation"
        if cleaning.mode != "inband":
            return f"node {node_id} is cleaned out of band ({cleaning.mode}): it returns after the reset and a new boot"
        if check is None:
            return "a cleaned report carries clean: {ok, differences}"
        if check.ok:
            self._clean(tx, node, now)
        else:
            found = "; ".join(check.differences[:MAX_SHOWN]) or "the agent's clean check failed"
            self.moves.to_maintenance(tx, node_id, "CleaningFailed", f"after reservation {reservation_id}: {found}",
                                      now)
        return None

    # ---- redfish ------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """On taking the lead (a start, a failover): ask again for each redfish reset asked before but not recorded
        as accepted, since the replica that asked may have died before the BMC's answer was stored (a reset asked
        twice reboots the node twice; one never asked would leave it cleaning until its time runs out)."""
        for node in self.catalog.current.nodes.values():
            cleaning = node.cleaning
            if (node.state == node_states.CLEANING and cleaning is not None and cleaning.mode == "redfish"
                    and not cleaning.reset and node.bmc is not None):
                log.warning("node reset asked again: none was recorded as accepted", node_id=node.id,
                            reservation_id=cleaning.reservation_id)
                self.reconciler.background(self._reset(node.id, cleaning.reservation_id))

    async def _reset(self, node_id: str, reservation_id: str) -> None:
        """Reset the node through its BMC (in a worker thread), then record what the BMC accepted or refused."""
        node = self.catalog.current.nodes.get(node_id)
        if (node is None or node.bmc is None or node.cleaning is None or node.cleaning.reservation_id != reservation_id
                or node.cleaning.reset or (node_id, reservation_id) in self._asking):
            return
        self._asking.add((node_id, reservation_id))
        try:
            await self._ask_reset(node, reservation_id)
        finally:
            self._asking.discard((node_id, reservation_id))

    async def _ask_reset(self, node: Node, reservation_id: str) -> None:
        from controlplane.bmc import Bmc, BmcError  # sushy is imported only where a node is reset

        assert node.bmc is not None
        node_id = node.id
        pool = self.catalog.current.pools.get(node.pool_id)
        override = (pool.policy.boot_override if pool else "") or None
        try:
            bmc = Bmc(node.bmc.redfish_url, node.bmc.system_id, node.bmc.credentials_file, ca_file=node.bmc.ca_file)
            result = await bmc.reset_async(override)
        except BmcError as exc:
            error = str(exc)
            log.error("node reset failed", node_id=node_id, reservation_id=reservation_id, error=error)
            await self.store.call(lambda tx: self._reset_failed(tx, node_id, reservation_id, error), background=True)
            return
        await self.store.call(lambda tx: self._reset_done(tx, node_id, reservation_id, result), background=True)

    def _current(self, node_id: str, reservation_id: str) -> Node | None:
        node = self.catalog.current.nodes.get(node_id)
        ok = node is not None and node.cleaning is not None and node.cleaning.reservation_id == reservation_id
        return node if ok else None

    def _reset_failed(self, tx: Tx, node_id: str, reservation_id: str, error: str) -> None:
        if self._current(node_id, reservation_id) is not None:
            self.moves.to_maintenance(tx, node_id, "ResetFailed", error, self.clock.compute_now())

    def _reset_done(self, tx: Tx, node_id: str, reservation_id: str, result) -> None:
        node = self._current(node_id, reservation_id)
        if node is None:
            return
        assert node.cleaning is not None
        self.moves.put_node(tx, replace(node, cleaning=replace(node.cleaning, reset=result.reset)))
        tx.event(node_states.FLEET_EVENTS, None, "node.reset", self.clock.compute_now(),
                 {"nodeId": node_id, "poolId": node.pool_id, "state": node.state, "by": "platform",
                  "reservationId": reservation_id, "reset": result.reset, "bootOverride": result.boot_override,
                  "powerBefore": result.power_before, "powerAfter": result.power_after})

    def came_back(self, tx: Tx, node_id: str, inventory: Inventory, now: int) -> None:
        """The node's agent sent an inventory (registering, or a heartbeat): after a redfish reset, one from a new
        boot ends the cleaning: clean when it equals the hand-over's, else maintenance with the differences."""
        node = self.catalog.current.nodes.get(node_id)
        cleaning = node.cleaning if node is not None else None
        if node is None or cleaning is None or cleaning.mode != "redfish" or not cleaning.reset:
            return
        if not inventory.bootId or inventory.bootId == cleaning.boot_id:
            return  # not rebooted yet
        found = differences(cleaning.inventory, inventory)
        if found:
            shown = "; ".join(found[:MAX_SHOWN]) + (f" and {len(found) - MAX_SHOWN} more" if len(found) > MAX_SHOWN
                                                      else "")
            self.moves.to_maintenance(tx, node_id, "CleaningFailed", f"node {node_id} came back from its reset "
                                      f"after reservation {cleaning.reservation_id} unlike it was handed over: {shown}",
                                      now)
            return
        self._clean(tx, node, now)

    # ---- the end of a cleaning ------------------------------------------------------------------------------
    def _clean(self, tx: Tx, node: Node, now: int) -> None:
        cleaning = node.cleaning
        assert cleaning is not None
        back = replace(node, state=cleaning.before, state_reason="", cleaning=None)
        self.moves.put_node(tx, back)
        self._event(tx, node, "node.cleaned", cleaning.before, now, cleaning.reservation_id, cleaning.mode)
        log.info("node clean", node_id=node.id, reservation_id=cleaning.reservation_id, state=cleaning.before)
        if back.placeable:
            tx.on_commit(lambda: self.reconciler.capacity_freed(node.pool_id))

    def overdue(self, tx: Tx, node_id: str, now: int) -> bool:
        """The cleaning's time is up and the node is not clean: maintenance (a timer of the reconciler)."""
        node = self.catalog.current.nodes.get(node_id)
        cleaning = node.cleaning if node is not None else None
        if node is None or cleaning is None or cleaning.deadline > now:
            return False
        minutes = (cleaning.deadline - cleaning.since) / 60_000
        awaited = ("no clean check came from its agent" if cleaning.mode == "inband" else
                   "no BMC reset was recorded as accepted (the BMC did not answer)" if not cleaning.reset else
                   "its agent did not come back from a new boot")
        self.moves.to_maintenance(tx, node_id, "CleaningTimedOut", f"node {node_id} was not clean {minutes:g} min "
                                  f"after the hand-back of reservation {cleaning.reservation_id} ({cleaning.mode}): "
                                  f"{awaited}", now)
        return True

    @staticmethod
    def _event(tx: Tx, node: Node, type_: str, state: str, now: int, reservation_id: str, mode: str, **data) -> None:
        tx.event(node_states.FLEET_EVENTS, None, type_, now,
                 {"nodeId": node.id, "poolId": node.pool_id, "state": state, "from": node.state, "by": "platform",
                  "reservationId": reservation_id, "cleaning": mode, **data})
